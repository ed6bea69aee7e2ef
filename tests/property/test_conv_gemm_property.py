"""Random convolution geometries through the native GEMM micro-kernels and depthwise row kernels agree with onnxruntime, and the
result does not depend on the number of threads, on the host's vectors and compiled for AVX2 (x86-64-v3: the
8-lane micro-kernels and packing a portable library runs)."""
import numpy as np
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.testing.conv_models import conv_epilogue_model


@st.composite
def conv_cases(draw):
    spatial = draw(st.sampled_from([1, 2, 2, 2, 3]))
    if spatial == 2 and draw(st.booleans()):   # depthwise (the row kernels)
        group = cin = m = draw(st.integers(1, 9))
    else:                                       # GEMM micro-kernels
        group = draw(st.sampled_from([1, 1, 1, 2, 3]))
        cin = group * draw(st.integers(1, 6))
        m = group * draw(st.integers(4, 14))
    kern = [draw(st.integers(1, 3 if spatial == 3 else 4)) for _ in range(spatial)]
    strides = [draw(st.integers(1, 3)) for _ in range(spatial)]
    dil = [draw(st.integers(1, 2)) for _ in range(spatial)]
    pads = [draw(st.integers(0, k - 1)) for k in kern] + [draw(st.integers(0, k - 1)) for k in kern]
    size = [draw(st.integers((k - 1) * d + 1, 9 if spatial == 3 else 20)) for k, d in zip(kern, dil)]
    n = draw(st.integers(1, 2))
    epilogue = draw(st.sampled_from(["relu", None, "residual"]))
    bias = draw(st.booleans())
    return (n, cin) + tuple(size), (m, cin // group) + tuple(kern), dict(
        strides=strides, pads=pads, dilations=dil, group=group, bias=bias, epilogue=epilogue), \
        draw(st.sampled_from([None, None, "x86-64-v3"]))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=25)
@given(case=conv_cases(), seed=st.integers(0, 2**16))
def test_random_convolutions_match_onnxruntime(case, seed):
    xs, ws, attrs, cpu = case
    model = conv_epilogue_model(xs, ws, seed=seed, **attrs)
    x = np.random.default_rng(seed).standard_normal(xs).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    art = Pipeline.from_onnx(model).optimize().compile(opt_level=2, cpu=cpu)
    m = art.model()
    y1, y2 = m.run(x, num_threads=1)[0], m.run(x, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    assert y1.shape == want.shape
    scale = max(float(np.abs(want).max()), 1.0)
    assert float(np.abs(y1 - want).max()) <= 1e-4 * scale
