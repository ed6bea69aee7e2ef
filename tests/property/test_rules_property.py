"""One property test per built-in rule: its pattern, instantiated at random shapes and values, computes
the same after the rewrite (bit for bit for exact rules, within cuvil.testing.rules.REAL_RTOL for real)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil.rewrite_rules.verdicts import builtin_rules
from cuvil.testing.rules import check_rule_case, rule_cases

# graph rules rewrite models; `on kernel` rules rewrite kernel expressions (tests/test_kernel_rules.py)
RULES = [r for r in builtin_rules() if r.on == "graph"]


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_rule_preserves_meaning(rule, data):
    model, feeds = data.draw(rule_cases(rule))
    report = check_rule_case(rule, model, feeds)
    assert report.applied[rule.name] >= 1, f"{rule.name} did not fire on its own pattern"
