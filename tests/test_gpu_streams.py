"""A bundle's CUDA graph captured over several streams (``load_bundle(..., streams=N)``,
:mod:`cuvil.targets.ptx.launch_deps`) on a GPU: the same bits as the launch order on one stream and as eager
launches, call after call with changing inputs (a missing dependency would be a race: outputs that differ now
and then), for BERT (float32 and float16: the Q, K and V products at once; a padded mask) and an Inception block's
branches. The structure without a GPU: test_ptx_launch_deps.py."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.testing import light_model
from cuvil.testing.hf_models import bert_model, text_feeds
from cuvil.testing.requires import needs_gpu

pytestmark = needs_gpu

TARGET = "nvptx64-nvidia-cuda"


def _feeds(model, rng, b, s):
    f = text_feeds(model, b, s, seed=int(rng.integers(1 << 30)))
    f["input_ids"] = rng.integers(0, 100, f["input_ids"].shape).astype(np.int64)
    f["attention_mask"][0, s - s // 3:] = 0              # padding
    return f


@pytest.mark.parametrize("fp16", [False, True])
def test_bert_over_streams_is_the_launch_order_bit_for_bit(tmp_path, fp16):
    from cuvil.targets.ptx.runtime import load_bundle
    model = bert_model(vocab=101, hidden=128, layers=2, heads=2, ffn=256, max_pos=256)
    b = Pipeline.from_onnx(model).optimize().compile(TARGET, cache=False, fixed={"batch": 2, "sequence": 96},
                                                      enable_fp16=fp16)
    b.save(str(tmp_path / "m.cuvil"))
    assert b.manifest["launch_graph"]["widest_level"] >= 3
    many, one = load_bundle(str(tmp_path / "m.cuvil"), streams=4), load_bundle(str(tmp_path / "m.cuvil"), streams=1)
    try:
        rng = np.random.default_rng(0)
        for _ in range(12):
            f = _feeds(model, rng, 2, 96)
            a, c = many.run(f), one.run(f)
            e = many.run(f, mode="eager")
            for k in a:
                assert np.array_equal(a[k], c[k]) and np.array_equal(a[k], e[k]), k
    finally:
        many.close()
        one.close()


def test_inception_branches_over_streams_are_the_launch_order(tmp_path):
    from cuvil.targets.ptx.runtime import load_bundle
    b = Pipeline.from_onnx(light_model("inception_v1")).optimize().compile(TARGET, cache=False)
    b.save(str(tmp_path / "m.cuvil"))
    many, one = load_bundle(str(tmp_path / "m.cuvil"), streams=4), load_bundle(str(tmp_path / "m.cuvil"), streams=1)
    try:
        rng = np.random.default_rng(1)
        for _ in range(6):
            x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
            (a,), (c,) = many.run(x), one.run(x)
            assert np.array_equal(a, c)
    finally:
        many.close()
        one.close()
