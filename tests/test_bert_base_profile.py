"""BERT at BERT-base width (hidden 768, 12 heads of 64, ffn 3072; 2 of its 12 layers, a small vocabulary) as
ONE x86 library for its whole profile (batch 1..8, sequence 1..512), against onnxruntime at several (B, S):
S = 1, partial register tiles (S not a multiple of the MatMul tile's rows), the opt point (B = 1, S = 128),
long sequences,
and padded attention masks (right padding, as tokenizers pad BERT's batches; B = 1 padded too). These are
the kernels the issue-20 benchmark times (bench/transformer_section.py), at the shapes users send: the small
configs of test_hf_models.py keep every product inside one panel and every head under 16 wide."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.testing.hf_models import BERT_PROFILE, bert_model, text_feeds

pytest.importorskip("onnxruntime")
from cuvil.testing.oracles import max_rel_error, ort_session  # noqa: E402

RTOL = 1e-4
# (batch, sequence, real tokens per row or None for all): row r keeps keep[r % len(keep)] tokens
POINTS = [
    (1, 1, None),              # one token
    (1, 32, (20,)),            # B = 1, padded
    (1, 128, (100,)),          # the opt point (its specialised kernels), padded
    (2, 128, (128, 77)),       # the generic kernels at S = 128, the second row padded
    (3, 9, (9, 1, 5)),         # partial tiles, a row of one real token
    (8, 33, (33, 16, 1, 30)),  # the largest batch
    (1, 384, None),            # a benchmark point
    (1, 512, (300,)),          # the longest sequence, padded
]


@pytest.fixture(scope="module")
def bert():
    model = bert_model(vocab=1000, layers=2)
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(shape_profiles={k: v for k, v in BERT_PROFILE.items() if k in p.graph.symbols})
    return model, art


def test_profile_is_one_library_with_fused_attention(bert):
    _, art = bert
    steps = art.manifest["steps"]
    assert any(st.get("op") == "FusedAttention" for st in steps), "attention was not fused"
    assert {st.get("variant") for st in steps} <= {"generic", "opt"}
    assert sum(st["kernel"] == "gemm" and st.get("variant") == "generic" for st in steps) >= 2 * 6


@pytest.mark.parametrize("batch,seq,keep", POINTS)
def test_bert_base_width_matches_onnxruntime(bert, batch, seq, keep):
    model, art = bert
    f = text_feeds(model, batch, seq)
    if keep is not None:
        for r in range(batch):
            f["attention_mask"][r, keep[r % len(keep)]:] = 0
    want = ort_session(model).run(None, f)
    got = art.run(f)
    for o, w in zip(model.graph.output, want):
        assert got[o.name].shape == w.shape, o.name
        err = max_rel_error(got[o.name], w)
        print(f"B={batch} S={seq} keep={keep}: {o.name} {err:.1e}")
        assert err <= RTOL, (o.name, batch, seq, err)
