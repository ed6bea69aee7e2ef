"""cuvil.testing.hf_models: BERT and the GPT-2 decode step built without torch (the benchmark's models when no
export is given) compile as ONE library for their profiles and match onnxruntime at several shapes; the
decode step's past length is a symbol (1..1023), the attention mask's length follows it."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.testing.hf_models import (BERT_PROFILE, GPT2_DECODE_PROFILE, bert_model, gpt2_decode_model,
                                     text_feeds)

ort = pytest.importorskip("onnxruntime")
from cuvil.testing.oracles import max_rel_error, ort_session  # noqa: E402

SMALL = dict(vocab=512, hidden=32, layers=2, heads=4, ffn=64)


@pytest.mark.parametrize("build,profile,points", [
    (bert_model, BERT_PROFILE, [(1, 5), (3, 33), (2, 512)]),
    (gpt2_decode_model, GPT2_DECODE_PROFILE, [(1, 1), (3, 200), (1, 1023)]),
])
def test_one_library_matches_onnxruntime(build, profile, points):
    model = build(**SMALL)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles=profile)
    sess = ort_session(model)
    for b, s in points:
        f = text_feeds(model, b, s)
        if "attention_mask" in f and b > 1:
            f["attention_mask"][1, : s // 2] = 0          # a padded row (left padding, as generation has it)
            f["attention_mask"][1, -1] = 1
        want = sess.run(None, f)
        got = art.run(f)
        for o, w in zip(model.graph.output, want):
            assert got[o.name].shape == w.shape
            assert max_rel_error(got[o.name], w) <= 1e-4, (o.name, b, s)


def test_decode_step_outputs():
    m = gpt2_decode_model(**SMALL)
    names = [o.name for o in m.graph.output]
    assert names[0] == "logits" and names[1:3] == ["present.0.key", "present.0.value"] and len(names) == 5
    f = text_feeds(m, 1, 7)
    out = ort_session(m).run(None, f)
    assert out[0].shape == (1, 1, 512) and out[1].shape == (1, 4, 8, 8)
    np.testing.assert_array_equal(out[1][:, :, :7], f["past_key_values.0.key"])   # the past, then the new token
