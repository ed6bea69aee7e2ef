"""Ops imported as their ONNX function bodies (frontend/functions.py): opset-23 Attention, RotaryEmbedding, the
loss ops, Swish/SwiGLU, against onnxruntime (or onnx.reference where onnxruntime lacks the op), at several
shapes served by one library per model (symbolic batch and sequence lengths); the ops without a body that
got kernels (CumProd, TensorScatter, Col2Im, AffineGrid) on shapes and corners their node cases do not try; the
GPU code of Attention and RotaryEmbedding checked by ptxas; the support matrix and the errors."""
import json

import numpy as np
import onnx
import onnx.helper as h
import pytest
from onnx import TensorProto as TP
from onnx.reference import ReferenceEvaluator

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError, ShapeError, UnsupportedOpError
from cuvil.frontend.functions import expandable_ops
from cuvil.frontend.onnx_import import import_model
from cuvil.onnx_backend import _freeze_inputs, backend, value_specialized_inputs
from cuvil.targets.ptx import find_ptxas

ort = pytest.importorskip("onnxruntime")

X86 = "x86_64-linux-gnu"
PTX = "nvptx64-nvidia-cuda"
PROFILE = {"B": (1, 2, 4), "S": (1, 16, 128)}


def model(nodes, inputs, outputs, opset):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(*i) for i in inputs],
                     [h.make_tensor_value_info(*o) for o in outputs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def compiled(m, profile=PROFILE):
    return Pipeline.from_onnx(m).optimize().compile(X86, opt_level=1, shape_profiles=profile)


def run(art, feeds):
    out = art.run(feeds)
    return [out[k] for k in out] if isinstance(out, dict) else list(out)


def onnxruntime_outputs(m, feeds):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def padded_mask(rng, b, q, k):
    """A bool key-padding mask (B, 1, q, k): row 0 unpadded, the others keep a random prefix of >= 1 keys."""
    lens = rng.integers(1, k + 1, b)
    lens[0] = k
    keys = np.arange(k)[None, :] < lens[:, None]
    return np.broadcast_to(keys[:, None, None, :], (b, 1, q, k)).copy()


# --- Attention ---------------------------------------------------------------------------------------------

HQ, HKV, D = 4, 2, 8


def gqa_attention(causal, opset=23):
    """3-D GQA self-attention (4 query heads on 2 key/value heads) with a bool padding mask, symbolic B and S."""
    node = h.make_node("Attention", ["Q", "K", "V", "M"], ["Y"], q_num_heads=HQ, kv_num_heads=HKV, is_causal=causal)
    return model([node], [("Q", TP.FLOAT, ["B", "S", HQ * D]), ("K", TP.FLOAT, ["B", "S", HKV * D]),
                          ("V", TP.FLOAT, ["B", "S", HKV * D]), ("M", TP.BOOL, ["B", 1, "S", "S"])],
                 [("Y", TP.FLOAT, ["B", "S", HQ * D])], opset)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_gqa_padded_bool_mask_matches_onnxruntime_at_several_lengths(causal):
    m = gqa_attention(causal)
    art = compiled(m)
    rng = np.random.default_rng(causal)
    for b, s in [(1, 1), (2, 5), (3, 17), (2, 64), (4, 128)]:
        feeds = {"Q": rng.standard_normal((b, s, HQ * D), np.float32),
                 "K": rng.standard_normal((b, s, HKV * D), np.float32),
                 "V": rng.standard_normal((b, s, HKV * D), np.float32), "M": padded_mask(rng, b, s, s)}
        want = onnxruntime_outputs(m, feeds)[0]
        got = run(art, feeds)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"B={b} S={s}")


def test_attention_imports_as_matmul_and_softmax():
    g = import_model(gqa_attention(1))
    ops = {n.op for n in g.nodes}
    assert {"MatMul", "Softmax"} <= ops and "Attention" not in ops


