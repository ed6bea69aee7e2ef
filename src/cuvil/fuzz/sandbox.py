"""Run fuzz cases in a forked worker process, so a crash or a hang costs one case, not the campaign.

The worker is forked from the parent after Cuvil and the family are imported, so (re)starting one takes
milliseconds. It runs one case per request (``case(seed) -> (outcome, message)``); a worker that dies is a
CRASH, one that does not answer within the case's time limit is a HANG, and either way a fresh worker takes
over for the next case.

The limit is on the worker's CPU time (``RLIMIT_CPU``, whole seconds, raised before each case to what the
worker has used plus the limit, lifted when the case returns; child processes a case starts, such as the
linker, are bounded by the backstop only): on a loaded machine a case's wall time counts other processes' turns, and a
50,000-case run beside a CI job reported correct cases as hangs. A worker that sleeps or blocks without
spending CPU is caught by a wall-clock backstop (``wall_s``, default three times the limit, at least the limit
plus 30 s).
"""
from __future__ import annotations

import faulthandler
import math
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


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _limit_cpu(seconds: float) -> None:
    """Let this process spend ``seconds`` more of CPU, then SIGXCPU (whose default action ends it)."""
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(_cpu_seconds() + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _serve(conn, case: CaseFn, cpu_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    faulthandler.disable()  # a crash is reported by the parent as one line; an inherited handler (pytest's) dumps stacks
    for lim, value in ((resource.RLIMIT_AS, WORKER_MEMORY_BYTES), (resource.RLIMIT_CORE, 0)):
        try:   # no core file: a crash is reported by its signal and replayed from its seed
            resource.setrlimit(lim, (value, value))
        except (ValueError, OSError):
            pass
    while True:
        try:
            seed = conn.recv()
        except EOFError:
            return
        try:
            _limit_cpu(cpu_s)
        except (ValueError, OSError):
            pass   # no CPU limit here: the wall-clock backstop still applies
        try:
            result = case(seed)
        except BaseException as e:  # noqa: BLE001 - a family's own harness failed: report, keep serving
            result = (FOREIGN, f"{type(e).__name__} in the fuzz harness: {e} | {_where(e)}")
        try:   # the limit ends with the case: a case just under it must not be killed while idle, charged to the next seed
            resource.setrlimit(resource.RLIMIT_CPU, (resource.getrlimit(resource.RLIMIT_CPU)[1],) * 2)
        except (ValueError, OSError):
            pass
        conn.send(result)


def _where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-4:]))


class Sandbox:
    """One worker process serving ``case``; :meth:`run` gives each seed's outcome."""

    def __init__(self, case: CaseFn, timeout_s: float, wall_s: Optional[float] = None):
        self.case, self.timeout_s = case, timeout_s
        self.wall_s = wall_s if wall_s is not None else max(3 * timeout_s, timeout_s + 30)
        self._ctx = multiprocessing.get_context("fork")
        self._proc: Optional[multiprocessing.Process] = None
        self._conn = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.case, self.timeout_s), daemon=True)
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
            if self._conn.poll(self.wall_s):
                return self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            died = True
            self._proc.join(30)  # the pipe closed: the worker is on its way out (a core dump can take a while)
        alive = not died and self._proc.is_alive()
        code = self._proc.exitcode
        self._stop()
        if alive:
            return HANG, f"no result within {self.wall_s:g} s of wall time (blocked: it used no more than {self.timeout_s:g} s of CPU)"
        sig = -code if code is not None and code < 0 else None
        if sig == signal.SIGXCPU:
            return HANG, f"no result within {self.timeout_s:g} s of CPU"
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
