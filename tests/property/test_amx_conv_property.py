"""Random convolution geometries narrowed to bf16 on AMX tiles (the packed-panel kernel with its step-major
weights, the pair-plane kernel with its streamed weight tiles, and the channels-last kernel over its phase
planes' rows, the default where it applies) agree with a float64 convolution of the bfloat16-rounded operands
within float32 summation error, and do not depend on the number of threads. Channel counts that are not
multiples of 32 (the zero-padded tile steps and weight blocks), groups, strides, dilations and pads are drawn on
purpose. Runs only on a CPU with AMX-BF16."""
import os
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_x86_amx import HAS_AMX, bf16_steps, narrowed  # noqa: E402
from test_x86_bf16 import check_rounded_conv  # noqa: E402

from cuvil.kernels.lower.conv import PLANE_MIN_POSITIONS  # noqa: E402
from cuvil.testing.conv_models import conv_epilogue_model  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 on this CPU: the AMX kernels cannot run here")


@st.composite
def conv_cases(draw):
    group = draw(st.sampled_from([1, 1, 1, 2, 3]))
    # per group: off the 32-channel blocks (padded tile steps), or filling them (the pair-plane kernel takes
    # ungrouped 3x3 / strided windows whose channels waste at most a quarter of their blocks)
    cin = group * draw(st.sampled_from([3, 17, 30, 32, 45, 64, draw(st.integers(3, 70))]))
    m = group * draw(st.integers(4, 45))
    kern = [draw(st.integers(1, 3)) for _ in range(2)]
    strides = [draw(st.integers(1, 2)) for _ in range(2)]
    dil = [draw(st.integers(1, 2)) for _ in range(2)]
    pads = [draw(st.integers(0, k - 1)) for k in kern] * 2
    size = [draw(st.integers(max(8, (k - 1) * d + 1), 20)) for k, d in zip(kern, dil)]
    return (draw(st.integers(1, 2)), cin) + tuple(size), (m, cin // group) + tuple(kern), dict(
        strides=strides, pads=pads, dilations=dil, group=group)


@st.composite
def plane_cases(draw):
    """Ungrouped windows the pair-plane kernel takes: a 3x3 (any stride, dilation, pads) or a strided 1x1, at
    least PLANE_MIN_POSITIONS (64) output positions, channels filling their blocks of 32 to at least four
    fifths."""
    cin = draw(st.sampled_from([26, 30, 32, 52, 60, 64]))
    m = draw(st.integers(4, 70))
    kern = draw(st.sampled_from([[3, 3], [3, 3], [1, 1]]))
    strides = [2, 2] if kern == [1, 1] else [draw(st.integers(1, 2)) for _ in range(2)]
    dil = [1, 1] if kern == [1, 1] else [draw(st.integers(1, 2)) for _ in range(2)]
    pads = [draw(st.integers(0, k - 1)) for k in kern] * 2
    size = [draw(st.integers(17, 24)) for _ in range(2)]
    out = [(s + 2 * p - (k - 1) * d - 1) // t + 1 for s, p, k, d, t in zip(size, pads, kern, dil, strides)]
    assume(out[0] * out[1] >= PLANE_MIN_POSITIONS)      # (smaller maps keep the packed panels)
    return (draw(st.integers(1, 2)), cin) + tuple(size), (m, cin) + tuple(kern), dict(
        strides=strides, pads=pads, dilations=dil, group=1)


def check(case, seed, kernel=None, channels_last=True):
    xs, ws, attrs = case
    model = conv_epilogue_model(xs, ws, epilogue=None, seed=seed, **attrs)
    art = narrowed(model, channels_last=channels_last)
    steps = bf16_steps(art)
    if not steps:
        return                                   # the policy kept it float32
    assert all(s.get("path") == "amx_bf16" for s in steps), art.manifest["steps"]
    if kernel is not None:
        assert kernel in [s["kernel"] for s in steps], art.manifest["steps"]
    check_rounded_conv(model, art, xs, ws, seed, attrs["strides"], attrs["pads"], attrs["dilations"], attrs["group"])


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=20, deadline=None)
@given(case=conv_cases(), seed=st.integers(0, 2**16))
def test_random_amx_convolutions_match_the_rounded_reference(case, seed):
    check(case, seed)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=12, deadline=None)
@given(case=plane_cases(), seed=st.integers(0, 2**16))
def test_random_pair_plane_convolutions_match_the_rounded_reference(case, seed):
    check(case, seed, kernel="bf16_planes_amx", channels_last=False)


@st.composite
def channels_last_cases(draw):
    """Ungrouped 2-D windows the channels-last kernel takes: any kernel up to 3x3, stride, dilation and pads, at
    least one unit of 32 wide positions, channels using at least two thirds of their blocks of 32, output
    channels past whole blocks."""
    cin = draw(st.sampled_from([22, 30, 32, 45, 64, 96]))
    m = draw(st.integers(16, 70))
    kern = [draw(st.integers(1, 3)) for _ in range(2)]
    strides = [draw(st.integers(1, 2)) for _ in range(2)]
    dil = [draw(st.integers(1, 2)) for _ in range(2)]
    pads = [draw(st.integers(0, k - 1)) for k in kern] + [draw(st.integers(0, k - 1)) for k in kern]
    size = [draw(st.integers(max(6, (k - 1) * d + 1), 20)) for k, d in zip(kern, dil)]
    out = [(s + p0 + p1 - (k - 1) * d - 1) // t + 1
           for s, p0, p1, k, d, t in zip(size, pads[:2], pads[2:], kern, dil, strides)]
    wq = out[1] + ((kern[1] - 1) * dil[1]) // strides[1]
    assume((out[0] - 1) * wq + out[1] >= 32)            # (fewer wide positions keep the other forms)
    return (draw(st.integers(1, 2)), cin) + tuple(size), (m, cin) + tuple(kern), dict(
        strides=strides, pads=pads, dilations=dil, group=1)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=16, deadline=None)
@given(case=channels_last_cases(), seed=st.integers(0, 2**16))
def test_random_channels_last_convolutions_match_the_rounded_reference(case, seed):
    check(case, seed, kernel="bf16_nhwc_amx")
