"""Progress on long work: what Cuvil is doing, on stderr, for whoever asked to see it.

Library code reports without knowing whether anyone listens::

    with progress.stage("llvm IR", total=len(stages), unit="kernels") as s:
        for st in stages:
            ...
            s.advance(item=st.name)

Off by default: a library user sees nothing unless they opt in, for a block (``with
cuvil.progress.enabled():``) or for one call (``Pipeline.compile(..., progress=True)``). The setting is
context-local (:mod:`contextvars`): a thread or task that did not opt in stays quiet, and ``enabled(False)``
silences a block inside an enabled one. The CLI opts in when stderr is a terminal or with ``--progress``,
never with ``-q`` (:func:`wanted`).

Everything goes to stderr (stdout holds results only). On a terminal each stage is a tqdm bar, left on
screen when it ends, so the stages read as a list with their times. Elsewhere (``--progress`` into a log)
each stage starts with one plain line stamped with the seconds since progress was enabled; its steps
follow as lines (each step that names an item, such as a kernel; other steps at most one a second) and
a closing line gives its figures.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, Optional, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: Seconds between two lines of one stage when progress is written as lines, for steps that name no item.
LINE_INTERVAL = 1.0
#: Seconds between two redraws of a bar whose stage is inside one long call (LLVM optimising a module): its
#: clock keeps moving, so the stage does not look stuck.
TICK = 1.0


class _Reporter:
    """Where progress goes while it is enabled: the stream, bars (a terminal) or lines, and the start time."""

    def __init__(self, stream: TextIO, bars: bool):
        self.stream, self.bars, self.t0 = stream, bars, time.perf_counter()

    def line(self, text: str) -> None:
        # through tqdm: a line written while a bar is drawn goes above the bar instead of through it
        tqdm.write(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=self.stream)


_current: contextvars.ContextVar[Optional[_Reporter]] = contextvars.ContextVar("cuvil_progress", default=None)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # a closed or file-like stream without isatty
        return False


def wanted(quiet: bool = False, forced: bool = False, stream: Optional[TextIO] = None) -> bool:
    """The CLI's rule: progress unless ``quiet`` (``-q``), when stderr is a terminal or when ``forced``
    (``--progress``)."""
    return not quiet and (forced or _is_terminal(stream if stream is not None else sys.stderr))


@contextlib.contextmanager
def enabled(on: bool = True, *, stream: Optional[TextIO] = None, bars: Optional[bool] = None) -> Iterator[None]:
    """Progress on (or, with ``on=False``, off) inside the block, for this context only. ``stream``: default
    stderr; ``bars``: tqdm bars (default when ``stream`` is a terminal) or plain lines. Enabling inside an
    enabled block keeps the outer one's stream and clock."""
    if on and stream is None and bars is None and _current.get() is not None:
        yield
        return
    reporter = None
    if on:
        stream = stream if stream is not None else sys.stderr
        reporter = _Reporter(stream, _is_terminal(stream) if bars is None else bars)
    token = _current.set(reporter)
    try:
        yield
    finally:
        _current.reset(token)


def is_enabled() -> bool:
    """Whether progress is shown in this context."""
    return _current.get() is not None


class Stage:
    """One stage of work being reported (:func:`stage`); silent when progress is off."""

    def advance(self, n: int = 1, item: Optional[str] = None) -> None:
        """``n`` more steps done; ``item`` names the one just done (a kernel)."""

    def show(self, **figures) -> None:
        """Figures shown beside the stage (``max_rel_error="2.1e-07"``), replacing earlier values."""

    def detail(self, text: str) -> None:
        """What the stage is doing or found, shown after its name (``"18 -> 14 nodes"``)."""


_SILENT = Stage()


class _Shown(Stage):
    def __init__(self, reporter: _Reporter, name: str, total: Optional[int], unit: str, detail: str):
        self.r, self.name, self.total, self.unit = reporter, name, total, unit
        self.n, self.item, self.text, self.figures = 0, None, detail, {}
        self.t0 = time.perf_counter()
        self.last_line = self.t0
        self.bar = None
        self.unshown = False   # something changed since the last line (line mode)
        if reporter.bars:
            fmt = ("{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} " + unit + " [{elapsed}{postfix}]"
                   if total else "{desc} [{elapsed}{postfix}]")
            self.bar = tqdm(total=total, desc=name, file=reporter.stream, leave=True, bar_format=fmt,
                            dynamic_ncols=True, mininterval=0.1, postfix=detail or None)
            self.stop = threading.Event()
            self.ticker = threading.Thread(target=self._tick, name="cuvil-progress", daemon=True)
            self.ticker.start()
        else:
            reporter.line(f"{name}: " + ", ".join(p for p in (detail, self._count()) if p) if detail or total
                          else name)

    def _tick(self) -> None:
        # llvmlite and ptxas release the GIL while they work, so this thread runs during their long calls
        while not self.stop.wait(TICK):
            self.bar.refresh()

    def _count(self) -> str:
        return f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}" if self.n else ""

    def _postfix(self) -> str:
        parts = [p for p in (self.text, self.item) if p] + [f"{k.replace('_', ' ')} {v}" for k, v in self.figures.items()]
        text = ", ".join(parts)
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
        return text

    def advance(self, n: int = 1, item: Optional[str] = None) -> None:
        self.n += n
        self.item = item
        if self.bar is not None:
            self._postfix()
            self.bar.update(n)
            return
        now = time.perf_counter()
        if item is not None or now - self.last_line >= LINE_INTERVAL:
            self.last_line, self.unshown = now, False
            self.r.line(f"{self.name}: " + ", ".join(p for p in (self._count(), item, self._figures()) if p))
        else:
            self.unshown = True

    def _figures(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.figures.items())

    def show(self, **figures) -> None:
        self.figures.update(figures)
        self.unshown = True
        if self.bar is not None:
            self._postfix()

    def detail(self, text: str) -> None:
        self.text = text
        self.unshown = True
        if self.bar is not None:
            self._postfix()
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.stop.set()
            self.ticker.join()
            self.item = None
            self._postfix()
            self.bar.close()
        elif self.unshown or self.n:
            took = f"{self._count()} in {time.perf_counter() - self.t0:.1f} s" if self.n else ""
            self.r.line(f"{self.name}: " + ", ".join(p for p in (self.text, took, self._figures()) if p))


@contextlib.contextmanager
def stage(name: str, total: Optional[int] = None, unit: str = "", detail: str = "") -> Iterator[Stage]:
    """Report a stage of work named ``name`` (``total`` steps of ``unit``, if known; ``detail``: what it
    works on) while the block runs; yields a :class:`Stage` to advance. Nothing at all when progress is off."""
    reporter = _current.get()
    if reporter is None:
        yield _SILENT
        return
    shown = _Shown(reporter, name, total, unit, detail)
    try:
        yield shown
    finally:
        shown.close()


def track(items: Iterable[T], name: str, total: Optional[int] = None, unit: str = "",
          item: Callable[[T], Optional[str]] = lambda x: None) -> Iterator[T]:
    """``items``, reported as a stage of one step each (``item`` names a step, from the element)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)   # type: ignore[arg-type]
    with stage(name, total, unit) as s:
        for x in items:
            yield x
            s.advance(item=item(x))
