"""Random sums of two 1x1 bf16 convolutions (rules/conv_sum.rule, one AMX convolution over both inputs' channels,
each piece read where it lies) agree with a float64 sum of the bfloat16-rounded operands within float32
summation error, on 1 and 2 threads: channel counts of one to four 32-channel steps a piece, output channels off
the 32-channel blocks, strides 1 and 2, Add and Sum in either order, a first piece stored channels-last by its
producer or copied from a graph input, batch 1 and 2. Runs only on a CPU with AMX-BF16."""
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_conv_sum import HAS_AMX, applied, block, check_sum, narrowed  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16 on this CPU: the AMX kernels cannot run here")


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=12, deadline=None)
@given(cx=st.sampled_from([32, 64, 96]), cy=st.sampled_from([32, 64, 128]), m=st.integers(16, 80),
       hw=st.integers(6, 12), s=st.sampled_from([1, 2]), op=st.sampled_from(["Add", "Sum"]), first=st.booleans(),
       produced=st.booleans(), n=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_random_sums_of_two_convolutions(cx, cy, m, hw, s, op, first, produced, n, seed):
    model, w = block(cx, cy, m, hw, s, op, first, produced, batch=n)
    art = narrowed(model)
    assert len(applied(art)) == 1, art.manifest.get("rules_applied")
    assert not art.manifest["memory_safety"]["guarded"]
    check_sum(art.model(), w, cx, cy, hw, s, produced, n=n, seed=seed)
