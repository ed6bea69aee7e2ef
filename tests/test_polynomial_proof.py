"""The polynomial normal form (cuvil.rewrite_rules.polynomial): ``prove real`` obligations that are polynomial
identities are decided exactly, without Z3; everything else still goes to Z3."""
from fractions import Fraction

import numpy as np
import pytest
import z3

import cuvil.rewrite_rules.prove as prove_mod
from cuvil.dsl.parser import load_rules, parse_rules
from cuvil.rewrite_rules import polynomial as P
from cuvil.rewrite_rules.prove import prove_rule
from cuvil.rewrite_rules.verdicts import builtin_rules_dir

x, y, z = z3.Reals("x y z")


def same(a, b) -> bool:
    r = P.Reader()
    return r.read(a) == r.read(b)


@pytest.mark.parametrize("lhs,rhs", [
    ((x + y) * (x - y), x * x - y * y),
    ((x + y) ** 3, x**3 + 3 * x * x * y + 3 * x * y * y + y**3),
    ((x + 1) / 2 + (x - 1) / 2, x),                                   # division by a constant: a scaling
    (x * z3.RealVal(Fraction(1, 3)) * 3, x),                          # rational constants are exact
    (-(x - y), y - x),
    (x * (y * z), (x * y) * z),
    ((x - x) * y, z3.RealVal(0)),
])
def test_true_identities_have_equal_normal_forms(lhs, rhs):
    assert same(lhs, rhs)


@pytest.mark.parametrize("lhs,rhs", [
    ((x + y) ** 3, x**3 + 3 * x * x * y + 2 * x * y * y + y**3),     # one coefficient off
    ((x + 1) / 3 + (x - 1) / 3, x),
    (x * z3.RealVal(Fraction(1, 3)) * 3, x * z3.RealVal(Fraction(100000001, 100000000))),
    (x * x, x),                                                       # a power, not a coefficient
    (x * y, x * z),
])
def test_false_identities_have_different_normal_forms(lhs, rhs):
    assert not same(lhs, rhs)


@pytest.mark.parametrize("term", [
    x / y,                                    # division by a variable: a rational function
    x / (y - y),                              # division by zero
    z3.If(x > 0, x, -x),                      # Abs, Relu, Max, Min, Where
    z3.Function("sqrt", z3.RealSort(), z3.RealSort())(x),
    z3.ToReal(z3.Int("n")),                   # an integer subterm
    x ** y,
    x ** z3.RealVal(Fraction(1, 2)),
])
def test_non_polynomials_are_left_to_z3(term):
    with pytest.raises(P.NotPolynomial):
        P.Reader().read(term)
    assert P.normal_forms(np.array([term], dtype=object), np.array([x], dtype=object)) is None


def test_normal_forms_agree_with_exact_evaluation():
    """Random expression DAGs: the normal form evaluated at rational points equals Z3's exact value of the
    term there (a broken expansion, sign or coefficient fails this)."""
    rng = np.random.default_rng(7)
    variables = z3.Reals("a b c d")
    for _ in range(40):
        pool = list(variables) + [z3.RealVal(Fraction(int(rng.integers(-5, 6)), int(rng.integers(1, 4))))]
        for _ in range(12):
            a, b = (pool[int(rng.integers(len(pool)))] for _ in range(2))
            op = int(rng.integers(5))
            pool.append(a + b if op == 0 else a - b if op == 1 else a * b if op == 2 else -a if op == 3 else a / 3)
        term = pool[-1]
        reader = P.Reader()
        form = reader.read(term)
        for _ in range(3):
            point = [Fraction(int(rng.integers(-7, 8)), int(rng.integers(1, 5))) for _ in reader.names]
            exact = z3.simplify(z3.substitute(term, *[(v, z3.RealVal(p)) for v, p in zip(reader.names, point)]))
            assert P.evaluate(form, point) == exact.as_fraction()