def test_attention_with_past_and_present_matches_onnxruntime():
    """4-D inputs, a KV cache of symbolic length P grown by S new tokens, causal with the past's offset,
    softcap and an explicit scale; present_key/present_value are outputs."""
    node = h.make_node("Attention", ["Q", "K", "V", "", "PK", "PV"], ["Y", "PKo", "PVo"], is_causal=1,
                       softcap=3.0, scale=0.2)
    kv = lambda n: (n, TP.FLOAT, ["B", HKV, "S", D])  # noqa: E731
    past = lambda n: (n, TP.FLOAT, ["B", HKV, "P", D])  # noqa: E731
    m = model([node], [("Q", TP.FLOAT, ["B", HQ, "S", D]), kv("K"), kv("V"), past("PK"), past("PV")],
              [("Y", TP.FLOAT, ["B", HQ, "S", D]), ("PKo", TP.FLOAT, None), ("PVo", TP.FLOAT, None)], 23)
    art = compiled(m, {**PROFILE, "P": (1, 16, 64)})
    rng = np.random.default_rng(3)
    for b, s, p in [(1, 1, 7), (2, 3, 1), (3, 16, 40)]:
        feeds = {"Q": rng.standard_normal((b, HQ, s, D), np.float32),
                 "K": rng.standard_normal((b, HKV, s, D), np.float32),
                 "V": rng.standard_normal((b, HKV, s, D), np.float32),
                 "PK": rng.standard_normal((b, HKV, p, D), np.float32),
                 "PV": rng.standard_normal((b, HKV, p, D), np.float32)}
        want = onnxruntime_outputs(m, feeds)
        got = run(art, feeds)
        assert [g.shape for g in got] == [w.shape for w in want]
        for k, (g_, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-5, err_msg=f"output {k}, B={b} S={s} P={p}")


def test_attention_float_mask_and_qk_output_match_onnxruntime():
    """A float additive mask and the qk_matmul_output debug output (mode 1: after the mask)."""
    node = h.make_node("Attention", ["Q", "K", "V", "M"], ["Y", "", "", "QK"], qk_matmul_output_mode=1)
    m = model([node], [("Q", TP.FLOAT, [2, HQ, 5, D]), ("K", TP.FLOAT, [2, HQ, 7, D]), ("V", TP.FLOAT, [2, HQ, 7, 6]),
                       ("M", TP.FLOAT, [5, 7])],
              [("Y", TP.FLOAT, [2, HQ, 5, 6]), ("QK", TP.FLOAT, [2, HQ, 5, 7])], 23)
    rng = np.random.default_rng(4)
    feeds = {"Q": rng.standard_normal((2, HQ, 5, D), np.float32), "K": rng.standard_normal((2, HQ, 7, D), np.float32),
             "V": rng.standard_normal((2, HQ, 7, 6), np.float32), "M": rng.standard_normal((5, 7), np.float32)}
    want = onnxruntime_outputs(m, feeds)
    got = run(compiled(m, {}), feeds)
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-5)


# --- RotaryEmbedding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved,rotary_dim", [(0, 0), (1, 0), (0, 4), (1, 4)])
def test_rotary_embedding_matches_onnxruntime(interleaved, rotary_dim):
    heads, head = 2, 8
    attrs = {"interleaved": interleaved, "num_heads": heads}
    if rotary_dim:
        attrs["rotary_embedding_dim"] = rotary_dim
    half = (rotary_dim or head) // 2
    node = h.make_node("RotaryEmbedding", ["X", "cos", "sin", "pos"], ["Y"], **attrs)
    m = model([node], [("X", TP.FLOAT, ["B", "S", heads * head]), ("cos", TP.FLOAT, [64, half]),
                       ("sin", TP.FLOAT, [64, half]), ("pos", TP.INT64, ["B", "S"])],
              [("Y", TP.FLOAT, ["B", "S", heads * head])], 23)
    art = compiled(m)
    rng = np.random.default_rng(5)
    angles = rng.uniform(0, 6, (64, half)).astype(np.float32)
    for b, s in [(1, 1), (2, 9), (3, 33)]:
        feeds = {"X": rng.standard_normal((b, s, heads * head), np.float32), "cos": np.cos(angles),
                 "sin": np.sin(angles), "pos": rng.integers(0, 64, (b, s)).astype(np.int64)}
        np.testing.assert_allclose(run(art, feeds)[0], onnxruntime_outputs(m, feeds)[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"B={b} S={s}")


# --- loss ops ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy_matches_onnxruntime(reduction, weighted):
    """Scores (N, C, d), labels with ignored entries (ignore_index = -1, a negative index), optional class
    weights; both outputs (loss and log_prob)."""
    ins = ["scores", "labels"] + (["w"] if weighted else [])
    node = h.make_node("SoftmaxCrossEntropyLoss", ins, ["loss", "log_prob"], reduction=reduction, ignore_index=-1)
    inputs = [("scores", TP.FLOAT, [3, 5, 4]), ("labels", TP.INT64, [3, 4])]
    inputs += [("w", TP.FLOAT, [5])] if weighted else []
    m = model([node], inputs, [("loss", TP.FLOAT, None), ("log_prob", TP.FLOAT, [3, 5, 4])], 13)
    rng = np.random.default_rng(6)
    labels = rng.integers(0, 5, (3, 4)).astype(np.int64)
    labels[0, 1] = labels[2, 3] = -1
    feeds = {"scores": rng.standard_normal((3, 5, 4), np.float32), "labels": labels}
    if weighted:
        feeds["w"] = rng.uniform(0.1, 2, 5).astype(np.float32)
    want = onnxruntime_outputs(m, feeds)
    got = run(compiled(m, {}), feeds)
    for g_, w in zip(got, want):
        assert g_.shape == w.shape
        np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-6)


