"""Attention as one GPU kernel on a GPU (``PtxTuning.fused_attention``, :mod:`cuvil.targets.ptx.attention`):
against numpy in float64 with ragged key counts (past 1, 127, 1023: 2, 128 and 1,024 keys, a chunk of threads
partly past the last key), a padded mask (``-inf`` and ``-10000`` entries, one batch masked whole: the NaN guard
gives 0), float32 and float16, the same bits run to run; against the unfused kernels; and a small GPT-2 decode
step against onnxruntime. The structure without a GPU: test_ptx_attention.py."""
import json
import os

import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.testing.hf_models import gpt2_decode_model, text_feeds
from cuvil.testing.ptx_bundles import run_ptx_bundle
from cuvil.testing.requires import needs_gpu

from test_ptx_attention import attention_model

pytestmark = needs_gpu


def _inputs(b, h, sq, sk, d, dv, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, h, sk, d)).astype(np.float32)
    v = rng.standard_normal((b, h, sk, dv)).astype(np.float32)
    mask = np.zeros((b, 1, 1, sk), np.float32)
    mask[0, ..., sk - sk // 4:] = -np.inf            # padded keys
    mask[0, ..., 1:sk // 3:2] = -10000.0             # the exports' large negative
    mask[-1] = -np.inf                               # a batch masked whole: NaN softmax, guarded to 0
    return q, k, v, mask


def _reference(model, q, k, v, mask, fp16):
    """float64 attention of the model (biases, scale, mask, guard); with ``fp16`` the operands rounded to half
    as the float16 graph stores them (inputs, biases, the biased projections), the result rounded on the way out."""
    from onnx import numpy_helper
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    r = (lambda x: np.asarray(x, np.float16).astype(np.float64)) if fp16 else (lambda x: np.asarray(x, np.float64))
    qb, kb, vb = r(r(q) + r(w["bq"])), r(r(k) + r(w["bk"].reshape(-1))), r(r(v) + r(w["bv"]))
    s = float(w["s"]) ** 2
    scores = np.einsum("bhqd,bhkd->bhqk", qb, kb) * s + mask.astype(np.float64)
    with np.errstate(invalid="ignore"):
        top = scores.max(-1, keepdims=True)
        e = np.exp(scores - top)
        p = e / e.sum(-1, keepdims=True)
    p = np.where(np.isnan(p), 0.0, p)
    att = np.einsum("bhqk,bhkc->bhqc", p, vb)
    bound = (np.einsum("bhqd,bhkd->bhqk", np.abs(qb), np.abs(kb)) * s).max()
    return r(r(att) + r(w["bo"])), att, vb, bound


@pytest.mark.parametrize("past", [1, 127, 1023])
@pytest.mark.parametrize("fp16", [False, True])
def test_decode_rows_match_numpy(tmp_path, past, fp16):
    sk, d = past + 1, 64
    model = attention_model(2, 3, 1, sk, d, seed=past)
    xs = _inputs(2, 3, 1, sk, d, d, past)
    y = run_ptx_bundle(model, xs, tmp_path / "a", fused_attention=True, enable_fp16=fp16)
    again = run_ptx_bundle(model, xs, tmp_path / "b", fused_attention=True, enable_fp16=fp16)
    off = run_ptx_bundle(model, xs, tmp_path / "c", fused_attention=False, enable_fp16=fp16)
    ref, att, vb, bound = _reference(model, *xs, fp16)
    vmax = np.abs(vb).max()
    # float32: the scores' sums (d terms, error <= d eps sum|q k| s) move each weight by that much relatively, the
    # softmax and P.V sums (sk terms) add sk eps; float16: plus the roundings of the output and of + bo
    tol = 4 * 2.0 ** -24 * (d * bound + sk + 8) * vmax
    if fp16:
        tol += 2.0 ** -10 * (np.abs(att).max() + np.abs(ref).max())
    assert y.shape == ref.shape and np.isfinite(y).all()
    assert np.abs(y - ref).max() <= tol
    assert np.array_equal(y, again)                 # fixed summation order: the same bits every run
    assert np.abs(y - off).max() <= 2 * tol
    assert np.array_equal(y[-1], ref[-1].astype(np.float32))    # masked whole: 0 + bo, not NaN


@pytest.mark.parametrize("fp16", [False, True])
def test_query_rows_with_odd_heads_match_numpy(tmp_path, fp16):
    """Several query rows (a prefill), 77 keys, head sizes 32 (Q, K) and 48 (V: a block's 96 threads, 2 groups)."""
    model = attention_model(2, 2, 5, 77, 32, 48, seed=5)
    xs = _inputs(2, 2, 5, 77, 32, 48, 5)
    y = run_ptx_bundle(model, xs, tmp_path / "a", fused_attention=True, enable_fp16=fp16)
    ref, att, vb, bound = _reference(model, *xs, fp16)
    tol = 4 * 2.0 ** -24 * (32 * bound + 77 + 8) * np.abs(vb).max()
    if fp16:
        tol += 2.0 ** -10 * (np.abs(att).max() + np.abs(ref).max())
    assert np.abs(y - ref).max() <= tol


@pytest.mark.parametrize("fp16", [False, True])
def test_decode_step_matches_onnxruntime(fp16):
    """A small GPT-2 decode step with the fused kernel, against onnxruntime and the unfused bundle."""
    import onnxruntime as ort
    from cuvil.targets.ptx.runtime import load_bundle
    m = gpt2_decode_model(vocab=1001, hidden=96, layers=2, heads=4, ffn=387, max_pos=64)
    feeds = text_feeds(m, 1, 7)
    names = [vi.name for vi in m.graph.input]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    p = Pipeline.from_onnx(m).optimize()
    outs = {}
    for fused in (False, True):
        b = p.compile("nvptx64-nvidia-cuda", cache=False, fixed={"batch": 1, "past_sequence": 7,
                                                                 "total_sequence": 8},
                      fused_attention=fused, enable_fp16=fp16)
        with open(os.path.join(b.path, "plan.json")) as f:
            assert ("attention" in [k["kind"] for k in json.load(f)["kernels"]]) == fused
        with load_bundle(b.path) as mod:
            outs[fused] = mod.run(*[feeds[n] for n in names])
    tol = 3e-3 if fp16 else 2e-5       # test_gpu_gemv.py's decode-step tolerances
    for y_new, y_old, r in zip(outs[True], outs[False], ref):
        scale = max(np.abs(r).max(), 1e-30)
        assert np.abs(y_new - r).max() / scale <= tol
        assert np.abs(y_new - y_old).max() / scale <= tol


@pytest.mark.parametrize("fp16", [False, True])
def test_split_decode_step_matches_onnxruntime(tmp_path, fp16):
    """Past 300 with padded keys: each head's 301 keys split over 4 blocks (PtxTuning.attention_split_keys) and
    merged by the second kernel, against onnxruntime and against the same kernel unsplit; the presents' old rows
    are the past bit for bit in float16 too (the cache passes through in float32: precision.state_nodes)."""
    import onnxruntime as ort
    from cuvil.rewrite_rules.specialize import specialize_graph
    from cuvil.targets.ptx.bundle import compile_bundle
    from cuvil.targets.ptx.runtime import load_bundle
    from cuvil.targets.ptx.tuning import PtxTuning
    m = gpt2_decode_model(vocab=1001, hidden=96, layers=2, heads=4, ffn=387, max_pos=512)
    feeds = text_feeds(m, 1, 300, seed=4)
    feeds["attention_mask"][0, 17:90] = 0              # padded keys in the first splits, none in the last
    names = [vi.name for vi in m.graph.input]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    p = Pipeline.from_onnx(m).optimize()
    outs = {}
    g, _ = specialize_graph(p.graph, {"batch": 1, "past_sequence": 300, "total_sequence": 301})
    # the split with its merge kernel, no split, and the default since session 22: the row's last block merging
    # (its counter reset for the second layer and for the next run) with staged keys
    variants = {"split": dict(attention_fused_merge=False, attention_stage_keys=False),
                "one block": dict(attention_split_keys=0),
                "fused merge": dict(attention_fused_merge=True, attention_stage_keys=True)}
    for name, opts in variants.items():
        path = str(tmp_path / name.replace(" ", "_"))
        compile_bundle(g, path, enable_fp16=fp16, tuning=PtxTuning(fused_attention=True, **opts))
        with open(os.path.join(path, "plan.json")) as f:
            kinds = [k["kind"] for k in json.load(f)["kernels"]]
        assert kinds.count("attention") == 2 and kinds.count("attention_merge") == (2 if name == "split" else 0)
        with load_bundle(path) as mod:
            outs[name] = mod.run(*[feeds[n] for n in names])
            again = mod.run(*[feeds[n] for n in names])      # a second run: the counters start from zero again
        assert all(np.array_equal(a, b_) for a, b_ in zip(outs[name], again)), name
    tol = 3e-3 if fp16 else 2e-5       # test_gpu_gemv.py's decode-step tolerances
    out_names = [vo.name for vo in m.graph.output]
    for j, (name, r) in enumerate(zip(out_names, ref)):
        y, y1, yf = (outs[v][j] for v in ("split", "one block", "fused merge"))
        scale = max(np.abs(r).max(), 1e-30)
        assert np.abs(y - r).max() / scale <= tol, name
        assert np.abs(y - y1).max() / scale <= tol, name
        assert np.array_equal(y, yf), name      # the same sums in the same order as the merge kernel's
        if name.startswith("present."):
            assert np.array_equal(y[:, :, :300], feeds[name.replace("present", "past_key_values")]), name


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("stage, fused_merge", [(True, False), (False, True), (True, True)])
def test_kernel_variants_match_numpy(tmp_path, fp16, stage, fused_merge):
    """The options the defaults leave out (written in session 20, whose device was withdrawn before they ran):
    a chunk's keys staged through shared memory (attention_stage_keys) and the merge by the row's last block
    (attention_fused_merge), at past 1023 (16 splits of 64 keys): against numpy, and the same bits as the
    defaults (the same sums in the same order)."""
    sk, d = 1024, 64
    model = attention_model(2, 3, 1, sk, d, seed=11)
    xs = _inputs(2, 3, 1, sk, d, d, 11)
    y = run_ptx_bundle(model, xs, tmp_path / "a", fused_attention=True, enable_fp16=fp16,
                       attention_stage_keys=stage, attention_fused_merge=fused_merge)
    base = run_ptx_bundle(model, xs, tmp_path / "b", fused_attention=True, enable_fp16=fp16)
    ref, att, vb, bound = _reference(model, *xs, fp16)
    tol = 4 * 2.0 ** -24 * (d * bound + sk + 8) * np.abs(vb).max()
    if fp16:
        tol += 2.0 ** -10 * (np.abs(att).max() + np.abs(ref).max())
    assert np.abs(y - ref).max() <= tol
    assert np.array_equal(y, base)      # the same sums in the same order: the same bits as the defaults
    assert np.array_equal(y[-1], ref[-1].astype(np.float32))


# --- many query rows in float16 on tensor cores (PtxTuning.attention_mma, ptx/attention_mma.py) ---------------

def _kinds(path):
    with open(os.path.join(path, "plan.json")) as f:
        return [k["kind"] for k in json.load(f)["kernels"]]


@pytest.mark.parametrize("shape", [(2, 3, 100, 77, 64, 64, False), (1, 2, 128, 300, 128, 128, False),
                                   (2, 2, 40, 65, 80, 48, False), (2, 2, 48, 72, 64, 64, True)])
def test_flash_rows_match_numpy(tmp_path, shape):
    """The flash kernel against numpy (float64 of the float16 operands): ragged rows (100: a tile past Sq) and keys
    (77, 65, 300: a chunk past Sk), head sizes 64, 128 (32-key chunks), 80 / 48, keys stored transposed (copied
    element by element); the padded mask, the batch masked whole (the NaN guard gives 0 + bo); the same bits on a
    second run; against the unfused float16 kernels (attention_mma off)."""
    from cuvil.targets.ptx.bundle import compile_bundle
    from cuvil.targets.ptx.runtime import load_bundle
    from cuvil.targets.ptx.tuning import PtxTuning
    b, h, sq, sk, d, dv, kt = shape
    model = attention_model(b, h, sq, sk, d, dv, seed=sq + sk, k_transposed=kt)
    q, k, v, mask = _inputs(b, h, sq, sk, d, dv, sq + sk)
    feeds = (q, np.ascontiguousarray(k.transpose(0, 1, 3, 2)) if kt else k, v, mask)
    g = Pipeline.from_onnx(model).optimize().graph
    outs = {}
    for mma in (True, False):
        path = str(tmp_path / f"m{int(mma)}")
        compile_bundle(g, path, enable_fp16=True, tuning=PtxTuning(attention_mma=mma))
        assert ("attention_mma" in _kinds(path)) == mma
        with load_bundle(path) as mod:
            outs[mma] = mod.run(*feeds)[0]
            again = mod.run(*feeds)[0]
        assert np.array_equal(outs[mma], again)
    y = outs[True]
    ref, att, vb, bound = _reference(model, q, k, v, mask, True)
    vmax = np.abs(vb).max()
    # test_decode_rows_match_numpy's float16 bound, plus the weights P rounded to float16 before P.V (relative
    # 2^-11 each: at most 2^-11 max|V| on a row's weighted sum), as the unfused graph rounds the softmax's output
    tol = 4 * 2.0 ** -24 * (d * bound + sk + 8) * vmax + 2.0 ** -10 * (np.abs(att).max() + np.abs(ref).max())
    tol += 2.0 ** -11 * vmax
    assert y.shape == ref.shape and np.isfinite(y).all()
    assert np.abs(y - ref).max() <= tol
    assert np.abs(y - outs[False]).max() <= 2 * tol
    assert np.array_equal(y[-1], ref[-1].astype(np.float32))    # masked whole: 0 + bo, not NaN


def test_flash_bert_with_padded_batch_matches_onnxruntime(tmp_path):
    """A float16 BERT (2 layers, heads of 64) at B = 3, S = 128, the second sequence padded after 90 tokens and
    the third after 7: against onnxruntime (float32) and the unfused float16 bundle."""
    import onnxruntime as ort
    from cuvil.testing.hf_models import bert_model
    from cuvil.targets.ptx.runtime import load_bundle
    m = bert_model(vocab=1001, hidden=256, layers=2, heads=4, ffn=512, max_pos=512)
    feeds = text_feeds(m, 3, 128, seed=3)
    feeds["attention_mask"][1, 90:] = 0
    feeds["attention_mask"][2, 7:] = 0
    names = [vi.name for vi in m.graph.input]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    p = Pipeline.from_onnx(m).optimize()
    outs = {}
    for mma in (True, False):
        from cuvil.targets.ptx.bundle import compile_bundle
        from cuvil.rewrite_rules.specialize import specialize_graph
        g, _ = specialize_graph(p.graph, {"batch": 3, "sequence": 128})
        path = str(tmp_path / f"b{int(mma)}")
        from cuvil.targets.ptx.tuning import PtxTuning
        compile_bundle(g, path, enable_fp16=True, tuning=PtxTuning(attention_mma=mma))
        assert _kinds(path).count("attention_mma") == (2 if mma else 0)
        with load_bundle(path) as mod:
            outs[mma] = mod.run(*[feeds[n] for n in names])
    for j, r in enumerate(ref):
        scale = np.abs(r).max()
        # the float16 BERT's tolerance against float32 (bench/gpu/RESULTS.md: 1.3e-3 - 5.8e-3 normwise measured)
        assert np.abs(outs[True][j] - r).max() / scale <= 1e-2, j
        assert np.abs(outs[True][j] - outs[False][j]).max() / scale <= 1e-2, j


def _plain_attention(b, h, sq, sk, d, mask):
    """softmax(((q + bq) s) @ ((k + bk)ᵀ s) (+ mask)) @ (v + bv) with s = d^-0.25, as the exports scale, no NaN guard: ``mask`` None, "causal" (a [1, 1, sq, sk] input, each row
    its own keys: a load per score element) or "pad" ([b, 1, 1, sk])."""
    from onnx import TensorProto, helper, numpy_helper
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    rng = np.random.default_rng(d)
    biases = [numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), n) for n in ("bq", "bk", "bv")]
    nodes = [helper.make_node("Add", ["q", "bq"], ["qb"]), helper.make_node("Add", ["k", "bk"], ["kb"]),
             helper.make_node("Add", ["v", "bv"], ["vb"]),     # (computed Q, K, V: the float16 pass narrows them)
             helper.make_node("Transpose", ["kb"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["qb", "s"], ["qs"]), helper.make_node("Mul", ["kt", "s"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["sc"])]
    inputs = [vi("q", f, [b, h, sq, d]), vi("k", f, [b, h, sk, d]), vi("v", f, [b, h, sk, d])]
    last = "sc"
    if mask is not None:
        nodes.append(helper.make_node("Add", ["sc", "mask"], ["m"]))
        inputs.append(vi("mask", f, [1, 1, sq, sk] if mask == "causal" else [b, 1, 1, sk]))
        last = "m"
    nodes += [helper.make_node("Softmax", [last], ["p"], axis=-1), helper.make_node("MatMul", ["p", "vb"], ["y"])]
    g = helper.make_graph(nodes, "plain", inputs, [vi("y", f, [b, h, sq, d])],
                          biases + [numpy_helper.from_array(np.array(d ** -0.25, np.float32), "s")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("case", ["causal_4warps", "nomask_d16", "pad_d128"])
def test_flash_unguarded_masks_and_warps_match_numpy(tmp_path, case):
    """The paths session 39's GPU run left out (its review): a mask per query row (causal, the unguarded rule), no
    mask, heads of 16, 4 warps a block (target_blocks=8), heads of 128 with a padding mask: against float64 numpy of
    the float16 operands, and the unfused float16 kernels."""
    from cuvil.targets.ptx.bundle import compile_bundle
    from cuvil.targets.ptx.runtime import load_bundle
    from cuvil.targets.ptx.tuning import PtxTuning
    b, h, sq, sk, d, mask, extra = {"causal_4warps": (2, 3, 100, 100, 64, "causal", {"target_blocks": 8}),
                                    "nomask_d16": (2, 2, 40, 77, 16, None, {}),
                                    "pad_d128": (2, 2, 72, 130, 128, "pad", {})}[case]
    rng = np.random.default_rng(sq + sk + d)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, h, sq, d), (b, h, sk, d), (b, h, sk, d)))
    feeds = [q, k, v]
    m = None
    if mask == "causal":
        m = np.triu(np.full((sq, sk), -np.inf, np.float32), 1)[None, None]
    elif mask == "pad":
        m = np.zeros((b, 1, 1, sk), np.float32)
        m[0, ..., sk // 2:] = -np.inf
    if m is not None:
        feeds.append(m)
    g = Pipeline.from_onnx(_plain_attention(b, h, sq, sk, d, mask)).optimize().graph
    outs = {}
    for mma in (True, False):
        path = str(tmp_path / f"m{int(mma)}")
        compile_bundle(g, path, enable_fp16=True, tuning=PtxTuning(attention_mma=mma, **extra))
        assert ("attention_mma" in _kinds(path)) == mma
        with load_bundle(path) as mod:
            outs[mma] = mod.run(*feeds)[0]
    from onnx import numpy_helper
    w = {t.name: numpy_helper.to_array(t) for t in _plain_attention(b, h, sq, sk, d, mask).graph.initializer}
    r = lambda x: np.asarray(x, np.float16).astype(np.float64)   # noqa: E731 - as the float16 graph stores them
    qb, kb, vb = r(r(q) + r(w["bq"])), r(r(k) + r(w["bk"])), r(r(v) + r(w["bv"]))
    scale = float(np.float32(d ** -0.25)) ** 2
    s = np.einsum("bhqd,bhkd->bhqk", qb, kb) * scale + (0.0 if m is None else m.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    att = np.einsum("bhqk,bhkc->bhqc", p / p.sum(-1, keepdims=True), vb)
    ref = r(att)
    bound = (np.einsum("bhqd,bhkd->bhqk", np.abs(qb), np.abs(kb)) * scale).max()
    vmax = np.abs(vb).max()
    tol = 4 * 2.0 ** -24 * (d * bound + sk + 8) * vmax + 2.0 ** -10 * (np.abs(att).max() + np.abs(ref).max())
    tol += 2.0 ** -11 * vmax             # the weights rounded to float16 before P.V
    assert np.isfinite(outs[True]).all() and np.abs(outs[True] - ref).max() <= tol
    assert np.abs(outs[True] - outs[False]).max() <= 2 * tol
