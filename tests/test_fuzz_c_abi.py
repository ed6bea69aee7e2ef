"""The C ABI fuzz family (cuvil.fuzz.c_abi) at its CI budget, and its judge on doctored results."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from cuvil.fuzz import c_abi
from cuvil.fuzz.report import ACCEPTED, CLEAN_ERROR, WRONG

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def test_ci_budget_finds_no_crash_hang_or_wrong_result():
    rep = c_abi.run(budget=300, seed=0)
    assert rep.cases == 300
    assert rep.failures == 0, rep.to_json()
    assert rep.counts[ACCEPTED] > 30 and rep.counts[CLEAN_ERROR] > 100, rep.counts


def test_the_cases_cover_every_kind_of_misuse():
    cases = [c_abi.make_case(np.random.default_rng(k)) for k in range(300)]
    ops = {c["op"] for c in cases}
    assert ops == {"run", "output_shape", "info", "create", "profile", "concurrent"}
    sessions = {c["session"] for c in cases if c["op"] == "run"}
    assert {"live", "null", "destroyed", "double", "foreign", "foreign_heap"} <= sessions
    data = {t["data"] for c in cases if c["op"] == "run" for t in (c["inputs"] or []) + (c["outputs"] or [])}
    assert {"ok", "null", "misaligned", "alias_x", "alias_z"} <= data


def _valid_run():
    case = c_abi._run_case(np.random.default_rng(0))
    n = 2
    for t, s in zip(case["inputs"] + case["outputs"], c_abi._true_shapes(n)):
        t.update(dtype=c_abi.FLOAT, ndim=4, shape=list(s), data="ok")
    case.update(session="live", repeat=1)
    return case


def test_judge_flags_wrong_outputs_refusals_and_writes():
    case = _valid_run()
    x, z = c_abi.case_inputs(case["seed"], 2)
    y = c_abi.reference(x, z).ravel().tolist()
    ok = {"inputs_intact": True, "tail_intact": True}
    assert c_abi.judge(case, {"rcs": [0], "y": y, **ok}, {})[0] == ACCEPTED
    bad = list(y)
    bad[7] += 0.5
    assert c_abi.judge(case, {"rcs": [0], "y": bad, **ok}, {})[0] == WRONG
    assert c_abi.judge(case, {"rcs": [-8], "detail": "", **ok}, {})[0] == WRONG        # a valid call refused
    case["inputs"][0]["dtype"] = 11
    assert c_abi.judge(case, {"rcs": [-6], "untouched": True, **ok}, {})[0] == CLEAN_ERROR
    assert c_abi.judge(case, {"rcs": [-6], "untouched": False, **ok}, {})[0] == WRONG  # refused, yet wrote
    assert c_abi.judge(case, {"rcs": [0], "y": y, **ok}, {})[0] == WRONG               # an invalid call accepted
    assert c_abi.judge(case, {"rcs": [-99], "untouched": True, **ok}, {})[0] == WRONG  # undocumented code


def test_judge_checks_every_result_a_valid_call_returns():
    """A valid call's result is compared in full: the *_info values, the bytes past a run's output and its
    inputs, and a concurrent case's count of runs (one lost to an exception in its thread) and its successes
    (every run busy means the session stayed claimed)."""
    case = _valid_run()
    x, z = c_abi.case_inputs(case["seed"], 2)
    y = c_abi.reference(x, z).ravel().tolist()
    assert c_abi.judge(case, {"rcs": [0], "y": y, "inputs_intact": True, "tail_intact": False}, {})[0] == WRONG
    assert c_abi.judge(case, {"rcs": [0], "y": y, "inputs_intact": False, "tail_intact": True}, {})[0] == WRONG

    info = {"op": "info", "fn": "input_info", "i": 1, "null_out": False}
    right = {"rcs": [0], "dtype": c_abi.FLOAT, "ndim": 4, "shape": [-1, c_abi.C_OUT, c_abi.H, c_abi.W]}
    assert c_abi.judge(info, right, {})[0] == ACCEPTED
    assert c_abi.judge(info, {**right, "shape": [-1, c_abi.C_IN, c_abi.H, c_abi.W]}, {})[0] == WRONG
    assert c_abi.judge(info, {**right, "dtype": 11}, {})[0] == WRONG
    sym = {"op": "info", "fn": "symbol_info", "i": 0, "null_out": False}
    assert c_abi.judge(sym, {"rcs": [0], "symbol": ["N", 1, 2, 4]}, {})[0] == ACCEPTED
    assert c_abi.judge(sym, {"rcs": [0], "symbol": ["N", 1, 2, 8]}, {})[0] == WRONG

    conc = {"op": "concurrent", "n": 1, "threads": [1, 2], "same_session": True, "runs": 3, "seed": 5}
    x, z = c_abi.case_inputs(5, 1)
    y = c_abi.reference(x, z).ravel().tolist()
    assert c_abi.judge(conc, {"rcs": [0, -13, 0, 0, 0, 0], "ys": [y, None, y, y, y, y]}, {})[0] == ACCEPTED
    assert c_abi.judge(conc, {"rcs": [0, 0, 0], "ys": [y, y, y]}, {})[0] == WRONG
    assert c_abi.judge(conc, {"rcs": [-13] * 6, "ys": [None] * 6}, {})[0] == WRONG
