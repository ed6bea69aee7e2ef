"""Random 1x1 and 3x3 convolutions on small maps with reductions from CHANNEL_FLOOR_K (16) to 300 (where the x86
lowering takes channel-lane register tiles, 32 x 7 / 48 x 7 / 64 x 6 / 32 x 8: from K = 128 since session 35,
weighed against position lanes from K = 16 since session 36; e.g. 200 -> 32 channels at 4x4 takes 32 x 8, 20 -> 48
at 7x7 3x3 takes 48 x 7, 40 -> 64 at 7x7 1x1 32 x 7) agree with onnxruntime, with every epilogue kind, whatever the
thread count. The general fuzz (test_conv_gemm_property.py) rarely reaches these with 24+ output channels."""
import os
import sys

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_x86_bf16 import HAS_BF16, bf16_steps, check_rounded_conv, narrowed  # noqa: E402

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
from cuvil.testing.conv_models import conv_epilogue_model  # noqa: E402


@st.composite
def cases(draw):
    k = draw(st.sampled_from([1, 3]))
    cin = draw(st.integers(16, 300)) if k == 1 else draw(st.integers(2, 40))    # K = cin * k * k >= 16
    m = draw(st.integers(24, 100))
    h, w = draw(st.integers(2, 9)), draw(st.integers(2, 9))                       # 4 .. 81 positions
    pads = [k // 2] * 4
    epilogue = draw(st.sampled_from([None, "relu", "residual", "sigmoid"]))
    return (1, cin, h, w), (m, cin, k, k), dict(pads=pads, epilogue=epilogue)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=16, deadline=None)
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


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=10, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_bf16_channel_lanes_match_the_rounded_reference(case, seed):
    """The same geometries narrowed to bf16 on the vdpbf16ps kernels (their weights in K pairs: odd reductions
    pad the last pair) agree with a float64 convolution of the bfloat16-rounded operands within float32
    summation error, and do not depend on the thread count."""
    if not HAS_BF16:
        pytest.skip(f"no AVX512_BF16 on this CPU ({cpu_label()}): the bf16 kernels cannot run here")
    xs, ws, attrs = case
    model = conv_epilogue_model(xs, ws, seed=seed, pads=attrs["pads"], epilogue=None)
    art = narrowed(model, opt_level=2, winograd=False)
    assert bf16_steps(art), art.manifest["steps"]
    check_rounded_conv(model, art, xs, ws, seed, pads=attrs["pads"])
