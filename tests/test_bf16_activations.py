"""bf16 activations between bf16 convolutions (``X86Tuning.bf16_storage``, on by default; the scheduler's
``bf16_storage``): a float32 value whose every reader is a Conv narrowed to bf16, taking it as its input, is
stored as bfloat16, and so is such a Conv's zero-padded input copy; the bf16 kernels (AMX tiles and
vdpbf16ps) pack their pair panels from the 16-bit words without rounding.

What may be asserted exactly: every reader rounds its input to bfloat16 (nearest even) before using it, so
storing the rounded value instead changes no result: the library with bf16 activations equals the one with
float32 activations bit for bit (the two roundings agree except on float32 denormals, which the ReLU
outputs of these tests do not produce). Against the float32 library the error is the bf16 kernels' own
(the bounds of tests/test_x86_bf16.py's docstring); it is checked end to end below 1e-2 relative, as there.
The chains cover the packing paths of the reader: a 1x1 stride-1 reader (pair panels straight from the
input rows), odd channel counts and channel counts not a multiple of the tile, padding (the padded copy in
bfloat16), stride 2 (runs through a stride shuffle), stride 5 (the gather), dilation and groups.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.tuning import X86Tuning
from test_x86_amx import HAS_AMX
from test_x86_bf16 import HAS_BF16, bf16_steps

from cuvil.targets.x86.cpu import cpu_label

pytestmark = pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 "
                                                     "kernels cannot run here")
PATHS = [pytest.param(True, id="amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16")),
         pytest.param(False, id="vdpbf16ps")]


def chain_model(c0, cin, m, k, hw, seed=0, **attrs):
    """x[1, c0, hw, hw] -> Conv 1x1 (c0 -> cin) + bias -> Relu -> Conv k x k (cin -> m, ``attrs``) + bias ->
    Relu -> y; the first Relu's output is read only by the second Conv."""
    rng = np.random.default_rng(seed)
    group = attrs.get("group", 1)
    w1 = (rng.standard_normal((cin, c0, 1, 1)) / np.sqrt(c0)).astype(np.float32)
    w2 = (rng.standard_normal((m, cin // group, k, k)) / np.sqrt(cin // group * k * k)).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(0.1 * rng.standard_normal(cin).astype(np.float32), "b1"),
             numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(0.1 * rng.standard_normal(m).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", kernel_shape=[k, k], **attrs),
             helper.make_node("Relu", ["c2"], ["y"])]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c0, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def every_bf16(model, **tuning):
    """``model`` with every Conv narrowed to bf16 directly (as bench/precision_speed.py --every)."""
    p = Pipeline.from_onnx(model).optimize()
    for n in p.graph.nodes:
        if n.op == "Conv":
            n.precision = "bf16"
    return p.compile(tuning=X86Tuning(**tuning))


CHAINS = {
    "1x1": dict(c0=16, cin=64, m=48, k=1, hw=20),                        # pair panels straight from the rows
    "1x1-odd-C": dict(c0=8, cin=33, m=40, k=1, hw=13),                   # odd K, partial panels
    "3x3-pad-odd-C": dict(c0=8, cin=27, m=32, k=3, hw=34, pads=[1, 1, 1, 1]),     # padded copy, K = 243
    "3x3-stride2": dict(c0=16, cin=64, m=64, k=3, hw=28, strides=[2, 2], pads=[1, 1, 1, 1]),
    "1x1-stride2": dict(c0=16, cin=48, m=96, k=1, hw=28, strides=[2, 2]),  # no copy: runs on the stored value
    "groups": dict(c0=8, cin=34, m=64, k=3, hw=12, group=2, pads=[1, 1, 1, 1]),   # 17 channels per group
    "stride5": dict(c0=8, cin=16, m=32, k=3, hw=40, strides=[5, 5]),     # the per-element gather
    "dilated": dict(c0=8, cin=33, m=64, k=3, hw=17, pads=[2, 2, 2, 2], dilations=[2, 2]),
    # 14x14 maps: the vdpbf16ps kernels take channel-lane tiles, whose epilogue rows are 8 lanes wide
    "channel-lanes": dict(c0=512, cin=256, m=64, k=1, hw=7),
}


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_equals_float32_activations(name, amx):
    model = chain_model(**CHAINS[name])
    x = np.random.default_rng(1).standard_normal(model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
                                                 * CHAINS[name]["hw"] ** 2).astype(np.float32)
    x = x.reshape(1, -1, CHAINS[name]["hw"], CHAINS[name]["hw"])
    on, off = every_bf16(model, amx=amx), every_bf16(model, amx=amx, bf16_storage=False)
    path = "amx_bf16" if amx else "avx512_bf16"
    # (a padded or strided convolution on AMX reads pair planes: a planes pass of its own before it)
    assert [s["path"] for s in bf16_steps(on) if s["kernel"] != "bf16_planes"] == [path, path], on.manifest["steps"]
    # the first Conv's output (its Relu fused) is stored as bfloat16; the second's is the graph output (float32)
    assert list(on.manifest["bf16_activations"].values()) == ["read only by bf16 convolution(s) conv2"]
    assert "bf16_activations" not in off.manifest
    assert on.manifest["steps"][0]["stores"] == "bf16" and "stores" not in on.manifest["steps"][-1]
    assert on.manifest["arena_bytes"] < off.manifest["arena_bytes"]
    y_on, y_off = on.model().run(x)[0], off.model().run(x)[0]
    np.testing.assert_array_equal(y_on, y_off)
    np.testing.assert_array_equal(y_on, on.model().run(x, num_threads=2)[0])
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    rel = float(np.abs(y_on - want).max() / np.abs(want).max())
    assert 1e-5 < rel < 1e-2, rel


def test_other_readers_keep_float32():
    """A value also read by a float32 node (here: the graph's Add after the second Conv reads the first Relu's
    output too) stays float32; so does everything when no Conv is narrowed."""
    model = chain_model(c0=16, cin=32, m=32, k=1, hw=12)
    g = model.graph
    g.node[-1].output[0] = "r2"
    g.node.extend([helper.make_node("Add", ["r2", "r1"], ["y"])])
    art = every_bf16(model)
    assert "bf16_activations" not in art.manifest
    assert "bf16_activations" not in Pipeline.from_onnx(model).optimize().compile().manifest


def test_policy_narrowed_chain_manifest():
    """Through the precision policy (``precision="bf16"`` with declared input ranges): the stored value is
    listed in the manifest with the reason, beside the readers' own certificates."""
    model = chain_model(c0=16, cin=64, m=32, k=3, hw=14, pads=[1, 1, 1, 1])
    art = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges={"x": (-4.0, 4.0)})
    nodes = art.manifest["precision"]["nodes"]
    if nodes["conv2"]["format"] != "bf16":
        pytest.skip(f"the policy kept conv2 float32 here: {nodes['conv2']['reason']}")
    assert any(why == "read only by bf16 convolution(s) conv2" for why in art.manifest["bf16_activations"].values())
    assert any(s.get("stores") == "bf16" for s in art.manifest["steps"])


def residual_model(c=48, hw=14, seed=0):
    """x -> Conv 1x1 + Relu = r1 -> Conv 1x1 -> Add(r1) -> Relu -> Conv 1x1 -> y: r1 is read by a Conv and
    by the residual Add (fused into the second Conv's epilogue)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    for i in range(3):
        inits += [numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / np.sqrt(c)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype(np.float32), f"b{i}")]
    nodes += [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", kernel_shape=[1, 1]),
              helper.make_node("Relu", ["c0"], ["r1"]),
              helper.make_node("Conv", ["r1", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[1, 1]),
              helper.make_node("Add", ["c1", "r1"], ["s"]), helper.make_node("Relu", ["s"], ["r2"]),
              helper.make_node("Conv", ["r2", "w2", "b2"], ["y"], name="conv2", kernel_shape=[1, 1])]
    g = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("amx", PATHS)
def test_residual_kept_float32_unless_asked(amx):
    """By default a value also read by a residual Add stays float32 (only r2, read by conv2 alone, is bf16);
    with ``bf16_residual`` it is bfloat16 too, a new rounding of the skip path that the reason states, and
    the result moves (but stays within the bf16 error of the float32 library)."""
    model = residual_model()
    x = np.random.default_rng(2).standard_normal((1, 48, 14, 14)).astype(np.float32)
    base, res = every_bf16(model, amx=amx), every_bf16(model, amx=amx, bf16_residual=True)
    assert list(base.manifest["bf16_activations"].values()) == ["read only by bf16 convolution(s) conv2"]
    whys = sorted(res.manifest["bf16_activations"].values())
    assert len(whys) == 2 and "rounded to bf16 for the residual" in whys[0] + whys[1], whys
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    y_base, y_res = base.model().run(x)[0], res.model().run(x)[0]
    assert not np.array_equal(y_base, y_res)          # the skip path really is rounded
    for y in (y_base, y_res):
        rel = float(np.abs(y - want).max() / np.abs(want).max())
        assert 1e-5 < rel < 1e-2, rel
    np.testing.assert_array_equal(y_res, res.model().run(x, num_threads=2)[0])


def test_report_counts_bf16_activations():
    """``cuvil precision report``'s plan counts the values kept in bfloat16 between bf16 convolutions."""
    from cuvil.precision import plan_precision
    from cuvil.precision.report import format_report
    from cuvil.kernels.bf16_storage import bf16_storage
    model = chain_model(c0=16, cin=64, m=32, k=3, hw=14, pads=[1, 1, 1, 1])
    p = Pipeline.from_onnx(model).optimize()
    plan = plan_precision(p.graph, "bf16", input_ranges={"x": (-4.0, 4.0)}, target_ops={"bf16": frozenset({"Conv"})},
                          target="x86_64-linux-gnu")
    assert plan.bf16_stored == bf16_storage(p.graph, plan.formats())
    text = format_report(plan)
    if plan.formats().get("conv2") == "bf16":
        assert len(plan.bf16_stored) == 1 and "bf16 activations: 1 values" in text
    else:
        assert not plan.bf16_stored and "bf16 activations" not in text


@pytest.mark.parametrize("amx", PATHS)
def test_residual_bf16_is_the_plans_decision(amx):
    """An explicit ``--precision bf16`` stores the skip path (r1: read by conv1 and the residual Add) as
    bfloat16 where its range is certified finite in bf16: the plan (``bf16_residual``), the manifest's
    ``bf16_activations`` and the report say so. ``auto`` does not; ``X86Tuning(bf16_residual=False)`` opts out
    (the same bits as the plan without it); an undeclared input range leaves r1 float32, saying why."""
    from cuvil.precision import plan_precision
    from cuvil.precision.report import format_report
    model = residual_model()
    x = np.random.default_rng(2).standard_normal((1, 48, 14, 14)).astype(np.float32)
    rng = {"x": (-6.0, 6.0)}
    p = Pipeline.from_onnx(model).optimize()
    res = p.compile(precision="bf16", input_ranges=rng, tuning=X86Tuning(amx=amx))
    off = p.compile(precision="bf16", input_ranges=rng, tuning=X86Tuning(amx=amx, bf16_residual=False))
    auto = p.compile(precision="auto", input_ranges=rng, tuning=X86Tuning(amx=amx))
    plan = res.manifest["precision"]
    assert list(plan["bf16_residual"]) == ["r1"] and "certified finite in bf16" in plan["bf16_residual"]["r1"]
    whys = res.manifest["bf16_activations"]
    assert sorted(whys) == ["r1", "r2"] and "the precision plan's" in whys["r1"], whys
    assert "residual" in whys["r1"] and "2^-8" in whys["r1"]
    assert sorted(off.manifest["bf16_activations"]) == ["r2"]
    assert "bf16_residual" not in off.manifest["precision"]
    assert "X86Tuning(bf16_residual=False)" in off.manifest["precision"]["residual_fp32"]["r1"]
    assert "bf16_residual" not in auto.manifest["precision"]
    assert "r1" not in auto.manifest.get("bf16_activations", {})
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    y_res, y_off = res.model().run(x)[0], off.model().run(x)[0]
    assert not np.array_equal(y_res, y_off)          # the skip path really is rounded
    for y in (y_res, y_off):
        rel = float(np.abs(y - want).max() / np.abs(want).max())
        assert 1e-5 < rel < 1e-2, rel
    # the hand-narrowed build with every residual value forced (bf16_residual=True) computes the same bits
    np.testing.assert_array_equal(y_res, every_bf16(model, amx=amx, bf16_residual=True).model().run(x)[0])
    ops = {"bf16": frozenset({"Conv"})}
    pl = plan_precision(p.graph, "bf16", input_ranges=rng, target_ops=ops, target="x86_64-linux-gnu")
    assert "bf16 residual path (--precision bf16): 1 values" in format_report(pl)
    free = plan_precision(p.graph, "bf16", target_ops=ops, target="x86_64-linux-gnu")
    assert not free.bf16_residual and "range unbounded" in free.residual_fp32["r1"]
    assert "1 kept float32" in format_report(free)
