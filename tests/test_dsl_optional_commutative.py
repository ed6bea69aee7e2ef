"""Optional inputs (``b?``, ``??``) and proved commutative matching of Add and Mul in the rule DSL: parsing and
its errors, matching a present and an absent input, both operand orders, the prover's one obligation per
case (a rule wrong only without the bias is refuted, and says so), and Max never matched the other way."""
from __future__ import annotations

import os
import re

import attrs
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.dsl.ast import Coalesce, OptionalVar
from cuvil.dsl.cases import expand_cases
from cuvil.dsl.compiler import build, match
from cuvil.dsl.errors import RuleError
from cuvil.dsl.parser import parse_rules
from cuvil.frontend import export_model, import_model
from cuvil.reference import run_reference
from cuvil.rewrite_rules import commutativity, verdicts
from cuvil.rewrite_rules.engine import rewrite
from cuvil.rewrite_rules.prove import prove_rule
from cuvil.rewrite_rules.verdicts import builtin_rules, proved_rules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE_CONV = """
# Conv(x, w, b) * c -> Conv(x, w * c, b * c) for a per-channel c; without a bias, Conv(x, w * c)
rule scale_conv benefit 5
  Mul(Conv(x, w, b?, ..conv), c)
  when const(w, b, c), rank(w) == 4, rank(c) == 3, dim(c, 1) == 1, dim(c, 2) == 1
  => Conv(x, w * Reshape(c, shape=[-1, 1, 1, 1]), b * Reshape(c, shape=[-1]), ..conv)
  prove real
"""

# WRONG without a bias: it invents the bias c (with a bias, b * c is right)
SCALE_CONV_WRONG = SCALE_CONV.replace("scale_conv", "scale_conv_wrong").replace(
    "b * Reshape(c, shape=[-1]),", "(b * Reshape(c, shape=[-1])) ?? Reshape(c, shape=[-1]),")


def one(text):
    (r,) = parse_rules(text, "t.rule")
    return r


def conv_mul_model(bias: bool, commuted: bool = False):
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
             "k": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)}
    if bias:
        inits["b"] = rng.standard_normal(4).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["k", "c"] if commuted else ["c", "k"], ["y"])]
    return _model(nodes, {"x": (1, 3, 5, 5)}, inits)


