"""Random 1x1 and 3x3 convolutions on small maps with long reductions (K >= 128: where the x86 lowering takes
channel-lane register tiles, 32 x 7 / 48 x 7 / 64 x 6 / 32 x 8, since session 35; e.g. 200 -> 32 channels at 4x4
takes 32 x 8, 20 -> 48 at 7x7 3x3 takes 48 x 7) agree with onnxruntime, with every epilogue kind, whatever the
thread count. The general fuzz (test_conv_gemm_property.py) rarely reaches K >= 128 with 24+ output channels."""
import numpy as np
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.testing.conv_models import conv_epilogue_model


@st.composite
def cases(draw):
    k = draw(st.sampled_from([1, 3]))
    cin = draw(st.integers(128, 300)) if k == 1 else draw(st.integers(15, 40))    # K = cin * k * k >= 128
    m = draw(st.integers(24, 100))
    h, w = draw(st.integers(2, 9)), draw(st.integers(2, 9))                       # 4 .. 81 positions
    pads = [k // 2] * 4
    epilogue = draw(st.sampled_from([None, "relu", "residual", "sigmoid"]))
    return (1, cin, h, w), (m, cin, k, k), dict(pads=pads, epilogue=epilogue)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=12, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_long_reductions_on_small_maps_match_onnxruntime(case, seed):
    xs, ws, attrs = case
    model = conv_epilogue_model(xs, ws, seed=seed, **attrs)
    x = np.random.default_rng(seed).standard_normal(xs).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=2, winograd=False)
    mod = art.model()
    y1, y2 = mod.run(x, num_threads=1)[0], mod.run(x, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(y1 - want).max()) <= 1e-4 * scale
