"""Every `rule` block in docs/rules.md parses, and proves or is refuted as its first line says (the `sh` and
`python` blocks of every page run in tests/test_newcomer.py)."""
import os
import re

import pytest

from cuvil.dsl.parser import parse_rules
from cuvil.rewrite_rules.prove import prove_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(path, lang):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


RULE_BLOCKS = blocks("docs/rules.md", "rule")


def test_docs_have_rule_examples():
    assert len(RULE_BLOCKS) >= 6


@pytest.mark.parametrize("src", RULE_BLOCKS, ids=[re.search(r"rule (\w+)", b).group(1) for b in RULE_BLOCKS])
def test_rule_example(src):
    expect = re.match(r"# expect: (\w+)", src).group(1)
    (rule,) = parse_rules(src, "docs/rules.md")
    v = prove_rule(rule)
    # a generic proof supersedes a bounded check: an example documented as bounded may be proved
    assert v.status == expect or (expect, v.status) == ("bounded", "proved"), (v.status, v.counterexample, v.detail)
    if expect == "refuted":
        assert v.counterexample


def test_add_zero_counterexample_reads_as_documented():
    (rule,) = parse_rules("rule add_zero Add(x, 0) => x prove exact")
    assert prove_rule(rule).counterexample == "x = -0.0: lhs = +0.0, rhs = -0.0"
