"""Random 3x3 convolutions forced through Winograd F(2x2) and F(4x4) (input transform, grouped GEMM, output
transform with a fused epilogue) agree with onnxruntime's direct convolution, with 1 and 2 threads alike, on
the host's vectors and compiled for AVX2 (x86-64-v3: 8-lane loads and tiles; a wide masked load LLVM 22
miscompiled there gave wrong outputs at 9x9, 11x11, 19x19, 27x27 maps, tests/test_winograd.py).
The tolerance is cuvil.testing.conv_models.WINOGRAD_TOL (the algorithm's measured drift, see there)."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import WINOGRAD_TOL, winograd_conv_model
from cuvil.testing.oracles import normwise_error, ort_run, random_feeds


@st.composite
def cases(draw):
    c = draw(st.integers(8, 20))
    k = draw(st.integers(4, 20))
    pads = [draw(st.integers(0, 2)) for _ in range(4)]
    h = draw(st.integers(max(1, 3 - pads[0] - pads[2]), 23))
    w = draw(st.integers(max(1, 3 - pads[1] - pads[3]), 23))
    return dict(c=c, k=k, h=h, w=w, pads=pads, bias=draw(st.booleans()), residual=draw(st.booleans()),
                batch=draw(st.integers(1, 2))), draw(st.sampled_from([2, 4])), draw(st.sampled_from([None, None, "x86-64-v3"]))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=20, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_random_winograd_convolutions_match_onnxruntime(case, seed):
    geo, tile, cpu = case
    m = winograd_conv_model(**geo)
    feeds = random_feeds(m, seed)
    want = ort_run(m, feeds)
    art = Pipeline.from_onnx(m).optimize().compile(cache=False, cpu=cpu, tuning=X86Tuning(winograd_tile=tile))
    assert any(name.startswith(f"winograd_f{tile}x{tile}") for name in art.manifest["rules_applied"])
    got1 = art.run(feeds, num_threads=1)["y"]
    got2 = art.run(feeds, num_threads=2)["y"]
    assert got1.shape == want.shape
    assert normwise_error(got1, want) < WINOGRAD_TOL
    np.testing.assert_array_equal(got1, got2)