def test_difference_points_are_points_where_the_sides_differ():
    r = P.Reader()
    left, right = [r.read((x + y) ** 2)], [r.read(x * x + y * y)]   # differ by 2xy: zero on both axes
    points = list(P.difference_points(left, right, len(r.names)))
    assert points
    for p in points:
        assert P.evaluate(left[0], p) != P.evaluate(right[0], p)
    assert not list(P.difference_points(left, left, len(r.names)))


def _winograd(name):
    return {r.name: r for r in load_rules(f"{builtin_rules_dir()}/winograd.rule")}[name]


def test_winograd_rules_are_proved_by_the_normal_form():
    # F(2x2) here; F(4x4)'s fresh proof is in tests/test_verdicts.py, whose check holds the method to the shipped one
    v = prove_rule(_winograd("winograd_f2x2_3x3"))
    assert v.status == "bounded" and v.method == P.METHOD
    assert all(case["method"] == P.METHOD for case in v.cases)


def test_a_wrong_polynomial_rule_is_refuted_with_a_point(monkeypatch):
    """With the random refuters out of the way, the normal form finds the difference itself, and the
    counterexample is a point Z3 confirmed (both sides shown)."""
    monkeypatch.setattr(prove_mod, "random_refutation", lambda *a, **k: (None, 0))
    monkeypatch.setattr(prove_mod, "semantic_refutation", lambda *a, **k: None)
    (rule,) = parse_rules("rule sq_wrong\n  Mul(Add(x, y), Add(x, y)) => Add(Mul(x, x), Mul(y, y))\n  prove real\n")
    v = prove_rule(rule)
    assert v.status == "refuted" and v.method == P.METHOD and "normal form" in v.detail
    assert "x = " in v.counterexample and "lhs = " in v.counterexample and "rhs = " in v.counterexample
    (right,) = parse_rules("rule sq\n  Mul(Add(x, y), Add(x, y)) => Add(Add(Mul(x, x), Mul(Mul(x, y), 2)), Mul(y, y))\n"
                           "  prove real\n")
    v = prove_rule(right)
    assert v.status == "proved" and v.method == P.METHOD


def test_a_wrong_winograd_matrix_is_refuted_by_the_normal_form(monkeypatch):
    from cuvil.ir.ops import winograd as W
    monkeypatch.setattr(prove_mod, "random_refutation", lambda *a, **k: (None, 0))
    monkeypatch.setattr(prove_mod, "semantic_refutation", lambda *a, **k: None)
    bt, g, at = W.MATRICES[2]
    bad = [list(r) for r in g]
    bad[1][1] += Fraction(1, 1000)
    monkeypatch.setitem(W.MATRICES, 2, (bt, tuple(tuple(r) for r in bad), at))
    v = prove_rule(_winograd("winograd_f2x2_3x3"))
    assert v.status == "refuted" and "normal form" in v.detail and "lhs[" in v.counterexample


def test_non_polynomial_rules_still_go_to_z3():
    (rule,) = parse_rules("rule div_mul\n  Mul(Div(x, y), y) => x\n  prove real\n")   # x/y*y: y = 0 undefined
    v = prove_rule(rule)
    assert v.status == "proved" and v.method == "z3"
    (rule,) = parse_rules("rule relu_sq\n  Relu(Mul(x, x)) => Mul(x, x)\n  prove real\n")
    v = prove_rule(rule)
    assert v.status == "proved" and v.method == "z3"


def test_the_normal_form_is_used_in_real_obligations_only():
    (rule,) = parse_rules("rule neg_neg_exact\n  Neg(Neg(x)) => x\n  prove exact\n")
    v = prove_rule(rule)
    assert v.status == "proved" and v.method == "z3"


def test_a_term_nested_past_the_recursion_limit_is_left_to_z3():
    from cuvil.rewrite_rules.polynomial import normal_forms
    xs = [z3.Real(f"deep{i}") for i in range(3000)]
    s = xs[0]
    for x in xs[1:]:
        s = s + x          # z3 keeps the nesting: 3,000 levels
    assert normal_forms([s], [s]) is None
