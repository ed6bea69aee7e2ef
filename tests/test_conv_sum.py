"""Sums of two 1x1 convolutions as one convolution over the concatenation of their inputs' channels
(rules/conv_sum.rule, an ``on x86`` rule the cost model accepts only for bf16 convolutions taking the channels-last
AMX form): ResNet's projection shortcut summed with a bottleneck's last convolution, at stride 1 and 2, as Add and
as Sum in either order; each piece read where it lies (a value stored channels-last in place, a graph input or a
strided projection through its own rows copy) against a float64 sum of the bfloat16-rounded operands within the
bound of float32 sums; the precision record keeps both convolutions narrowed; the forms that keep two convolutions
(float32, no AMX, channels that do not fill 32-channel steps). Skipped, with the reason printed, on a CPU without
AMX-BF16 where the kernels must run."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.amx import has_amx
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tuning import X86Tuning
from test_x86_bf16 import bf16

HAS_AMX = has_amx(host_cpu().features)
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=f"no AMX-BF16 on this CPU ({cpu_label()}): the tile kernels "
                                                   "cannot run here")
RULES = {"conv_add_strided_conv", "conv_add_conv", "conv_sum_strided_conv", "strided_conv_sum_conv", "conv_sum_conv"}


def block(cx, cy, m, hw, s, op="Add", strided_first=False, produced=False, batch=1):
    """``Relu(op(Conv(x, w1, b1), Conv(y, w2, b2, strides s)))`` with ``x`` [1, cx, hw, hw] and ``y`` [1, cy, hw*s,
    hw*s]; ``produced``: ``x`` is first a 3x3 convolution (``x0``, integer weights, sparse) of the graph input,
    whose output every test input leaves exact in bfloat16 (stored channels-last and read in place)."""
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((m, cx, 1, 1)) / np.sqrt(cx)).astype(np.float32)
    w2 = (rng.standard_normal((m, cy, 1, 1)) / np.sqrt(cy)).astype(np.float32)
    b1, b2 = rng.standard_normal(m).astype(np.float32), rng.standard_normal(m).astype(np.float32)
    w0 = rng.choice([-1.0, 0.0, 1.0], size=(cx, cx, 3, 3), p=[0.03, 0.94, 0.03]).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (b1, "b1"), (b2, "b2"), (w0, "w0"))]
    nodes, xin = [], "x"
    if produced:
        nodes += [helper.make_node("Conv", ["x", "w0"], ["x0"], pads=[1, 1, 1, 1], name="conv0"),
                  helper.make_node("Relu", ["x0"], ["x1"])]
        xin = "x1"
    c1 = helper.make_node("Conv", [xin, "w1", "b1"], ["c1"], name="conv_main")
    c2 = helper.make_node("Conv", ["y", "w2", "b2"], ["c2"], name="conv_proj", **({"strides": [s, s]} if s > 1 else {}))
    nodes += [c1, c2, helper.make_node(op, ["c2", "c1"] if strided_first else ["c1", "c2"], ["a"]),
              helper.make_node("Relu", ["a"], ["out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cx, hw, hw]),
                                       helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, cy, hw * s, hw * s])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, m, hw, hw])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), dict(w0=w0, w1=w1, w2=w2, b1=b1, b2=b2)


def narrowed(model, **kw):
    return Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges={"x": (-4, 4), "y": (-4, 4)},
                                                        **kw)


def applied(art) -> set:
    return set(art.manifest.get("rules_applied", {})) & RULES


def conv3x3(x, w):
    hw = x.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    return sum(np.einsum("mc,nchw->nmhw", w[:, :, i, j], xp[:, :, i:i + hw, j:j + hw]) for i in range(3) for j in range(3))


CASES = [
    (64, 96, 64, 16, 2, "Add", False, False),     # a projection of stride 2 (a strided rows copy), M of 2 blocks
    (64, 64, 256, 14, 1, "Sum", False, False),    # stride 1 as a two-input Sum, M of 8 blocks, a dropped-free grid
    (32, 128, 80, 9, 2, "Sum", True, False),      # the strided operand first; M % 32 = 16; odd map
    (64, 128, 128, 12, 2, "Add", False, True),    # the first piece stored channels-last by its producer, in place
]


@needs_amx
@pytest.mark.parametrize("cx,cy,m,hw,s,op,strided_first,produced", CASES, ids=[f"sum{i}" for i in range(len(CASES))])
def test_sum_of_two_convolutions_as_one(cx, cy, m, hw, s, op, strided_first, produced):
    model, w = block(cx, cy, m, hw, s, op, strided_first, produced)
    art = narrowed(model)
    assert len(applied(art)) == 1, art.manifest.get("rules_applied")
    kernels = [st["kernel"] for st in art.manifest["steps"]]
    assert kernels.count("bf16_nhwc_amx") == 1 + produced, kernels        # the two 1x1 convolutions are one
    nodes = art.manifest["precision"]["nodes"]
    assert nodes["conv_main"]["format"] == nodes["conv_proj"]["format"] == "bf16"     # the record stays true
    assert not art.manifest["memory_safety"]["guarded"], art.manifest["memory_safety"]["summary"]
    check_sum(art.model(), w, cx, cy, hw, s, produced)


def check_sum(mod, w, cx, cy, hw, s, produced=False, n=1, seed=2):
    """``mod`` (a block's library) on ``n`` images: the same bits on 1 and 2 threads, within the bound of float32
    sums of a float64 sum of the bfloat16-rounded operands, far closer to it than to the unrounded one."""
    rng = np.random.default_rng(seed)
    if produced:
        x = rng.choice([-1.0, 0.0, 1.0], size=(n, cx, hw, hw)).astype(np.float32)
    else:
        x = rng.uniform(-4, 4, (n, cx, hw, hw)).astype(np.float32)
    y = rng.uniform(-4, 4, (n, cy, hw * s, hw * s)).astype(np.float32)
    out = mod.run({"x": x, "y": y}, num_threads=2)["out"]
    np.testing.assert_array_equal(out, mod.run({"x": x, "y": y}, num_threads=1)["out"])
    f64 = lambda a: bf16(a).astype(np.float64)  # noqa: E731
    xx = f64(x)
    if produced:
        xx = np.maximum(conv3x3(xx, w["w0"].astype(np.float64)), 0)
        assert np.abs(xx).max() < 256 and np.array_equal(xx, np.round(xx))      # exact in bfloat16
    t1 = np.einsum("mc,nchw->nmhw", f64(w["w1"][:, :, 0, 0]), xx)
    t2 = np.einsum("mc,nchw->nmhw", f64(w["w2"][:, :, 0, 0]), f64(y)[:, :, ::s, ::s])
    mag = (np.einsum("mc,nchw->nmhw", np.abs(f64(w["w1"][:, :, 0, 0])), np.abs(xx))
           + np.einsum("mc,nchw->nmhw", np.abs(f64(w["w2"][:, :, 0, 0])), np.abs(f64(y)[:, :, ::s, ::s])))
    bias = (w["b1"].astype(np.float64) + w["b2"])[None, :, None, None]
    want = np.maximum(t1 + t2 + bias, 0)
    bound = 2 * (cx + cy + 2) * 2.0 ** -24 * (mag + np.abs(bias))
    assert np.all(np.abs(out - want) <= bound), float(np.abs(out - want).max())
    unrounded = np.maximum(np.einsum("mc,nchw->nmhw", w["w1"][:, :, 0, 0].astype(np.float64), xx) + bias
                           + np.einsum("mc,nchw->nmhw", w["w2"][:, :, 0, 0].astype(np.float64),
                                       y.astype(np.float64)[:, :, ::s, ::s]), 0)
    assert float(np.abs(out - unrounded).max()) > 100 * float(np.abs(out - want).max())   # bf16 rounding in effect


@needs_amx
def test_symbolic_batch():
    """A batch profile N 1..4 (opt 2): the sum fuses in the generic kernels (units counted at run time, each
    piece's images apart by its own stride) and at the opt point; every N against the float64 reference."""
    model, w = block(64, 96, 64, 10, 2, batch="N")
    art = narrowed(model, shape_profiles={"N": (1, 2, 4)})
    assert len(applied(art)) == 1
    steps = [st for st in art.manifest["steps"] if st["kernel"] == "bf16_nhwc_amx"]
    assert {st["shape"][0] for st in steps} == {"N", 2}, steps
    mod = art.model()
    for n in (1, 3, 4):
        check_sum(mod, w, 64, 96, 10, 2, n=n, seed=n)


@needs_amx
def test_in_place_piece_is_stored_channels_last():
    """The first piece, a bf16 convolution's output read only by the sum, is stored channels-last in bfloat16 (a
    move into a bf16 convolution's input: the same bits) and read in place: one rows copy (the 3x3's padded
    input) and one for the strided projection."""
    model, _ = block(64, 128, 128, 12, 2, "Add", produced=True)
    art = narrowed(model)
    man = art.manifest
    assert "x1" in man.get("channels_last_activations", []) and "moves" in man["bf16_activations"]["x1"]
    assert [st["kernel"] for st in man["steps"]].count("nhwc_rows") == 2


@pytest.mark.parametrize("why", ["fp32", "no_amx", "channels", "planar"])
def test_forms_that_keep_two_convolutions(why):
    """float32 convolutions, bf16 ones without the AMX kernels or without the channels-last form, and pieces that
    do not fill whole steps of 32 channels keep two convolutions (and the rule's name out of the manifest)."""
    if why in ("channels", "planar") and not HAS_AMX:
        pytest.skip(f"no AMX-BF16 on this CPU ({cpu_label()}): nothing to compare against")
    model, _ = block(48 if why == "channels" else 64, 96, 64, 16, 2)
    if why == "fp32":
        art = Pipeline.from_onnx(model).optimize().compile()
    else:
        tuning = {"no_amx": X86Tuning(amx=False), "planar": X86Tuning(channels_last=False)}.get(why)
        art = narrowed(model, **({"tuning": tuning} if tuning is not None else {}))
    assert not applied(art)
    assert sum(st.get("flops", 0) > 0 for st in art.manifest["steps"]) == 2      # two convolutions


@needs_amx
@pytest.mark.parametrize("act", ["Relu", "Sigmoid"])
def test_bottlenecks_fused_match_the_planar_build(act):
    """tests/test_x86_amx_nhwc.py's two bottlenecks, the first with a projection: its last convolution and the
    projection run as one (the pool's output read through the rows copy the block's first convolution shares, the
    3x3's output in place), the first block's float32 term gone; against the channel-planar build (no fusion):
    the same values up to the order of the float32 sums and a bfloat16 step where they differ in the last bit."""
    from test_x86_amx_nhwc import _bottlenecks, check_bottlenecks, narrowed as narrowed_wide
    model = _bottlenecks(act)
    art, planar = narrowed_wide(model), narrowed_wide(model, tuning=X86Tuning(channels_last=False))
    assert len(applied(art)) == 1 and not applied(planar)
    cl = art.manifest.get("channels_last_activations", [])
    assert {"a1_r", "b1_r", "o1", "a2_r", "b2_r"} <= set(cl), cl
    assert [s["kernel"] for s in art.manifest["steps"]].count("nhwc_rows") == 4      # pool (shared), 2 pads, d
    check_bottlenecks(model, art, planar)


def test_precision_carried_only_to_moved_operands():
    """The rewrite engine carries the matched contractions' common format to a replacement contraction whose
    rounded operands are theirs or moves of them (the Concat of rules/conv_sum.rule), with their names; a
    replacement that computes an operand (a sum of two weights, rounded once instead of twice) stays float32."""
    from cuvil.dsl.parser import parse_rules
    from cuvil.rewrite_rules.engine import RewriteReport, apply_rules

    def graph(model, fmt):
        g = Pipeline.from_onnx(model).optimize().graph.clone()
        for n in g.nodes:
            if n.op in ("Conv", "MatMul"):
                n.precision = fmt
        return g
    model, _ = block(64, 96, 64, 16, 2)
    rules = parse_rules(open(__file__.replace("tests/test_conv_sum.py", "rules/conv_sum.rule")).read())
    for fmt in ("bf16", ""):
        g = graph(model, fmt)
        assert apply_rules(g, rules, RewriteReport()) == 1
        (conv,) = [n for n in g.nodes if n.op == "Conv" and getattr(n.inputs[0].producer, "op", "") == "Concat"]
        assert conv.precision == fmt and conv.fused_from == (("conv_main", "conv_proj") if fmt else ())
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    w1, w2 = (numpy_helper.from_array(np.full((8, 8), v, np.float32), n) for v, n in ((0.5, "w1"), (0.25, "w2")))
    mm = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["x", "w2"], ["b"]),
                            helper.make_node("Add", ["a", "b"], ["y"])], "mm", [x],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2])
    g = graph(helper.make_model(mm, opset_imports=[helper.make_opsetid("", 17)]), "bf16")
    merge = parse_rules("# x W1 + x W2 -> x (W1 + W2)\nrule merge_weights\n  Add(MatMul(x, w1), MatMul(x, w2)) "
                        "when const(w1, w2) => MatMul(x, w1 + w2)\n  prove real\n")
    assert apply_rules(g, merge, RewriteReport()) == 1
    (m,) = [n for n in g.nodes if n.op == "MatMul" and n.inputs[1].producer is not None]
    assert m.precision == "" and m.fused_from == ()