def _model(nodes, inputs, inits):
    g = helper.make_graph(nodes, "t", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def root(g):
    return g.outputs[0]


# --- parsing ------------------------------------------------------------------------------------------------

def test_optional_input_and_default_parse():
    r = one(SCALE_CONV)
    assert r.lhs.args[0].args[2] == OptionalVar("b", r.loc)
    bn = one("rule bn BatchNormalization(Conv(x, w, b?), s, beta, mean, var)\n"
             "  when const(w, b, s, beta, mean, var)\n"
             "  => Conv(x, w, ((b - mean) * s + beta) ?? (beta - mean * s))\n  prove real\n")
    assert isinstance(bn.rhs.args[2], Coalesce)


@pytest.mark.parametrize("text, where, message", [
    ("rule a Conv(x, w?, b) => x prove exact", "t.rule:1:16", "input 2 of Conv is required"),
    ("rule a Conv(x, w, _?) => x prove exact", "t.rule:1:19", "name the optional input"),
    ("rule a Conv(x, w, b?) => b prove exact", "t.rule:1:26", "the replacement is absent"),
    ("rule a Conv(x, w, b?) when rank(b) == 1 => Conv(x, w, b) prove exact", "t.rule:1:33", "may be absent"),
    ("rule a Conv(x, w, b?) => Conv(x, w ?? x, b) prove exact", "t.rule:1:34", "never absent"),
    ("rule a Conv(x, b, b?) => x prove exact", "t.rule:1:19", "bound twice"),
    ("rule a Conv(x, w, b?) =>\n  Conv(x, w, b?) prove exact", "t.rule:2:14", "belongs in a pattern"),
    ("rule a Relu(x) => x ?\n prove exact", "t.rule:1:21", "unexpected"),
])
def test_optional_errors_point_at_the_token(text, where, message):
    with pytest.raises(RuleError) as e:
        parse_rules(text, "t.rule")
    assert str(e.value).startswith(where) and message in str(e.value), str(e.value)


def test_cases_of_a_rule():
    cases = dict(expand_cases(one(SCALE_CONV)))
    assert list(cases) == ["b present", "b absent"]
    absent = cases["b absent"]
    assert len(absent.lhs.args[0].args) == 2 and len(absent.rhs.args) == 2   # no bias on either side
    assert [a.name for a in absent.guards[0].args] == ["w", "c"]              # const(w, c)


# --- matching and building: present, absent ------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_match_present_and_absent(bias):
    r = one(SCALE_CONV)
    g = import_model(conv_mul_model(bias))
    b = match(r, root(g), g)
    assert b is not None
    assert (b.absent == set()) if bias else (b.absent == {"b"} and "b" not in b.values)
    new = build(r, b, g, [])
    assert new.producer.op == "Conv" and len(new.producer.inputs) == (3 if bias else 2)


@pytest.mark.parametrize("bias", [True, False])
def test_rewrite_keeps_outputs_with_and_without_bias(bias):
    model = conv_mul_model(bias)
    g = import_model(model)
    report = rewrite(g, proved_rules([one(SCALE_CONV)]))
    assert report.applied["scale_conv"] == 1 and [n.op for n in g.nodes] == ["Conv"]
    x = {"x": np.random.default_rng(1).standard_normal((1, 3, 5, 5)).astype(np.float32)}
    np.testing.assert_allclose(run_reference(export_model(g), x)[0], run_reference(model, x)[0], rtol=1e-5, atol=1e-5)


# --- the prover: one obligation per case -----------------------------------------------------------------------

def test_prover_proves_each_case():
    v = prove_rule(one(SCALE_CONV))
    statuses = [c["status"] for c in v.cases]
    assert [c["case"] for c in v.cases] == ["b present", "b absent"]
    assert set(statuses) <= {"proved", "bounded"}
    assert v.status == ("bounded" if "bounded" in statuses else "proved")   # the weaker of the two
    assert v.shapes.startswith("b present: ") and "; b absent: " in v.shapes


def test_prover_refutes_a_rule_wrong_only_without_the_input():
    v = prove_rule(one(SCALE_CONV_WRONG))
    assert v.status == "refuted" and v.counterexample.startswith("b absent: ")
    by_case = {c["case"]: c["status"] for c in v.cases}
    assert by_case["b absent"] == "refuted" and by_case["b present"] in ("proved", "bounded")


def test_builtin_twins_are_single_rules():
    names = {r.name for r in builtin_rules()}
    assert not {n for n in names if n.endswith("_nobias") and n != "fold_conv_add_channel_nobias"}
    assert not {n for n in names if n.endswith("_commuted")}
    assert any(c["case"] == "b absent" for c in
               verdicts.verdicts([next(r for r in builtin_rules() if r.name == "fold_conv_bn")])[0][0].cases)


# --- commutative matching --------------------------------------------------------------------------------------

def test_commutativity_facts_are_proved():
    for op in commutativity.COMMUTATIVE_OPS:
        for domain in ("real", "float", "float16", "bfloat16", "int32", "uint8"):
            assert commutativity.prove_fact(op, domain)["status"] == "proved", (op, domain)


@pytest.mark.parametrize("commuted", [False, True])
def test_add_and_mul_match_both_orders(commuted):
    (r,) = proved_rules([one(SCALE_CONV)])
    assert r.commutative == {"Mul"}   # prove real: commutativity over the reals, for the ops the pattern has
    g = import_model(conv_mul_model(True, commuted))
    assert match(r, root(g), g) is not None
    # the rule as written, before the verdict allows swapping, takes the written order only
    assert (match(attrs.evolve(r, commutative=frozenset()), root(g), g) is None) == commuted


def test_matcher_backtracks_into_the_other_order():
    """Mul(x, Relu(x)) on Mul(Relu(a), a): the written order binds x to Relu(a), then fails; the swapped one
    matches with x = a."""
    (r,) = proved_rules([one("rule m\n  Mul(x, Relu(x)) => Mul(Relu(x), x)\n  prove exact\n")])
    g = import_model(_model([helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Mul", ["r", "a"], ["y"])],
                            {"a": (2, 3)}, {}))
    b = match(r, root(g), g)
    assert b is not None and b.values["x"].name == "a"


def test_commuting_needs_the_fact(monkeypatch):
    """No proved fact, no swapping: the matcher consults the facts through the rule's verdict."""
    monkeypatch.setattr(verdicts, "fact_proved", lambda op, domain, store=None: False)
    (r,) = proved_rules([one(SCALE_CONV)])
    assert r.commutative == frozenset()
    g = import_model(conv_mul_model(True, commuted=True))
    assert match(r, root(g), g) is None


def test_exact_rule_commutes_only_in_the_types_it_covers(monkeypatch):
    real = verdicts.fact_proved
    monkeypatch.setattr(verdicts, "fact_proved", lambda op, domain, store=None: domain != "float16" and real(op, domain, store))
    (r,) = proved_rules([one("rule mul_one_t\n  Mul(x, 1) => x\n  prove exact\n")])
    assert "float16" in r.dtypes and r.commutative == frozenset()


def test_max_is_never_matched_commuted():
    """Max(x, 0) => Relu(x) does not rewrite Max(0, x): np.maximum's ties (+0 vs -0) and NaNs depend on the
    order, so Max is not commutative bit for bit and the matcher never swaps it."""
    (r,) = proved_rules([next(x for x in builtin_rules() if x.name == "max_zero_to_relu")])
    assert "Max" not in r.commutative
    for ins, matched in ((["x", "z"], True), (["z", "x"], False)):
        g = import_model(_model([helper.make_node("Max", ins, ["y"])], {"x": (2, 3)},
                                {"z": np.zeros((), np.float32)}))
        assert (match(r, root(g), g) is not None) == matched


def test_docs_commutative_example_matches_both_orders():
    """docs/rules.md's hardswish_doc example (proved by tests/test_docs.py) rewrites x * HardSigmoid(x) and
    HardSigmoid(x) * x alike, as the page says."""
    text = open(os.path.join(ROOT, "docs", "rules.md"), encoding="utf-8").read()
    (block,) = [b for b in re.findall(r"```rule\n(.*?)```", text, re.S) if "rule hardswish_doc" in b]
    (r,) = proved_rules(parse_rules(block, "docs/rules.md"))
    for ins in (["x", "h"], ["h", "x"]):
        g = import_model(_model([helper.make_node("HardSigmoid", ["x"], ["h"], alpha=1.0 / 6.0, beta=0.5),
                                 helper.make_node("Mul", ins, ["y"])], {"x": (2, 3)}, {}))
        assert rewrite(g, [r]).applied["hardswish_doc"] == 1 and [n.op for n in g.nodes] == ["HardSwish"]


def test_only_trailing_inputs_are_left_out():
    """Dropout(x, r?, t?) has three cases (r and t present; t absent; both absent): a Dropout with a training
    flag but no ratio is none of them, so it is not matched; each case is proved, and the training case refutes
    the rule (a Dropout in training mode drops elements)."""
    r = one("rule d\n  Dropout(x, r?, t?) => x\n  prove exact\n")
    assert [label for label, _ in expand_cases(r)] == ["r present, t present", "r present, t absent",
                                                       "r absent, t absent"]
    v = prove_rule(r)
    assert v.status == "refuted" and v.counterexample.startswith("r present, t present: ")
    assert [c["status"] for c in v.cases][1:] == ["proved", "proved"]
    inits = {"r": np.asarray(0.5, np.float32), "t": np.asarray(False)}
    for ins, matched in ((["x", "r", "t"], True), (["x", "r"], True), (["x"], True), (["x", "", "t"], False)):
        g = import_model(_model([helper.make_node("Dropout", ins, ["y"])], {"x": (2, 3)},
                                {k: v for k, v in inits.items() if k in ins}))
        assert (match(r, root(g), g) is not None) == matched, ins


def test_a_rule_without_add_or_mul_gets_no_commutativity_and_a_bool_guard_loads():
    """Commutativity is looked up only for the Add/Mul the pattern has; an element type with no fact (bool)
    allows no swapping instead of failing the load (it raised a KeyError for a bool dtype guard)."""
    text = ("rule transpose_pair_bool\n  Transpose(Transpose(x, perm=[1, 0]), perm=[1, 0]) when dtype(x) in [float, bool]"
            " => x\n  prove exact\n")
    (rule,) = proved_rules(parse_rules(text, "<test>"))
    assert rule.commutative == frozenset()
