"""ONNX node conformance: the official node test cases through ``cuvil.onnx_backend``.

Every case of ``onnx.backend.test.case.node.collect_testcases()`` (the generators of onnx's
``backend/test/data/node`` directories, which the onnx wheel does not ship: same models, same inputs and
expected outputs, expanded-function variants included) is compiled to a native library and run; outputs
are compared as onnx's own backend runner does (shape, dtype, then ``assert_allclose`` with the case's
rtol/atol: 1e-3/1e-7).

``tests/conformance_expected_pass.txt`` lists the cases that pass (``scripts/update_conformance_list.py``
regenerates it). A listed case that fails is a regression and fails its test; a case that passes but is
not listed is reported (a warning and the terminal summary) so that the list can be extended. The
terminal summary prints ``ONNX node conformance: N/M cases pass`` and what each other outcome (mismatch,
unsupported, ...) means.

Cases run in worker processes (``CUVIL_CONFORMANCE_JOBS``, default: the CPU count, at most 8), each
compiling at ``opt_level=1`` into a private artifact cache that is deleted afterwards, so every run
really compiles. A worker that dies (a crash in native code) or exceeds the per-case time limit fails
``test_no_crashes`` for that case and is replaced; the other cases go on.

Cost: every case runs (1884, about 1450 of them compile a library). A compiled case costs ~0.18 s of CPU
(``bench/small_compile.py``, 2026-12-03: LLVM ~78 ms, ``cc`` ~50 ms for model.c and the link, the runtime and
the ISA check being cached objects, the SBOM ~18 ms, ``ldd`` ~9 ms); the module took 405 s of CPU (15.5 min of
wall time at a load average of 6-12 on 2 cores; ``CUVIL_CONFORMANCE_JOBS`` and the case list in the summary
help to profile it).
"""
from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Dict, List, NamedTuple, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
LIST_PATH = os.path.join(HERE, "conformance_expected_pass.txt")
OPT_LEVEL = 1
CASE_TIMEOUT_S = 120.0


class Result(NamedTuple):
    status: str      # pass | mismatch | unsupported | error | crash | timeout
    detail: str
    seconds: float


#: What each outcome but ``pass`` means, for the terminal summary.
OUTCOMES = {
    "mismatch": "ran, but an output differs from onnx's expected values beyond the case's rtol/atol:",
    "unsupported": "refused with a CuvilError (strings, sequences, training and random ops, other domains)",
    "error": "an internal error (a bug: an exception that is not a CuvilError):",
    "crash": "the worker process died (fails test_no_crashes):",
    "timeout": f"no result within {CASE_TIMEOUT_S:.0f} s (fails test_no_crashes):",
}


def expected_pass() -> List[str]:
    if not os.path.isfile(LIST_PATH):
        return []
    with open(LIST_PATH, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]


def collect_cases():
    """The node test cases, in onnx's order (name -> TestCase)."""
    import numpy as np
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    return {c.name: c for c in cases}


# --- one case (in a worker) ---------------------------------------------------------------------------

def run_case(model_bytes: bytes, data_sets, rtol: float, atol: float, opt_level: int = OPT_LEVEL) -> Result:
    import numpy as np
    import onnx
    from cuvil.errors import CuvilError
    from cuvil.onnx_backend import backend

    t0 = time.perf_counter()
    try:
        model = onnx.ModelProto()
        model.ParseFromString(model_bytes)
        rep = backend.prepare(model, opt_level=opt_level)
        for inputs, expected in data_sets:
            # As onnx's backend runner does: cases that store their inputs as TensorProto (casts to and from
            # float8, int4, ...) are given to the backend as numpy arrays (ml_dtypes types where numpy has none).
            got = rep.run([onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x for x in inputs])
            np.testing.assert_equal(len(got), len(expected))
            for k, (out, ref) in enumerate(zip(got, expected)):
                if isinstance(ref, onnx.TensorProto):
                    ref = onnx.numpy_helper.to_array(ref)
                np.testing.assert_array_equal(out.shape, ref.shape, err_msg=f"output {k} has incorrect shape")
                np.testing.assert_equal(out.dtype, ref.dtype, err_msg=f"output {k} has incorrect dtype")
                np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol, err_msg=f"output {k}")
        status, detail = "pass", ""
    except AssertionError as e:
        status, detail = "mismatch", str(e).strip()
    except CuvilError as e:
        status, detail = "unsupported", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - a bug, but one case must not stop the others
        status, detail = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
    return Result(status, detail[:4000], time.perf_counter() - t0)


