"""``cuvil verify``: fuzz an optimized model against the original through onnx.reference.

Hypothesis draws inputs (symbolic dims inside their ranges); the optimized model must agree bit for bit
when only ``prove exact`` rules fired, and within :data:`cuvil.testing.rules.REAL_RTOL` otherwise. On a
difference Hypothesis shrinks the input to a minimal one, which is reported. Each run also reports the largest
error it saw (:class:`LargestError`), and, with progress on (:mod:`cuvil.progress`), each example as it runs
with the largest error so far.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional, Sequence, Tuple

import attrs
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from .artifact import load
from .dsl.parser import load_rules
from .errors import CuvilError
from .ir.dim import SymExpr
from .pipeline import Pipeline
from .progress import enabled as progress_enabled
from .progress import stage
from .rewrite_rules.verdicts import builtin_rules
from .testing.rules import REAL_RTOL
from .testing.strategies import inputs_for


@attrs.define
class LargestError:
    """The largest difference a run saw between an output of the original and of the model checked against
    it: ``abs`` = max |got - want| over the elements where the original is finite (a NaN where it is not
    counts as infinite), ``rel`` = ``abs`` over ``scale``, the output's largest finite magnitude (at least 1),
    which is what the tolerance bounds. ``example`` counts from 1 in the order the examples ran; ``shapes``
    are its inputs' shapes."""
    abs: float
    rel: float
    scale: float
    output: str
    example: int
    shapes: Dict[str, Tuple[int, ...]]


@attrs.define
class VerifyResult:
    examples: int
    exact: bool                         # only exact rules fired: compared bit for bit
    rules_fired: Dict[str, int]
    failure: Optional[str] = None       # the message, with the minimal failing input
    failing_input: Optional[Dict[str, np.ndarray]] = None
    largest: Optional[LargestError] = None   # None: no example ran
    rtol: float = 0.0                   # the tolerance judged against (0: bit for bit)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def error_line(self) -> str:
        """One line: the largest error found (absolute and relative, which output, which example) and the
        tolerance it was judged against."""
        tol = "bit for bit" if self.exact else f"rel {self.rtol:g} of the output's largest magnitude (at least 1)"
        e = self.largest
        if e is None:
            return f"largest error: none, no example ran; tolerance: {tol}"
        if e.abs == 0 and self.ok:
            return f"largest error: 0 (every output equal on all {self.examples} examples); tolerance: {tol}"
        shapes = ", ".join(f"{k} {'x'.join(map(str, v)) or 'scalar'}" for k, v in e.shapes.items())
        return (f"largest error: abs {e.abs:.3g}, rel {e.rel:.3g} (of {e.scale:.3g}) in output {e.output!r} on "
                f"example {e.example} of {self.examples} ({shapes}); tolerance: {tol}")


def error_of(want: np.ndarray, got: np.ndarray) -> Optional[Tuple[float, float, float]]:
    """(abs, rel, scale) of ``got`` against ``want`` as :class:`LargestError` defines them; None where they
    cannot be compared as numbers (shapes or dtypes differ, strings)."""
    if want.shape != got.shape or want.dtype != got.dtype or want.dtype.kind not in "biuf":
        return None
    err, scale = _errors(want, got)
    top = float(np.max(err)) if err.size else 0.0
    return top, top / scale, scale


def _errors(want: np.ndarray, got: np.ndarray) -> Tuple[np.ndarray, float]:
    """Elementwise |got - want| (float64; 0 where the original is not finite, inf where only ``got`` is NaN)
    and the output's scale: its largest finite magnitude, at least 1."""
    w, g = want.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - w)
    err[~finite] = 0
    err[np.isnan(err)] = np.inf
    scale = max(float(np.max(np.abs(w[finite]))), 1.0) if finite.any() else 1.0
    return err, scale


