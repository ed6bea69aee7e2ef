"""The one-row product kernel on a GPU (``PtxTuning.gemv`` / ``PtxOptions.gemv``, :mod:`cuvil.targets.ptx.gemv`):
against numpy in float64 and against the lane-split kernel it replaces, with odd K and N (the scalar tail, the
clamped columns of the last block) and aligned ones (16-byte loads), the same bits run to run; and a small GPT-2
decode step with it against onnxruntime. The structure without a GPU: test_ptx_gemv.py."""
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.testing.hf_models import gpt2_decode_model, text_feeds
from cuvil.testing.ptx_bundles import run_ptx_bundle
from cuvil.testing.requires import needs_gpu

from test_ptx_gemv import batched_product, row_product

pytestmark = needs_gpu


@pytest.mark.parametrize("k,n", [(769, 771), (768, 2304), (3072, 768), (5, 3), (33, 50257)])
def test_row_product_matches_numpy_and_the_split_kernel(tmp_path, k, n):
    from onnx import numpy_helper
    model = row_product(k, n, seed=k + n)
    w, b = (numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer)
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    ref = np.tanh(x.astype(np.float64) @ w + b)
    y = run_ptx_bundle(model, [x], tmp_path / "gemv", gemv=True)
    y2 = run_ptx_bundle(model, [x], tmp_path / "gemv2", gemv=True)
    old = run_ptx_bundle(model, [x], tmp_path / "split")
    assert y.shape == (1, n)
    # any float32 summation order: |error| <= k * 2^-24 * sum |x w| (+ the bias add; tanh does not grow it)
    tol = (k + 1) * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w) + np.abs(b)).max() + 1e-6
    assert np.abs(y - ref).max() <= tol
    assert np.abs(y - old).max() <= 2 * tol
    assert np.array_equal(y, y2)           # fixed summation order: the same bits every run


@pytest.mark.parametrize("h,k,n", [(12, 1024, 64), (5, 129, 67)])
def test_product_per_row_matches_numpy(tmp_path, h, k, n):
    from onnx import numpy_helper
    model = batched_product(h, k, n, seed=h + k + n)
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((h, 1, k)).astype(np.float32)
    ref = x.astype(np.float64) @ w
    y = run_ptx_bundle(model, [x], tmp_path / "gemv", gemv=True)
    old = run_ptx_bundle(model, [x], tmp_path / "split")
    tol = k * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w)).max() + 1e-6
    assert y.shape == (h, 1, n)
    assert np.abs(y - ref).max() <= tol and np.abs(y - old).max() <= 2 * tol


@pytest.mark.parametrize("fp16", [False, True])
def test_decode_step_matches_onnxruntime(fp16):
    """A small GPT-2 decode step (odd ffn 387, vocabulary 1,001) with and without gemv, against onnxruntime."""
    import onnxruntime as ort
    from cuvil.targets.ptx.runtime import load_bundle
    m = gpt2_decode_model(vocab=1001, hidden=96, layers=2, heads=4, ffn=387, max_pos=64)
    feeds = text_feeds(m, 1, 7)
    names = [vi.name for vi in m.graph.input]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    p = Pipeline.from_onnx(m).optimize()
    outs = {}
    for gemv in (False, True):
        b = p.compile("nvptx64-nvidia-cuda", cache=False, fixed={"batch": 1, "past_sequence": 7,
                                                                 "total_sequence": 8}, gemv=gemv, enable_fp16=fp16)
        with load_bundle(b.path) as mod:
            outs[gemv] = mod.run(*[feeds[n] for n in names])
    tol = 3e-3 if fp16 else 2e-5
    for y_new, y_old, r in zip(outs[True], outs[False], ref):
        scale = max(np.abs(r).max(), 1e-30)
        assert np.abs(y_new - r).max() / scale <= tol
        assert np.abs(y_new - y_old).max() / scale <= tol