def _worker(conn, cache_dir: str, opt_level: int) -> None:
    os.environ["CUVIL_CACHE_DIR"] = cache_dir
    warnings.simplefilter("ignore")
    import numpy as np
    np.seterr(all="ignore")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        name, model_bytes, data_sets, rtol, atol = pickle.loads(msg)
        conn.send((name, tuple(run_case(model_bytes, data_sets, rtol, atol, opt_level))))


# --- the pool ---------------------------------------------------------------------------------------

def default_jobs() -> int:
    env = os.environ.get("CUVIL_CONFORMANCE_JOBS")
    if env:
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, 8))


def run_all(cases, names: Optional[List[str]] = None, jobs: Optional[int] = None, opt_level: int = OPT_LEVEL,
            timeout: float = CASE_TIMEOUT_S, progress=None) -> Dict[str, Result]:
    """Run ``names`` (default: all) of ``cases`` in ``jobs`` worker processes; name -> Result."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    todo = list(names if names is not None else cases)
    todo.reverse()
    results: Dict[str, Result] = {}
    ctx = mp.get_context("spawn")
    cache_dir = tempfile.mkdtemp(prefix="cuvil-conformance-")
    jobs = max(1, min(jobs or default_jobs(), len(todo) or 1))
    workers = []  # [process, connection, current case, start time]

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, cache_dir, opt_level), daemon=True)
        p.start()
        child.close()
        return [p, parent, None, 0.0]

    def feed(w):
        if not todo:
            w[1].send(None)
            w[2] = None
            return
        name = todo.pop()
        c = cases[name]
        w[2], w[3] = name, time.monotonic()
        w[1].send(pickle.dumps((name, c.model.SerializeToString(), c.data_sets, c.rtol, c.atol)))

    try:
        for _ in range(jobs):
            w = start()
            workers.append(w)
            feed(w)
        while any(w[2] is not None for w in workers):
            busy = [w for w in workers if w[2] is not None]
            ready = wait([w[1] for w in busy] + [w[0].sentinel for w in busy], timeout=1.0)
            now = time.monotonic()
            for w in busy:
                dead = None
                if w[1] in ready or w[0].sentinel in ready:
                    try:
                        if w[1].poll():
                            name, res = w[1].recv()
                            results[name] = Result(*res)
                            if progress:
                                progress(name, results[name])
                            feed(w)
                            continue
                    except (EOFError, OSError):
                        pass
                    if not w[0].is_alive():
                        dead = Result("crash", f"the worker process died (exit code {w[0].exitcode}) running this case", now - w[3])
                elif now - w[3] > timeout:
                    w[0].kill()
                    dead = Result("timeout", f"no result after {timeout:.0f} s", now - w[3])
                if dead is not None:
                    results[w[2]] = dead
                    if progress:
                        progress(w[2], dead)
                    w[0].join(5)
                    w[1].close()
                    w[:] = start()
                    feed(w)
    finally:
        for w in workers:
            if w[0].is_alive():
                try:
                    w[1].send(None)
                except (OSError, ValueError):
                    pass
                w[0].join(5)
                if w[0].is_alive():
                    w[0].kill()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return results


# --- pytest -------------------------------------------------------------------------------------------

_LISTED = expected_pass()
# The key under which an xdist worker hands the summary lines to the controller (tests/conftest.py).
CONFORMANCE_SUMMARY = "cuvil_conformance_summary"


def summary_lines(results: Dict[str, Result], total: int, listed: List[str], seconds: float) -> List[str]:
    """The terminal summary: the pass count, what each other outcome means and which cases had it, the passing
    cases not listed."""
    r = results
    passed = sorted(n for n, x in r.items() if x.status == "pass")
    if len(r) == total:
        lines = [f"ONNX node conformance: {len(passed)}/{total} cases pass ({len(r)} run in {seconds:.0f} s)"]
    else:
        lines = [f"ONNX node conformance: {len(passed)}/{len(r)} of the cases run pass "
                 f"({total} cases in all; {seconds:.0f} s)"]
    others = {}
    for n, x in r.items():
        if x.status != "pass":
            others.setdefault(x.status, []).append(n)
    if others:
        lines.append(f"  the other {sum(map(len, others.values()))}, by outcome (one listed in "
                     f"{os.path.basename(LIST_PATH)} fails its test; an unlisted one fails nothing unless it "
                     "crashes or times out):")
        for status, names in sorted(others.items()):
            shown = " ".join(sorted(names)) if status != "unsupported" else "(cuvil ops lists the gaps)"
            lines.append(f"    {len(names)} {status}: {OUTCOMES.get(status, status)} {shown}")
    new = sorted(set(passed) - set(listed))
    if new:
        lines.append(f"  {len(new)} passing case(s) not in {os.path.basename(LIST_PATH)} "
                     f"(run scripts/update_conformance_list.py): {' '.join(new)}")
    return lines


class _Summary:
    """Registered as a plugin by the fixture: prints the summary at the end of the session."""

    def __init__(self, lines: List[str]):
        self.lines = lines

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.section("ONNX node conformance")
        for line in self.lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def conformance(request):
    t0 = time.perf_counter()
    cases = collect_cases()
    # Every case runs when the summary test is selected; otherwise only the selected listed cases.
    items = request.session.items
    mod = request.module.__name__
    selected = [it for it in items if it.module is not None and it.module.__name__ == mod]
    if any(it.originalname != "test_listed_case_passes" for it in selected):
        names = list(cases)
    else:
        names = [it.callspec.params["name"] for it in selected if it.callspec.params["name"] in cases]
    results = run_all(cases, names)
    lines = summary_lines(results, len(cases), _LISTED, time.perf_counter() - t0)
    if hasattr(request.config, "workeroutput"):   # a pytest-xdist worker: the controller prints it (conftest.py)
        request.config.workeroutput[CONFORMANCE_SUMMARY] = lines
    else:
        request.config.pluginmanager.register(_Summary(lines), "cuvil-onnx-conformance-summary")
    return cases, results


@pytest.mark.parametrize("name", _LISTED)
def test_listed_case_passes(conformance, name):
    cases, results = conformance
    if name not in cases:
        pytest.fail(f"{name} is listed in {os.path.basename(LIST_PATH)} but onnx has no such node test case")
    r = results[name]
    assert r.status == "pass", f"{name} regressed ({r.status}): {r.detail}"


def test_conformance_summary(conformance):
    cases, results = conformance
    passed = {n for n, r in results.items() if r.status == "pass"}
    new = sorted(passed - set(_LISTED))
    if new:
        warnings.warn(f"{len(new)} ONNX node case(s) pass but are not in {os.path.basename(LIST_PATH)}: "
                      f"{', '.join(new)} (run scripts/update_conformance_list.py)", stacklevel=1)
    print(f"ONNX node conformance: {len(passed)}/{len(cases)} cases pass")
    assert _LISTED == sorted(set(_LISTED)), f"{os.path.basename(LIST_PATH)} must be sorted and free of duplicates"


def test_no_crashes(conformance):
    """A case may be unsupported (a CuvilError), but it must never kill the process or hang."""
    _, results = conformance
    bad = {n: r for n, r in results.items() if r.status in ("crash", "timeout")}
    assert not bad, "\n".join(f"{n}: {r.status}: {r.detail}" for n, r in sorted(bad.items()))


if __name__ == "__main__":
    sys.exit("run with pytest, or scripts/update_conformance_list.py")