def test_negative_log_likelihood_loss_matches_onnxruntime():
    node = h.make_node("NegativeLogLikelihoodLoss", ["x", "t", "w"], ["loss"], reduction="mean", ignore_index=2)
    m = model([node], [("x", TP.FLOAT, [4, 3, 2]), ("t", TP.INT64, [4, 2]), ("w", TP.FLOAT, [3])],
              [("loss", TP.FLOAT, [])], 22)
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((4, 3, 2), np.float32), "t": rng.integers(0, 3, (4, 2)).astype(np.int64),
             "w": rng.uniform(0.5, 1.5, 3).astype(np.float32)}
    feeds["t"][0, 0] = 0  # at least one entry not ignored
    np.testing.assert_allclose(run(compiled(m, {}), feeds)[0], onnxruntime_outputs(m, feeds)[0], rtol=1e-5)


# --- Swish / SwiGLU (newer than this onnxruntime's CPU kernels: onnx.reference) ------------------------------

def test_swish_and_swiglu_match_the_reference():
    nodes = [h.make_node("Swish", ["x"], ["s"], alpha=0.6), h.make_node("SwiGLU", ["x", "u"], ["g"], alpha=1.3)]
    m = model(nodes, [("x", TP.FLOAT, ["B", 6]), ("u", TP.FLOAT, ["B", 6])],
              [("s", TP.FLOAT, ["B", 6]), ("g", TP.FLOAT, ["B", 6])], 28)
    art = compiled(m, {"B": (1, 4, 8)})
    for b in (1, 5):
        rng = np.random.default_rng(b)
        feeds = {"x": rng.standard_normal((b, 6)).astype(np.float32) * 4, "u": rng.standard_normal((b, 6), np.float32)}
        want = ReferenceEvaluator(m).run(None, feeds)
        for g_, w in zip(run(art, feeds), want):
            np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-6)


# --- ops without a function body ---------------------------------------------------------------------------

def kernel_cases():
    """(model, feeds) of the ops that got kernels, on corners their node cases do not try."""
    rng = np.random.default_rng(8)
    return [
        (model([h.make_node("CumProd", ["x", "a"], ["y"], exclusive=1, reverse=1)],
               [("x", TP.FLOAT, [3, 0, 4]), ("a", TP.INT64, [])], [("y", TP.FLOAT, [3, 0, 4])], 26),
         {"x": np.zeros((3, 0, 4), np.float32), "a": np.array(-1, np.int64)}),
        (model([h.make_node("CumProd", ["x", "a"], ["y"])], [("x", TP.INT64, [2, 5]), ("a", TP.INT32, [])],
               [("y", TP.INT64, [2, 5])], 26),
         {"x": rng.integers(-3, 4, (2, 5)).astype(np.int64), "a": np.array(1, np.int32)}),
        (model([h.make_node("TensorScatter", ["c", "u", "w"], ["y"], mode="circular", axis=2)],
               [("c", TP.FLOAT, [2, 3, 6, 4]), ("u", TP.FLOAT, [2, 3, 4, 4]), ("w", TP.INT64, [2])],
               [("y", TP.FLOAT, [2, 3, 6, 4])], 24),
         {"c": rng.standard_normal((2, 3, 6, 4), np.float32), "u": rng.standard_normal((2, 3, 4, 4), np.float32),
          "w": np.array([4, 11], np.int64)}),
        (model([h.make_node("Col2Im", ["x", "i", "k"], ["y"], strides=[2, 1], pads=[1, 0, 0, 2], dilations=[1, 2])],
               [("x", TP.FLOAT, [2, 12, 10]), ("i", TP.INT64, [2]), ("k", TP.INT64, [2])],
               [("y", TP.FLOAT, [2, 2, 5, 5])], 18),
         {"x": rng.standard_normal((2, 12, 10), np.float32), "i": np.array([5, 5], np.int64),
          "k": np.array([3, 2], np.int64)}),
        (model([h.make_node("AffineGrid", ["t", "size"], ["g"], align_corners=1)],
               [("t", TP.FLOAT, [2, 3, 4]), ("size", TP.INT64, [5])], [("g", TP.FLOAT, [2, 1, 3, 5, 3])], 20),
         {"t": rng.standard_normal((2, 3, 4), np.float32), "size": np.array([2, 1, 1, 3, 5], np.int64)}),
    ]


