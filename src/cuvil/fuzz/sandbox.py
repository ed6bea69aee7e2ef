"""Run fuzz cases in a forked worker process, so a crash or a hang costs one case, not the campaign.

The worker is forked from the parent after Cuvil and the family are imported, so (re)starting one takes
milliseconds. It runs one case per request (``case(seed) -> (outcome, message)``); a worker that dies is a
CRASH, one that does not answer within the case's time limit is a HANG, and either way a fresh worker takes
over for the next case.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import resource
import signal
import time
import traceback
from typing import Callable, Optional, Tuple

from .report import CRASH, FOREIGN, HANG, FamilyReport

# Address-space cap of a worker: an allocation a check forgot becomes a MemoryError (a non-Cuvil exception)
# instead of a visit from the OOM killer.
WORKER_MEMORY_BYTES = 8 << 30

CaseFn = Callable[[int], Tuple[str, str]]


def _serve(conn, case: CaseFn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    faulthandler.disable()  # a crash is reported by the parent as one line; an inherited handler (pytest's) dumps stacks
    try:
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    while True:
        try:
            seed = conn.recv()
        except EOFError:
            return
        try:
            result = case(seed)
        except BaseException as e:  # noqa: BLE001 - a family's own harness failed: report, keep serving
            result = (FOREIGN, f"{type(e).__name__} in the fuzz harness: {e} | {_where(e)}")
        conn.send(result)


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-4:]))


class Sandbox:
    """One worker process serving ``case``; :meth:`run` gives each seed's outcome."""

    def __init__(self, case: CaseFn, timeout_s: float):
        self.case, self.timeout_s = case, timeout_s
        self._ctx = multiprocessing.get_context("fork")
        self._proc: Optional[multiprocessing.Process] = None
        self._conn = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.case), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def run(self, seed: int) -> Tuple[str, str]:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        died = False
        try:
            self._conn.send(seed)
            if self._conn.poll(self.timeout_s):
                return self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            died = True
            self._proc.join(30)  # the pipe closed: the worker is on its way out (a core dump can take a while)
        alive = not died and self._proc.is_alive()
        code = self._proc.exitcode
        self._stop()
        if alive:
            return HANG, f"no result within {self.timeout_s:g} s"
        sig = -code if code is not None and code < 0 else None
        return CRASH, (f"worker killed by signal {signal.Signals(sig).name}" if sig else f"worker exited with code {code}")

    def close(self) -> None:
        self._stop()


def run_cases(family: str, case: CaseFn, budget: int, seed: int, timeout_s: float,
              progress: Optional[Callable[[FamilyReport], None]] = None) -> FamilyReport:
    """Cases ``seed``, ``seed + 1``, ... ``seed + budget - 1`` of one family, each in the sandbox."""
    report = FamilyReport(family)
    box = Sandbox(case, timeout_s)
    t0 = time.perf_counter()
    try:
        for k in range(budget):
            outcome, message = box.run(seed + k)
            report.add(outcome, seed + k, message)
            if progress is not None and (k + 1) % 500 == 0:
                report.seconds = time.perf_counter() - t0
                progress(report)
    finally:
        box.close()
        report.seconds = time.perf_counter() - t0
    return report
