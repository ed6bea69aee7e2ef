"""Every registered op is covered, or says on purpose that it is not.

An op is declared once (``@op`` in ``ir/ops/<family>.py``, with its traits); its Z3 semantics and its
lowering live in files of the same family name. This test fails when a registered op has no semantics and
is not on :data:`~cuvil.rewrite_rules.semantics.WITHOUT_SEMANTICS`, has no lowering and is not on
:data:`~cuvil.kernels.support.NOT_LOWERED`, or when a set derived from the traits is inconsistent.

Targets: x86 and the GPU schedule through the same :data:`~cuvil.kernels.lower.LOWERINGS` (an op without a
lowering is refused at scheduling for both), so each supports exactly the lowered ops; the PTX emitter's
own refusals are per scalar operation and element type (an integer ``fma``, a call libdevice lacks), not
per op, and the support matrix says so (:mod:`cuvil.kernels.support`).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.dsl.validate import KERNEL_OPS
from cuvil.ir import registry
from cuvil.ir.registry import (BROADCAST, HALF_ACCUMULATE, HALF_COMPUTE, HALF_EXACT, HALF_FLOAT32, PER_CHANNEL,
                               all_ops, ops_with)
from cuvil.kernels.lower import LOWERINGS
from cuvil.kernels.schedule import ELEMENTWISE_OPS
from cuvil.kernels.support import EXPANDED_ON_IMPORT, NOT_LOWERED, X86_ONLY, support_matrix
from cuvil.reference import run_reference
from cuvil.rewrite_rules.fold import NONDETERMINISTIC
from cuvil.rewrite_rules.precision import ACCUMULATING, FLOAT32_OPS, HALF_OPS
from cuvil.rewrite_rules.prove import ELEMENTWISE as PROVER_ELEMENTWISE
from cuvil.rewrite_rules.semantics import SEMANTICS, WITHOUT_SEMANTICS


def coverage_gaps(ops) -> list:
    """What is missing for each of ``ops`` (names): semantics or an explicit reason, a lowering (both
    targets) or an explicit reason."""
    gaps = []
    for op in sorted(ops):
        if op not in SEMANTICS and op not in WITHOUT_SEMANTICS:
            gaps.append(f"{op}: no proof semantics and not on semantics.WITHOUT_SEMANTICS")
        if op not in LOWERINGS and op not in NOT_LOWERED and op not in EXPANDED_ON_IMPORT:
            gaps.append(f"{op}: no lowering (x86 and GPU) and not on kernels.support.NOT_LOWERED")
    return gaps


def test_every_op_has_semantics_and_a_lowering_or_says_why_not():
    gaps = coverage_gaps(all_ops())
    assert not gaps, "\n".join(gaps)


def test_explicit_lists_name_only_registered_uncovered_ops():
    ops = set(all_ops())
    assert set(WITHOUT_SEMANTICS) <= ops and set(NOT_LOWERED) <= ops
    assert not set(WITHOUT_SEMANTICS) & set(SEMANTICS), "an op on WITHOUT_SEMANTICS has semantics now"
    assert not set(NOT_LOWERED) & set(LOWERINGS), "an op on NOT_LOWERED has a lowering now"
    assert set(EXPANDED_ON_IMPORT) <= ops and not set(EXPANDED_ON_IMPORT) & (set(LOWERINGS) | set(NOT_LOWERED))
    assert set(SEMANTICS) <= ops and set(LOWERINGS) <= ops, "semantics or lowerings of an unregistered op"


@pytest.fixture
def undeclared_op():
    """An op registered with shape inference only, as a newcomer might add it; removed afterwards."""
    name = "CuvilTestOnlySoftsign"
    registry.op(name, elementwise=BROADCAST, half=HALF_COMPUTE)(registry.same_as)
    try:
        yield name
    finally:
        del registry.REGISTRY[name]


def test_an_op_registered_without_semantics_or_lowering_is_reported(undeclared_op):
    assert undeclared_op in all_ops()
    gaps = coverage_gaps(all_ops())
    assert gaps == [f"{undeclared_op}: no proof semantics and not on semantics.WITHOUT_SEMANTICS",
                    f"{undeclared_op}: no lowering (x86 and GPU) and not on kernels.support.NOT_LOWERED"]
    # and its traits reach the derived sets at once (they are read from the registry, not copied)
    assert undeclared_op in ops_with("elementwise") and undeclared_op in ops_with("half", HALF_COMPUTE)


def test_derived_sets_are_the_registry_traits():
    assert ELEMENTWISE_OPS == ops_with("elementwise")
    assert HALF_OPS == ops_with("half", HALF_COMPUTE, HALF_EXACT, HALF_ACCUMULATE)
    assert ACCUMULATING == ops_with("half", HALF_ACCUMULATE)
    assert FLOAT32_OPS == ops_with("half", HALF_FLOAT32)
    assert NONDETERMINISTIC == ops_with("nondeterministic")
    # the elementwise prover: broadcast-elementwise ops with semantics whose type the data fixes, plus the
    # ops that exist only inside kernels
    assert PROVER_ELEMENTWISE - KERNEL_OPS == (ops_with("elementwise", BROADCAST) & set(SEMANTICS)) - ops_with(
        "converts_dtype")
    assert not KERNEL_OPS & set(all_ops())


def test_derived_sets_are_consistent():
    ops = all_ops()
    lowered = set(LOWERINGS)
    assert ops_with("elementwise") <= lowered, "a fusion consumer without a lowering"
    assert HALF_OPS | FLOAT32_OPS <= lowered, "a float16 class for an op the GPU cannot compile"
    assert ops_with("elementwise", PER_CHANNEL) == {"BatchNormalization"}
    assert not ops_with("nondeterministic") & (ops_with("elementwise") | HALF_OPS)
    assert PROVER_ELEMENTWISE - KERNEL_OPS <= set(SEMANTICS)
    for name in ops_with("converts_dtype"):
        assert ops[name].half is None, f"{name} converts types: the float16 pass must not retype it"


def test_support_matrix_rows():
    rows = {r.op: r for r in support_matrix()}
    assert set(rows) == set(all_ops())
    r = rows["Softsign"]
    assert (r.imported, r.proof, r.x86, r.gpu, r.half) == (True, True, True, True, HALF_COMPUTE)
    assert rows["WinogradKernel"].why_not["import"].startswith("Cuvil's own op")
    assert rows["RandomNormal"].why_not["x86"] == NOT_LOWERED["RandomNormal"] and not rows["RandomNormal"].gpu
    assert rows["NonZero"].x86 and rows["NonZero"].why_not["gpu"] == X86_ONLY["NonZero"] and not rows["NonZero"].gpu
    assert rows["Mod"].why_not["proof"] == WITHOUT_SEMANTICS["Mod"]
    assert rows["Loop"].x86 and rows["Loop"].gpu and "x86" not in rows["Loop"].why_not   # expanded on import
    assert all(r.x86 == r.gpu for r in rows.values() if r.op not in X86_ONLY)


def test_cli_ops_prints_the_matrix(capsys):
    assert cli_main(["ops"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["op", "family", "import", "proof", "x86", "gpu", "half"]
    assert any(line.split() == ["LRN", "norm", "yes", "-", "yes", "yes", "float32"] for line in out.splitlines())
    assert "ONNX default-domain ops are registered" in out
    assert cli_main(["ops", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_op = {r["op"]: r for r in doc["ops"]}
    assert by_op["Conv"]["half"] == HALF_ACCUMULATE and by_op["Conv"]["proof"] is True
    assert "proof" in by_op["NonZero"]["why_not"] and "gpu" in by_op["NonZero"]["why_not"]


def test_bitwise_ops_fuse_and_compute_as_the_reference(tmp_path):
    """The bitwise ops are elementwise (declared so): they fuse into one kernel and agree with onnx.reference."""
    i32, u32 = TensorProto.INT32, TensorProto.UINT32
    nodes = [helper.make_node("Add", ["a", "b"], ["t"]), helper.make_node("BitwiseAnd", ["t", "c"], ["u"]),
             helper.make_node("BitwiseNot", ["u"], ["v"]), helper.make_node("BitwiseOr", ["v", "a"], ["w"]),
             helper.make_node("BitwiseXor", ["w", "b"], ["x"]), helper.make_node("Cast", ["x"], ["xu"], to=u32),
             helper.make_node("BitShift", ["xu", "s"], ["z"], direction="RIGHT")]
    g = helper.make_graph(nodes, "bitwise", [helper.make_tensor_value_info(n, i32, [2, 3, 4]) for n in "abc"]
                          + [helper.make_tensor_value_info("s", u32, [4])],
                          [helper.make_tensor_value_info("z", u32, [2, 3, 4])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    feeds = {n: rng.integers(-1000, 1000, (2, 3, 4)).astype(np.int32) for n in "abc"}
    feeds["s"] = np.array([0, 1, 3, 31], np.uint32)
    art = Pipeline.from_onnx(model).compile("x86_64-linux-gnu", cache=False)
    np.testing.assert_array_equal(art.run(feeds)["z"], run_reference(model, feeds)[0])
    assert art.manifest["kernels"] == 1


def test_trait_sets_that_replaced_hand_kept_lists():
    """The commutative, window and shape-only traits replaced lists in the rewrite layer, the canonical form
    and the ONNX backend. Max and Min must never be commutative (ties of +0/-0 and NaNs depend on the order)."""
    assert ops_with("commutative") == {"Add", "Mul"}
    assert not ops_with("commutative") & {"Max", "Min", "Sub", "Div"}
    assert ops_with("window") == {"Conv", "ConvInteger", "ConvTranspose", "MaxPool", "AveragePool", "LpPool"}
    assert ops_with("shape_only") == {"Shape", "Size"}