class _Largest:
    """The largest error so far over a run's examples, shown on its progress stage."""

    def __init__(self, bar):
        self.bar, self.found = bar, None

    def see(self, example: int, name: str, want: np.ndarray, got: np.ndarray, feeds) -> None:
        e = error_of(want, got)
        if e is None or (self.found is not None and not e[1] > self.found.rel):
            return
        self.found = LargestError(e[0], e[1], e[2], name, example, {k: tuple(np.shape(v)) for k, v in feeds.items()})
        self.bar.show(max_error=f"{e[1]:.3g} rel in {name!r}")


def compare(want: np.ndarray, got: np.ndarray, exact: bool, rtol: float = REAL_RTOL) -> Optional[str]:
    """None when ``got`` agrees with ``want`` (bit for bit when ``exact``, else within ``rtol`` of the output's
    largest finite magnitude, at least 1; a NaN where the original is finite never agrees), else why not."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    if exact:
        if want.dtype.kind == "f":
            same = (want.view(f"u{want.itemsize}") == got.view(f"u{got.itemsize}")) | (np.isnan(want) & np.isnan(got))
        else:
            same = want == got
        if not np.all(same):
            i = tuple(np.argwhere(~same)[0])
            return f"bits differ at {list(i)}: original {want[i]!r}, optimized {got[i]!r}"
        return None
    if not np.isfinite(want).any():
        return None
    err, scale = _errors(want, got)
    if np.max(err) > rtol * scale:
        i = tuple(np.unravel_index(int(np.argmax(err)), err.shape))
        return f"error {err[i]:.3g} at {list(i)} over tolerance {rtol} x {scale:.3g}: original {want[i]!r}, optimized {got[i]!r}"
    return None


def verify(source, *, rules: Sequence = (), examples: int = 50, seed: Optional[int] = 0, max_dim: int = 4,
           progress: Optional[bool] = None) -> VerifyResult:
    """Fuzz ``source`` optimized (with the built-in rules and ``rules``) against ``source`` through
    onnx.reference on ``examples`` inputs. ``progress``: True shows each stage and example on stderr, False
    hides them, None leaves it to the caller's ``cuvil.progress.enabled()`` (off outside one)."""
    with progress_enabled(progress) if progress is not None else contextlib.nullcontext():
        return _verify(source, rules, examples, seed, max_dim)


def _verify(source, rules: Sequence, examples: int, seed: Optional[int], max_dim: int) -> VerifyResult:
    src = source if isinstance(source, Pipeline) else Pipeline.from_onnx(source)
    opt = src.optimize(rules=list(rules) or None)
    obligations = {r.name: r.proof for r in builtin_rules() + (load_rules(list(rules)) if rules else [])}
    fired = {k: v for k, v in opt.report.applied.items() if v}
    exact = all(obligations.get(name) == "exact" for name in fired)
    state = {"n": 0, "fail": None, "input": None}
    how = "bit for bit" if exact else f"within rel {REAL_RTOL:g}"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(feeds=inputs_for(src, max_dim=max_dim, special=exact))
    def check(feeds):
        state["n"] += 1
        want, got = src.run_reference(feeds), opt.run_reference(feeds)
        for name in src.graph.output_names:
            largest.see(state["n"], name, want[name], got[name], feeds)
        bar.advance()
        for name in src.graph.output_names:
            msg = compare(want[name], got[name], exact)
            if msg:
                state["fail"], state["input"] = f"output {name!r}: {msg}", feeds
                raise AssertionError(msg)

    with stage("verify", total=examples, unit="examples", detail=f"optimized vs original, {how}") as bar:
        largest = _Largest(bar)
        try:
            check()
        except AssertionError:
            pass  # the last failure recorded is Hypothesis's shrunk, minimal one
        except Unsatisfiable:
            pass
    return VerifyResult(state["n"], exact, fired, state["fail"], state["input"], largest.found,
                        0.0 if exact else REAL_RTOL)


# Native kernels reassociate reductions and contract multiply-adds: compiled outputs are compared with
# the original through onnx.reference within this relative tolerance (of the output's largest magnitude).
NATIVE_RTOL = 1e-4


