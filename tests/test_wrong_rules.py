"""The crafted wrong rules (tests/rules/wrong/<family>.rule, each with a comment saying what is wrong):
none may be proved; each must be refuted, or bounded and off by default. bench/wrong_rules.py prints the
same run as a table (bench/WRONG_RULES.md)."""
import os

import pytest

from cuvil.dsl.parser import load_rules
from cuvil.rewrite_rules.prove import prove_rule

WRONG = os.path.join(os.path.dirname(__file__), "rules", "wrong")
FAMILIES = ["activation", "algebra", "fold", "inference", "kernel", "layout", "pool", "winograd"]


def test_at_least_100_wrong_rules_of_every_family():
    files = sorted(f[:-5] for f in os.listdir(WRONG) if f.endswith(".rule"))
    assert files == FAMILIES
    rules = load_rules(WRONG)
    assert len(rules) >= 100
    assert {r.on for r in rules} == {"graph", "kernel", "x86"}


@pytest.mark.parametrize("rule", load_rules(WRONG), ids=lambda r: r.name)
def test_no_wrong_rule_may_run(rule):
    v = prove_rule(rule)
    assert v.status != "proved"
    assert v.status == "refuted" or (v.status == "bounded" and not v.on_by_default), (v.status, v.shapes, v.detail)
    if v.status == "refuted":
        assert v.counterexample


@pytest.mark.parametrize("name,needle", [
    ("w_conv_pads_reorder", "x=[1,1,8,6] d=3 l=2 r=1 t=0"),  # asymmetric pads, every one independent
    ("w_reduce_sum_reversed", "x=["),
    ("w_slice_off_by_one", "e="),
])
def test_the_issues_wrong_rules_are_refuted_with_a_counterexample(name, needle):
    """The issue's three: Conv pads reordered, a reverse-order exact sum behind a harmless guard, a Slice
    guard off by one. The counterexample names the shapes, the attributes and the differing element."""
    rule = next(r for r in load_rules(WRONG) if r.name == name)
    v = prove_rule(rule)
    assert v.status == "refuted"
    assert needle in v.counterexample and "lhs[" in v.counterexample and "rhs[" in v.counterexample
