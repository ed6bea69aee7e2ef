"""cuvil verify: passes on a correctly optimized model, and on a real-proved rule whose float drift is
large it reports the difference with a minimal input."""
import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cuvil.cli import main as cli_main
from cuvil.testing.rules import REAL_RTOL
from cuvil.verify import compare, error_of, verify


def cancel_model(c=1e8):
    # (x + c) - c: equal to x over the reals, not in float32 for large c
    g = helper.make_graph([helper.make_node("Add", ["x", "c"], ["a"]), helper.make_node("Sub", ["a", "c"], ["y"])],
                          "cancel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(np.array(c, np.float32), "c")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_verify_passes_when_nothing_drifts(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(cancel_model(), path)
    res = verify(str(path), examples=10)
    assert res.ok and res.exact and res.examples >= 1
    assert res.largest.abs == 0 and res.rtol == 0
    assert res.error_line() == (f"largest error: 0 (every output equal on all {res.examples} examples); "
                                f"tolerance: bit for bit")


def test_verify_reports_minimal_failing_input(tmp_path, capsys):
    rules = tmp_path / "cancel.rule"
    rules.write_text("# (x + c) - c -> x: true over the reals only\nrule add_sub_cancel benefit 5\n"
                     "  Sub(Add(x, c), c) => x\n  prove real\n")
    path = tmp_path / "m.onnx"
    onnx.save(cancel_model(), path)
    res = verify(str(path), rules=[str(rules)], examples=50)
    assert not res.ok and not res.exact
    assert res.rules_fired == {"add_sub_cancel": 1}
    (x,) = res.failing_input.values()
    assert x.shape[0] == 1  # shrunk to the smallest batch
    # the largest error seen is the one judged: over the tolerance, in output y, on an example that ran
    e = res.largest
    assert e.output == "y" and e.rel > REAL_RTOL and e.rel == e.abs / e.scale and 1 <= e.example <= res.examples
    assert list(e.shapes) == ["x"] and len(e.shapes["x"]) == 2
    assert cli_main(["verify", str(path), "--rules", str(rules), "--examples", "30", "-q"]) == 1
    out = capsys.readouterr().out
    assert "verify FAILED" in out and "minimal input x" in out
    assert re.search(r"largest error: abs \S+, rel \S+ \(of \S+\) in output 'y' on example \d+ of \d+ "
                     r"\(x \d+x3\); tolerance: rel 0.0001 of the output's largest magnitude", out)


def test_compare_is_bitwise_for_exact():
    a = np.array([0.0, np.nan], np.float32)
    assert compare(a, np.array([-0.0, np.nan], np.float32), exact=True) is not None
    assert compare(a, a.copy(), exact=True) is None
    assert compare(a, np.array([1e-6, np.nan], np.float32), exact=False) is None
    # a NaN where the original is finite is a difference, however large the tolerance
    assert compare(np.ones(2, np.float32), np.array([1, np.nan], np.float32), exact=False, rtol=1e9) is not None
    assert error_of(np.ones(2, np.float32), np.array([1, np.nan], np.float32))[0] == np.inf
    assert error_of(np.array([4.0, -8.0]), np.array([4.5, -8.0])) == (0.5, 0.5 / 8, 8.0)


def test_verify_artifact_against_the_original(tmp_path, capsys):
    import os
    demo = os.path.join(os.path.dirname(__file__), "..", "src", "cuvil", "data", "demo_cnn.onnx")
    from cuvil import Pipeline
    so = Pipeline.from_onnx(demo).optimize().compile(fixed={"N": 2}).save(tmp_path / "libdemo.so")
    assert cli_main(["verify", demo, "--artifact", str(so), "--examples", "5"]) == 0
    out = capsys.readouterr().out
    assert "verify passed: the compiled library agrees with the original" in out and "on 5 inputs" in out
    assert re.search(r"largest error: (abs \S+, rel \S+ .* on example \d of 5 \(image 2x3x16x16\)|0 \(every "
                     r"output equal on all 5 examples\)); tolerance: rel 0.0001", out)


def test_verify_artifact_of_a_profile_library_draws_its_dims_inside_the_profile(tmp_path, capsys):
    """A library over a batch range: its inputs are drawn with the symbol inside the library's profile (this
    was a raw TypeError from a None dim)."""
    from cuvil import Pipeline
    from cuvil.verify import verify_artifact
    m = cancel_model(c=1.0)
    so = Pipeline.from_onnx(m).compile(shape_profiles={"N": (2, 3, 5)}).save(tmp_path / "libc.so")
    res = verify_artifact(m, str(so), examples=8)
    assert res.ok and res.examples == 8
    assert cli_main(["verify", _save(m, tmp_path), "--artifact", str(so), "--examples", "4"]) == 0
    assert "verify passed" in capsys.readouterr().out


def _save(m, tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    return path
