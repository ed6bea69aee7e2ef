"""The one-row product kernel (:mod:`cuvil.targets.ptx.gemv`, ``PtxTuning.gemv``; no GPU needed): which stages
take it (one output row, or a few each with a matrix of its own; the weight's columns contiguous), the column
tile it picks, 16-byte read-only weight loads where the rows stay aligned and scalar loads at clamped columns
where not (odd N), the fixed-order slice sum, and ptxas accepting a GPT-2 decode step's kernels with it.
Numbers on a GPU: test_gpu_gemv.py."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.ptx import assemble, find_ptxas
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.gemv import THREADS
from cuvil.targets.ptx.target import PtxOptions
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.hf_models import gpt2_decode_model

PTXAS = find_ptxas()
GEMV = PtxTuning(gemv=True)


def row_product(k, n, rows=1, seed=0):
    """tanh(x[rows, k] @ W[k, n] + b): a GEMV with a fused epilogue."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "B")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["a"]),
                           helper.make_node("Tanh", ["a"], ["y"])], "gemv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def batched_product(h, k, n, seed=0):
    """x[h, 1, k] @ W[h, k, n]: a product per row, each with a matrix of its own (attention's P @ V per head)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((h, k, n)).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "bgemv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [h, 1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [h, 1, n])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _build(model, tuning=GEMV):
    return build_ptx(gpu_schedule(Pipeline.from_onnx(model).optimize().graph, tuning=tuning), "sm_90", fma=True,
                     tuning=tuning)


def _entry(ptx, name):
    return re.search(r"\.visible \.entry %s\((.*?)\n\}\n" % name, ptx, re.S).group(0)


def test_aligned_rows_load_16_bytes_read_only():
    r = _build(row_product(768, 2304))
    (d,) = r.kernels
    # 2,304 columns: 16 per block (4 column threads) would give 144 blocks; 8 per block gives 288 >= 264
    assert d.kind == "gemv" and d.block == THREADS and d.grid == 288
    k = _entry(r.ptx, d.name)
    assert k.count("ld.global.nc.v4.f32") >= 4        # the unrolled rows' loads, read-only
    assert "fma.rn.f32" in k and k.count("bar.sync") == 3     # x into shared memory; the slices' sums (2 rounds)
    assert "shfl" not in k
    if PTXAS:
        _, info = assemble(r.ptx, "sm_90")
        assert info[d.name].stack_frame == 0 and info[d.name].spill_stores == 0


def test_odd_columns_take_scalar_loads():
    r = _build(row_product(769, 771))
    (d,) = r.kernels
    assert d.kind == "gemv" and d.grid == -(-771 // 8)
    k = _entry(r.ptx, d.name)
    assert ".v4" not in k.replace("st.shared.v4", "") and k.count("ld.global.nc.f32") + k.count(
        "ld.global.nc.b32") >= 4
    if PTXAS:
        assemble(r.ptx, "sm_90")


def test_wide_rows_keep_32_columns_per_block():
    (d,) = _build(row_product(64, 50257)).kernels
    assert d.kind == "gemv" and d.grid == -(-50257 // 32)


def test_small_grids_with_long_rows_take_bigger_blocks():
    """GPT-2's mlp.c_proj ([1, 3072] @ [3072, 768]): 96 blocks of 8 columns; 1,024 threads each (512 row slices,
    6 rows a thread, all loaded in one round) instead of 256 (24 rows, three rounds)."""
    r = _build(row_product(3072, 768))
    (d,) = r.kernels
    assert d.kind == "gemv" and d.grid == 96 and d.block == 1024
    assert _build(row_product(768, 768)).kernels[0].block == THREADS       # 6 rows a thread already
    if PTXAS:
        _, info = assemble(r.ptx, "sm_90")
        assert info[d.name].spill_stores == 0


def test_a_product_per_row_gets_a_block_per_row_and_tile():
    r = _build(batched_product(12, 1024, 64))
    (d,) = r.kernels
    # 64 columns: 8 per block (ct 2), 8 tiles x 12 rows = 96 blocks; 1,024 rows of k: 8 a thread, one round
    assert d.kind == "gemv" and d.grid == 96 and d.block == 256
    assert "ld.global.nc.v4.f32" in _entry(r.ptx, d.name)
    r = _build(batched_product(5, 129, 67))
    assert r.kernels[0].kind == "gemv" and r.kernels[0].grid == 5 * -(-67 // 8)
    if PTXAS:
        assemble(r.ptx, "sm_90")


def test_on_by_default_and_only_for_one_row():
    assert _build(row_product(768, 768), PtxTuning()).kernels[0].kind == "gemv"
    assert _build(row_product(768, 768), PtxTuning(gemv=False)).kernels[0].kind == "split"
    assert PtxTuning().gemv is True and PtxOptions().tuning.gemv is True and PtxOptions(gemv=False).tuning.gemv is False
    # two output rows sharing W: each would stream W again (a product of its own per row is taken: the decode
    # step's attention below)
    assert _build(row_product(768, 768, rows=2)).kernels[0].kind != "gemv"


def test_slices_add_in_a_fixed_order():
    """The slices' partial sums are added in straight lines of shared-memory reads (no atomics: the same bits
    every run): groups of slices, then the groups."""
    r = _build(row_product(512, 1024))
    k = _entry(r.ptx, r.kernels[0].name)
    assert "atom." not in k and not re.search(r"\bred\.", k)
    # 1,024 columns: 8 per block (2 column threads, 128 row slices), 128 blocks; the 128 slices of a column in
    # 32 groups of 4 (3 adds each), then the 32 groups (31 adds)
    assert r.kernels[0].grid == 128 and k.count("add.rn.f32") >= 34 and k.count("bar.sync") == 3


@pytest.mark.skipif(PTXAS is None, reason="ptxas not found (no CUDA toolkit)")
@pytest.mark.parametrize("fp16", [False, True])
def test_decode_step_products_take_it_and_assemble(fp16):
    """A small GPT-2 decode step (odd ffn 387 and vocabulary 1,001: scalar loads) compiled through
    Pipeline.compile with ``gemv``: its four weight products, the LM head and attention's P @ V (a row per head,
    each with its own V) are gemv kernels, and ptxas assembles the module (the bundle has its cubin)."""
    import json
    import os
    m = gpt2_decode_model(vocab=1001, hidden=96, layers=1, heads=4, ffn=387, max_pos=64)
    p = Pipeline.from_onnx(m).optimize()
    b = p.compile("nvptx64-nvidia-cuda", cache=False, fixed={"batch": 1, "past_sequence": 7, "total_sequence": 8},
                  gemv=True, enable_fp16=fp16, fused_attention=False)     # P @ V a product, not fused attention
    plan = json.load(open(os.path.join(b.path, "plan.json")))
    gemv = [k["stage"] for k in plan["kernels"] if k["kind"] == "gemv"]
    # float16 too: the KV cache's concatenation stays float32 (to_half's state pass-through), so P @ V reads V as
    # one affine load of the present
    products = ("c_attn", "res1", "gelu", "res2", "logits", "sdpa.ctx")
    assert len(gemv) == len(products) and all(any(p in s for s in gemv) for p in products), [
        (k["stage"], k["kind"]) for k in plan["kernels"]]
    if not fp16:
        ctx = [k for k in plan["kernels"] if "sdpa.ctx" in k["stage"]][0]
        assert ctx["grid"][0] % 4 == 0     # P[h] @ V[h]: 4 heads, a block per head and column tile
    assert os.path.exists(os.path.join(b.path, "kernels.sm_90.cubin"))
    ptx = open(os.path.join(b.path, "kernels.ptx")).read()
    # hidden 96: aligned rows (16-byte loads; float16: 8 columns as four 32-bit registers)
    assert ("ld.global.nc.v4.b32" if fp16 else "ld.global.nc.v4.f32") in ptx


def test_vector_loads_only_where_the_load_is_all_that_depends_on_n():
    """The vector path loads a thread's columns once and evaluates the rest of the weight factor at its first
    column: a factor with more that varies along n (W[k, n] * s[n]) must take the scalar path."""
    from cuvil.targets.ptx.gemv import _uses_var_outside, _vector_width
    k, n = 256, 512
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("Mul", ["W", "s"], ["ws"]), helper.make_node("Relu", ["ws"], ["y"])],
                          "scaled", [helper.make_tensor_value_info("s", TensorProto.FLOAT, [n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [k, n])], [w])
    st = gpu_schedule(Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
                      .optimize().graph, tuning=PtxTuning()).stages[0]
    kv, nv = (v.attr for v in st.vars)
    mul = next(x for x in _nodes(st.expr) if x.op == "mul")
    w_load = next(a for a in mul.args if a.op == "load" and a.attr.shape == (k, n))
    assert _vector_width(w_load, [kv], n, nv) == 4          # W[k, n] alone: 16-byte loads
    assert _vector_width(mul, [kv], n, nv) == 0             # W[k, n] * s[n]: s varies along n too
    s_load = next(a for a in mul.args if a is not w_load)
    assert not _uses_var_outside(w_load, nv, w_load) and not _uses_var_outside(s_load, nv, s_load)
    assert _uses_var_outside(mul, nv, w_load) and _uses_var_outside(mul, nv, s_load)   # the other load reads n


def _nodes(e):
    from cuvil.kernels.texpr import nodes
    return list(nodes(e))