def test_cumprod_tensorscatter_col2im_affinegrid_match_the_reference():
    for m, feeds in kernel_cases():
        with np.errstate(divide="ignore"):  # the reference's AffineGrid divides by zero for a 1-long axis
            want = ReferenceEvaluator(m).run(None, feeds)
        got = backend.prepare(m).run([feeds[i.name] for i in m.graph.input])
        for g_, w in zip(got, want):
            assert g_.shape == w.shape and g_.dtype == w.dtype, m.graph.node[0].op_type
            np.testing.assert_allclose(g_, w, rtol=1e-5, atol=1e-6, err_msg=m.graph.node[0].op_type)


def test_col2im_with_the_wrong_block_count_is_a_shape_error():
    m = model([h.make_node("Col2Im", ["x", "i", "k"], ["y"], strides=[2, 1])],
              [("x", TP.FLOAT, [1, 6, 11])], [("y", TP.FLOAT, None)], 18)
    m.graph.initializer.extend([onnx.numpy_helper.from_array(np.array([5, 5], np.int64), "i"),
                                onnx.numpy_helper.from_array(np.array([3, 2], np.int64), "k")])
    with pytest.raises(ShapeError, match=r"Col2Im.*block positions"):
        import_model(m)


# --- GPU code ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit): PTX cannot be assembled here")
def test_attention_and_rotary_embedding_ptx_assembles(tmp_path):
    rope = h.make_node("RotaryEmbedding", ["X", "cos", "sin", "pos"], ["Y"], num_heads=2, interleaved=1)
    rope_model = model([rope], [("X", TP.FLOAT, ["B", "S", 16]), ("cos", TP.FLOAT, [64, 4]), ("sin", TP.FLOAT, [64, 4]),
                                ("pos", TP.INT64, ["B", "S"])], [("Y", TP.FLOAT, ["B", "S", 16])], 23)
    for m in (gqa_attention(1), rope_model):
        bundle = Pipeline.from_onnx(m).optimize().compile(PTX, arch="sm_90", cache=False, shape_profiles=PROFILE)
        out = tmp_path / f"{m.graph.node[0].op_type}.cuvil"
        bundle.save(str(out))
        cubins = list(out.rglob("*.cubin"))   # a profile bundle keeps one folder per shape bucket
        assert cubins and cubins[0].stat().st_size > 0, m.graph.node[0].op_type


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit): PTX cannot be assembled here")
def test_new_kernels_ptx_assembles(tmp_path):
    """CumProd, TensorScatter (circular: an integer modulo), Col2Im, AffineGrid through the shared lowering."""
    for k, (m, feeds) in enumerate(kernel_cases()):
        frozen = _freeze_inputs(m, {n: feeds[n] for n in value_specialized_inputs(m)})
        out = tmp_path / f"k{k}.cuvil"
        Pipeline.from_onnx(frozen).optimize().compile(PTX, arch="sm_90", cache=False).save(str(out))
        assert list(out.glob("*.cubin")), m.graph.node[0].op_type


# --- support matrix and errors -----------------------------------------------------------------------------

