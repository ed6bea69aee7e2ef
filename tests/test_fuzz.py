"""The fuzz suite's CI budget: a few thousand cases over the families, none may crash, hang, give a wrong
result or raise a non-Cuvil exception. ``python -m cuvil.fuzz`` is the long mode (docs/fuzzing.md)."""
import os
import re
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.fuzz import FAMILIES
from cuvil.fuzz import __main__ as fuzz_main
from cuvil.fuzz import onnx_bytes, onnx_structure, oracle, rule_text
from cuvil.fuzz.corpus import seed_models
from cuvil.fuzz.report import ACCEPTED, CLEAN_ERROR, CRASH, FOREIGN, HANG, WRONG
from cuvil.fuzz.sandbox import Sandbox
from cuvil.pipeline import Pipeline

SEED = int(os.environ.get("CUVIL_FUZZ_SEED", "0"))
BUDGETS = {"onnx_bytes": 1500, "onnx_structure": 1500, "rule_text": 300}


@pytest.mark.parametrize("family", [onnx_bytes, onnx_structure, rule_text], ids=lambda m: m.NAME)
def test_family_ci_budget(family):
    report = family.run(BUDGETS[family.NAME], SEED)
    assert report.cases == BUDGETS[family.NAME]
    assert report.failures == 0, report.to_json()
    assert report.counts[ACCEPTED] > 0  # the mutations still reach the optimizer and the oracle


def test_oracle_catches_a_wrong_rewrite(monkeypatch):
    real = Pipeline.optimize

    def broken(self, *a, **kw):  # an "optimization" that perturbs every float constant
        p = real(self, *a, **kw)
        for v in p.graph.constants():
            if v.const.dtype == np.float32 and v.const.size:
                v.const = v.const + np.float32(0.5)
        return p

    monkeypatch.setattr(Pipeline, "optimize", broken)
    outcome, message = oracle.check_model(seed_models()[1], 0)  # the MLP: weights are constants
    assert outcome == WRONG and "output" in message


def test_inputs_that_break_a_recorded_shape_condition_are_not_compared():
    # Reshape [B,2,3] -> [B,0] (0 copies dim 1): import records 6*B == 2*B, false for B = 2. onnxruntime
    # still answers (shape (1, 6)); the reference cannot: the case is Cuvil's refusal, not a wrong result.
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([2, 0], np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    outcome, message = oracle.check_model(m.SerializeToString(), 0)
    assert outcome == CLEAN_ERROR and "B = 2 makes Reshape" in message


def test_compiled_comparison(monkeypatch):
    monkeypatch.setattr(oracle, "COMPILE_EVERY", 1)
    assert oracle.check_model(seed_models()[4], 0) == (ACCEPTED, "compiled")  # the folding model: small, static


def _crash(seed):
    os._exit(3)


def _abort(seed):
    os.abort()


def _hang(seed):
    time.sleep(60)


def _spin(seed):
    while True:
        pass


def _slow_but_idle(seed):
    time.sleep(2.5)   # wall time past the limit, almost no CPU: a loaded machine's turn, not a hang
    return ACCEPTED, ""


def _raise(seed):
    raise KeyError("harness")


@pytest.mark.parametrize("fn,outcome,match", [(_crash, CRASH, "exited with code 3"), (_abort, CRASH, "SIGABRT"),
                                              (_spin, HANG, "1 s of CPU"), (_hang, HANG, "2 s of wall time"),
                                              (_raise, FOREIGN, "KeyError")])
def test_sandbox_reports_crash_hang_and_recovers(fn, outcome, match):
    box = Sandbox(fn, timeout_s=1.0, wall_s=2.0)
    try:
        got, message = box.run(0)
        assert got == outcome and match in message
        got, _ = box.run(1)  # a fresh worker takes over
        assert got == outcome
    finally:
        box.close()


def test_the_case_limit_is_cpu_time_not_wall_time():
    box = Sandbox(_slow_but_idle, timeout_s=1.0, wall_s=10.0)
    try:
        assert box.run(0) == (ACCEPTED, "")
    finally:
        box.close()


def test_runner_skips_a_family_not_built(capsys, monkeypatch):
    monkeypatch.setattr(fuzz_main, "_family_module", lambda name: None if name == "c_abi" else
                        __import__(f"cuvil.fuzz.{name}", fromlist=["run"]))
    code = fuzz_main.main(["--budget", "8", "--family", "onnx_bytes", "--family", "c_abi", "--quiet"])
    out = capsys.readouterr().out
    assert "c_abi" in out and "not built" in out and code == 0
    assert set(FAMILIES) >= {"onnx_bytes", "onnx_structure", "rule_text", "c_abi"}


def test_replay_by_seed_is_deterministic():
    assert onnx_structure.mutate(1234).SerializeToString() == onnx_structure.mutate(1234).SerializeToString()
    assert onnx_bytes.mutate(99) == onnx_bytes.mutate(99)
    assert rule_text.make_text(7) == rule_text.make_text(7)


def test_docs_python_snippet_runs():
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "fuzzing.md"), encoding="utf-8").read()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(code, "docs/fuzzing.md", "exec"), {})


def test_reference_global_average_pool_on_an_empty_batch():
    """onnx.reference's GlobalAveragePool divides by zero on an empty batch (found by onnx_structure seed 290,
    a batch dim mutated to 0); Cuvil's reference gives the empty result, as onnxruntime does."""
    def gap(batch):
        g = helper.make_graph([helper.make_node("GlobalAveragePool", ["x"], ["y"])], "gap",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2, 1, 1])])
        return Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert gap(0).run_reference({"x": np.zeros((0, 2, 3, 3), np.float32)})["y"].shape == (0, 2, 1, 1)
    y = gap(1).run_reference({"x": np.arange(18, dtype=np.float32).reshape(1, 2, 3, 3)})["y"]
    np.testing.assert_allclose(y.ravel(), [4.0, 13.0])
