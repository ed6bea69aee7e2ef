"""A value read only by a MaxPool whose output is stored as bfloat16 (a ResNet's stem: Conv -> Relu -> MaxPool
-> bf16 Convs) is stored as bfloat16 too (:mod:`cuvil.kernels.bf16_storage`): max commutes with rounding to
nearest even, so the pool over the rounded values gives what its readers would round its float32 output to.

Checked three ways: the identity itself on float32 values at and around every kind of bfloat16 boundary
(ties, the largest finite values that round to inf, values that round to zero, infinities, NaN); which
values the rule stores, and which it must not (a pool read by a float32 node, a pool whose Indices are
read); and compiled end to end, where the library with bf16 activations equals the one with float32
activations bit for bit, its pool reading the 16-bit words unpadded.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.kernels.bf16_storage import bf16_storage_reason
from cuvil.kernels.contraction import bf16_values
from cuvil.targets.x86.cpu import cpu_label
from test_bf16_activations import PATHS, every_bf16
from test_x86_bf16 import HAS_BF16


def boundary_values(rng, n):
    """float32 values at bfloat16's edges: exact bfloat16s, halfway ties (both parities), one ulp either side
    of a tie, the finite values around the overflow threshold, denormals, zeros of both signs, infinities,
    NaN, and ordinary normals."""
    b = rng.integers(0, 1 << 16, n, dtype=np.uint32) << 16             # every bfloat16 bit pattern
    low = rng.choice(np.array([0, 0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF, 0x4000], np.uint32), n)
    u = (b | low).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3895314e38, 3.4028235e38, -3.4028235e38,
                        1e-45, -1e-45, 1e-39, -1e-39], np.float32)
    return np.concatenate([u, special, rng.standard_normal(n).astype(np.float32)])


def fmax_pool(x, k):
    """Cuvil's MaxPool over windows of ``k`` consecutive values, as its row kernel computes it: the accumulator
    starts NaN and takes a value greater than it or while it is NaN (NaN skipped, signalling or quiet alike;
    numpy's fmax returns NaN beside a signalling NaN)."""
    w = x[: len(x) // k * k].reshape(-1, k)
    acc = np.full(len(w), np.nan, np.float32)
    with np.errstate(invalid="ignore"):
        for j in range(k):
            acc = np.where((w[:, j] > acc) | np.isnan(acc), w[:, j], acc)
    return acc


@pytest.mark.parametrize("k", [2, 3, 9])
def test_max_commutes_with_bf16_rounding(k):
    rng = np.random.default_rng(k)
    x = boundary_values(rng, 20000)
    for _ in range(4):
        rng.shuffle(x)
        with np.errstate(invalid="ignore"):         # (casting NaN to bfloat16)
            after = bf16_values(fmax_pool(x, k))   # the pool in float32, its output rounded (before the change)
            before = fmax_pool(bf16_values(x), k)  # the pool over the rounded values (the stored bfloat16)
        # the same values, NaN where NaN; a zero's sign may differ (a tiny negative rounds to -0 beside +0)
        np.testing.assert_array_equal(after, before)
        same_bits = after.view(np.uint32) == before.view(np.uint32)
        assert np.all(same_bits | (after == 0) | np.isnan(after))


def stem_model(hw=64, pool_reader="conv", indices=False, ceil_mode=0):
    """x -> Conv 7x7/2 (3 -> 16) -> Relu -> MaxPool 3x3/2 pad 1 -> Conv 1x1 (16 -> 32) -> y. ``pool_reader``
    "conv+add": the pool's output is also added to the Conv's output (a float32 reader)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 7, 7)) / 10).astype(np.float32), "w1"),
             numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((16, 16, 1, 1)) / 4).astype(np.float32), "w2")]
    outs = ["p", "idx"] if indices else ["p"]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", kernel_shape=[7, 7], strides=[2, 2],
                              pads=[3] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], outs, name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4,
                              ceil_mode=ceil_mode),
             helper.make_node("Conv", ["p", "w2"], ["c2" if pool_reader == "conv+add" else "y"], name="conv2",
                              kernel_shape=[1, 1])]
    graph_outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if pool_reader == "conv+add":
        nodes.append(helper.make_node("Add", ["c2", "p"], ["y"]))
    if indices:
        graph_outs.append(helper.make_tensor_value_info("idx", TensorProto.INT64, None))
    g = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, hw, hw])],
                          graph_outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _reasons(model):
    p = Pipeline.from_onnx(model).optimize()
    for n in p.graph.nodes:
        if n.op == "Conv":
            n.precision = "bf16"
    return {v.name: bf16_storage_reason(p.graph, v) for n in p.graph.nodes for v in n.outputs if v is not None}


def test_which_pool_inputs_are_stored():
    why = _reasons(stem_model())
    assert why["p"] == "read only by bf16 convolution(s) conv2"
    assert why["r1"].startswith("read only by max pool(s) pool, whose output is stored as bfloat16")
    # the pool's output also read by a float32 Add: neither it nor the pool's input is stored as bfloat16
    why = _reasons(stem_model(pool_reader="conv+add"))
    assert why["p"] is None and why["r1"] is None
    # the pool's Indices read (a graph output): rounding could tie two maxima and move an index
    why = _reasons(stem_model(indices=True))
    assert why["r1"] is None


@pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 kernels cannot "
                                         "run here")
@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_stem_pool_reads_bf16_same_bits(amx, ceil_mode):
    model = stem_model(hw=66, ceil_mode=ceil_mode)
    on, off = every_bf16(model, amx=amx), every_bf16(model, amx=amx, bf16_storage=False)
    assert set(on.manifest["bf16_activations"]) == {"r1", "p"}
    kinds = {s["stage"]: s for s in on.manifest["steps"]}
    # the stem stores bfloat16; the pool reads it with no padded copy in between
    assert kinds["r1"].get("stores") == "bf16" and kinds["p"]["kernel"] == "maxpool"
    assert [s["kernel"] for s in on.manifest["steps"]].count("pad") == 1     # the stem's own input copy
    x = np.random.default_rng(3).standard_normal((1, 3, 66, 66)).astype(np.float32)
    y_on, y_off = on.model().run(x)[0], off.model().run(x)[0]
    np.testing.assert_array_equal(y_on, y_off)
    np.testing.assert_array_equal(y_on, on.model().run(x, num_threads=2)[0])