def verify_artifact(source, library: str, *, examples: int = 30, seed: Optional[int] = 0,
                    max_dim: int = 4, num_threads: int = 0, progress: Optional[bool] = None,
                    model: Optional[str] = None) -> VerifyResult:
    """Fuzz a compiled library against the *original* model through onnx.reference (finite inputs of the
    library's shapes; a symbolic dim inside the library's profile, at most ``max_dim`` where the profile allows);
    a difference is shrunk to a minimal input. ``num_threads``: the library's threads (0 = all cores).
    ``progress`` as for :func:`verify`. ``model``: the model's path as the user spelled it, named in errors
    (default: ``source`` where it is a path)."""
    with progress_enabled(progress) if progress is not None else contextlib.nullcontext():
        if model is None:
            model = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "MODEL.onnx"
        return _verify_artifact(source, library, examples, seed, max_dim, num_threads, model)


def _check_same_interface(src: Pipeline, lib, library: str, model: str) -> None:
    """Refuse a library compiled from another model before any example runs (the reference run of a large model
    takes minutes, and would end in a confusing missing-input error)."""
    want = [(v.name, len(v.shape or ())) for v in src.graph.inputs]
    have = [(spec.name, len(spec.shape)) for spec in lib.inputs]
    if sorted(want) != sorted(have):  # by name: the order is the library's to keep
        show = lambda io: ", ".join(f"{n} (rank {r})" for n, r in io)  # noqa: E731
        raise CuvilError(f"{library}: its inputs do not match the model's: not compiled from this model",
                         details=[f"library: {show(have)}", f"model: {show(want)}"],
                         hint=f"compile it from this model (cuvil compile {model} -o {library}), or give the model "
                              "the library was compiled from")


def _verify_artifact(source, library: str, examples: int, seed: Optional[int], max_dim: int,
                     num_threads: int, model: str) -> VerifyResult:
    src = source if isinstance(source, Pipeline) else Pipeline.from_onnx(source)
    lib = load(library, num_threads=num_threads)
    _check_same_interface(src, lib, library, model)
    # Inputs take the library's shapes: a dim it fixed at that value, a symbol inside the library's own profile
    # (the source model's symbols carry no range).
    fixed = {}
    for v, spec in zip(src.graph.inputs, lib.inputs):
        for d, n in zip(v.shape or (), spec.shape):
            if n is not None and isinstance(d, SymExpr) and str(d) in src.graph.symbols:
                fixed[str(d)] = int(n)
    drawn = src.specialize(fixed) if fixed else src
    profiles = {name: (p.min, p.max) for name, p in lib.symbols.items() if name in drawn.graph.symbols}
    drawn = drawn.with_profiles(profiles, check=False) if profiles else drawn
    state = {"n": 0, "fail": None, "input": None}

    @st.composite
    def feeds(draw):
        return draw(inputs_for(drawn, max_dim=max_dim))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(f=feeds())
    def check(f):
        state["n"] += 1
        want = src.run_reference(f)
        got = dict(zip([o.name for o in lib.outputs], lib.run(**f)))
        for name in src.graph.output_names:
            largest.see(state["n"], name, want[name], got[name], f)
        bar.advance()
        for name in src.graph.output_names:
            w, g = want[name], got[name]
            msg = compare(w, g, exact=False, rtol=NATIVE_RTOL)
            if msg:
                state["fail"], state["input"] = f"output {name!r}: {msg}", f
                raise AssertionError(msg)

    with stage("verify", total=examples, unit="examples",
               detail=f"{os.path.basename(os.path.normpath(library))} vs original, within rel {NATIVE_RTOL:g}") as bar:
        largest = _Largest(bar)
        try:
            check()
        except AssertionError:
            pass
    return VerifyResult(state["n"], False, {}, state["fail"], state["input"], largest.found, NATIVE_RTOL)
