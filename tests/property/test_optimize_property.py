"""Random valid graphs from the op registry: the optimized model agrees with the original through
onnx.reference, bit for bit when only exact rules fired, within a tolerance when real ones did."""
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.rewrite_rules.verdicts import builtin_rules
from cuvil.testing import strategies as cst
from cuvil.testing.rules import REAL_RTOL

OBLIGATION = {r.name: r.proof for r in builtin_rules()}


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=cst.graphs(), data=st.data())
def test_optimized_graph_agrees_with_original(model, data):
    src = Pipeline.from_onnx(model)
    opt = src.optimize()
    fired = {name for name, k in opt.report.applied.items() if k}
    exact = all(OBLIGATION[name] == "exact" for name in fired)
    feeds = data.draw(cst.inputs_for(src, special=exact))
    want = src.run_reference(feeds)["y"]
    got = opt.run_reference(feeds)["y"]
    assert got.shape == want.shape
    if exact:
        np.testing.assert_array_equal(got, want)  # NaN positions must agree too
    else:
        finite = np.isfinite(want)
        assume(finite.any())
        scale = max(float(np.max(np.abs(want[finite]))), 1.0)
        assert np.all(np.abs(got[finite] - want[finite]) <= REAL_RTOL * scale), fired