@needs_amx
@pytest.mark.parametrize("keep,m", [(32, 32), (32, 64), (16, 48), (64, 64)], ids=["ch32m32", "ch32m64", "ch16", "whole"])
def test_concatenation_with_a_channel_slice(keep, m):
    """A 1x1 convolution over Concat(x, Slice(y) of its first ``keep`` channels) (a model's own graph, no rule): a
    slice of the channels is not a whole piece of ``y`` and the concatenation is stored first (a hostile review
    found it read as the whole of ``y``: NaN from the weights of the next block); the whole of ``y`` is read
    where it lies. Against a float64 sum of the rounded operands."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((m, 32 + keep, 1, 1)) / 8).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([0], np.int64), "st"),
             numpy_helper.from_array(np.array([keep], np.int64), "en"),
             numpy_helper.from_array(np.array([1], np.int64), "ax")]
    nodes = [helper.make_node("Slice", ["y", "st", "en", "ax"], ["ys"]),
             helper.make_node("Concat", ["x", "ys"], ["c"], axis=1), helper.make_node("Conv", ["c", "w"], ["out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8]),
                                       helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 8, 8])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, m, 8, 8])], inits)
    art = narrowed(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    ms = art.manifest["memory_safety"]
    assert not ms["guarded"] and ms["kernels_proved"] == ms["kernels"], ms["summary"]      # the AMX kernel runs
    assert [st["kernel"] for st in art.manifest["steps"]][-1] == "bf16_nhwc_amx"
    x, y = rng.uniform(-4, 4, (1, 32, 8, 8)).astype(np.float32), rng.uniform(-4, 4, (1, 64, 8, 8)).astype(np.float32)
    out = art.model().run({"x": x, "y": y}, num_threads=1)["out"]
    cc = np.concatenate([bf16(x), bf16(y)[:, :keep]], 1).astype(np.float64)
    want = np.einsum("mc,nchw->nmhw", bf16(w[:, :, 0, 0]).astype(np.float64), cc)
    mag = np.einsum("mc,nchw->nmhw", np.abs(bf16(w[:, :, 0, 0]).astype(np.float64)), np.abs(cc))
    assert np.all(np.abs(out - want) <= 2 * (32 + keep) * 2.0 ** -24 * mag), float(np.nanmax(np.abs(out - want)))


@needs_amx
def test_fire_module_concatenations():
    """SqueezeNet's fire modules under bf16: a Concat of two expansions read by the next squeeze convolution is
    read piece by piece where each lies (no stored concatenation), and one read by a max pool is stored as
    bfloat16 (its pieces are bfloat16 values already) with the expansions writing into it in place, the one copy a
    3x3 convolution reads too; the same bits
    as with concatenations copied (X86Tuning(concat_in_place=False)), and no loop nest left."""
    rng = np.random.default_rng(3)
    nodes, inits = [], []

    def conv(name, x, cin, cout, k):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, name + "_w"))
        nodes.extend([helper.make_node("Conv", [x, name + "_w"], [name], pads=[k // 2] * 4),
                      helper.make_node("Relu", [name], [name + "_r"])])
        return name + "_r"

    def fire(tag, x, cin, squeeze, expand):
        s = conv(tag + "s", x, cin, squeeze, 1)
        nodes.append(helper.make_node("Concat", [conv(tag + "e1", s, squeeze, expand, 1),
                                                 conv(tag + "e3", s, squeeze, expand, 3)], [tag], axis=1))
        return tag
    f1 = fire("f1", "x", 64, 32, 64)
    f2 = fire("f2", f1, 128, 32, 64)                 # f1's Concat read by f2's squeeze convolution: by pieces
    nodes.append(helper.make_node("MaxPool", [f2], ["p"], kernel_shape=[3, 3], strides=[2, 2]))
    out = conv("head", "p", 128, 32, 1)              # f2's Concat read by the pool: stored bf16, in place,
    side = conv("side", f2, 128, 32, 3)              # and that one copy read by a 3x3 convolution too
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 27, 27])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (out, side)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    ranges = {"x": (-4.0, 4.0)}
    art = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges)
    copied = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges,
                                                          tuning=X86Tuning(concat_in_place=False))
    man = art.manifest
    assert set(man.get("concats_in_place", [])) == {"f2e1_r", "f2e3_r"}, man.get("concats_in_place")
    assert "loop" not in [st["kernel"] for st in man["steps"]], [st["kernel"] for st in man["steps"]]
    assert {"f1e1_r", "f1e3_r"} <= set(man.get("channels_last_activations", []))
    x = rng.standard_normal((1, 64, 27, 27)).astype(np.float32)
    for got, want in zip(art.model().run(x), copied.model().run(x)):
        np.testing.assert_array_equal(got, want)