def test_cuvil_ops_lists_the_ops_imported_as_function_bodies(capsys):
    assert cli_main(["ops", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expanded = out["onnx_function_bodies"]
    for op in ("Attention", "RotaryEmbedding", "Swish", "SwiGLU", "SoftmaxCrossEntropyLoss",
               "NegativeLogLikelihoodLoss", "CenterCropPad"):
        assert op in expanded and op not in out["onnx_not_covered"], op
    assert not set(expanded) & {r["op"] for r in out["ops"]}, "a registered op is never expanded"
    assert "AffineGrid" in {r["op"] for r in out["ops"]}
    assert set(expanded) <= set(expandable_ops(onnx.defs.onnx_opset_version()))


def test_an_op_without_function_body_is_one_clean_error():
    node = h.make_node("StringNormalizer", ["x"], ["y"])
    m = model([node], [("x", TP.STRING, [2])], [("y", TP.STRING, [2])], 20)
    with pytest.raises(UnsupportedOpError, match=r"StringNormalizer.*opset 20"):
        import_model(m)


def test_a_body_onnx_cannot_build_is_one_clean_error():
    """RotaryEmbedding on a 3-D input without num_heads: onnx's builder refuses the node."""
    node = h.make_node("RotaryEmbedding", ["X", "cos", "sin"], ["Y"])
    m = model([node], [("X", TP.FLOAT, [1, 3, 8]), ("cos", TP.FLOAT, [1, 3, 4]), ("sin", TP.FLOAT, [1, 3, 4])],
              [("Y", TP.FLOAT, [1, 3, 8])], 23)
    with pytest.raises(CuvilError, match=r"function body of RotaryEmbedding node 'Y' \(opset 23\)"):
        import_model(m)


def test_flexattention_of_the_preview_domain_imports_as_its_body():
    """ai.onnx.preview's FlexAttention (a score_mod subgraph inlined by onnx's builder) matches the reference."""
    score_mod = h.make_graph([h.make_node("Mul", ["s", "k"], ["o"])], "score_mod",
                             [h.make_tensor_value_info("s", TP.FLOAT, ["B", "H", "L", "S"])],
                             [h.make_tensor_value_info("o", TP.FLOAT, ["B", "H", "L", "S"])],
                             [onnx.numpy_helper.from_array(np.array(0.5, np.float32), "k")])
    node = h.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview", score_mod=score_mod)
    g = h.make_graph([node], "m", [h.make_tensor_value_info(n, TP.FLOAT, [1, 2, 3, 4]) for n in "QKV"],
                     [h.make_tensor_value_info("Y", TP.FLOAT, [1, 2, 3, 4])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 26), h.make_opsetid("ai.onnx.preview", 1)])
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for n in "QKV"}
    np.testing.assert_allclose(run(compiled(m, {}), feeds)[0], ReferenceEvaluator(m).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)


def test_a_registered_op_with_a_function_body_keeps_its_own_kernel():
    """LayerNormalization and Gelu have ONNX function bodies too; Cuvil registers them, so they stay one node."""
    nodes = [h.make_node("LayerNormalization", ["x", "s"], ["y"]), h.make_node("Gelu", ["y"], ["z"])]
    m = model(nodes, [("x", TP.FLOAT, [2, 4]), ("s", TP.FLOAT, [4])], [("z", TP.FLOAT, [2, 4])], 20)
    assert [n.op for n in import_model(m).nodes] == ["LayerNormalization", "Gelu"]


def test_rotary_embedding_4d_without_position_ids_matches_onnxruntime():
    """(B, heads, S, head) input, cos/sin caches given per batch and position (no position_ids)."""
    node = h.make_node("RotaryEmbedding", ["X", "cos", "sin"], ["Y"], rotary_embedding_dim=6)
    m = model([node], [("X", TP.FLOAT, ["B", 3, "S", 10]), ("cos", TP.FLOAT, ["B", "S", 3]),
                       ("sin", TP.FLOAT, ["B", "S", 3])], [("Y", TP.FLOAT, ["B", 3, "S", 10])], 23)
    art = compiled(m)
    rng = np.random.default_rng(10)
    for b, s in [(1, 1), (2, 7), (4, 20)]:
        angles = rng.uniform(0, 6, (b, s, 3)).astype(np.float32)
        feeds = {"X": rng.standard_normal((b, 3, s, 10), np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}
        np.testing.assert_allclose(run(art, feeds)[0], onnxruntime_outputs(m, feeds)[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"B={b} S={s}")
