"""A decision procedure for ``prove real`` obligations that are polynomial identities.

Both sides of each output element are read from their Z3 real terms into a canonical sparse polynomial:
a map from monomials (sorted tuples of variable indices) to exact rational coefficients
(:class:`fractions.Fraction`). Over the reals this decides the identity exactly: a polynomial vanishes on
all of R^n iff every coefficient is zero, so two sides are equal everywhere iff their normal forms agree.

Only polynomials are read: real variables, rational numerals, ``+ - *``, unary minus, division by a term
that is itself a non-zero rational constant (a scaling), and powers with a natural-number exponent.
Anything else (division by a variable, ``If`` from Where/Min/Max/Relu/Abs, ``sqrt``/``exp`` functions,
integer or boolean terms) makes :func:`to_polynomial` answer None, and the caller falls back to Z3.

Normal forms that differ do not by themselves refute a rule: :func:`difference_points` only proposes
points where the two sides differ (found by evaluating the difference exactly), and the caller confirms
one against the obligation's assumptions before it reports a counterexample.
"""
from __future__ import annotations

import ctypes
import itertools
from fractions import Fraction
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import z3
from z3 import z3core as C

Monomial = Tuple[int, ...]          # sorted variable indices, repeated for powers; () is the constant term
Polynomial = Dict[Monomial, Fraction]

METHOD = "polynomial normal form (exact, over the reals)"
MAX_TERMS = 200_000   # a normal form larger than this is left to Z3 (no verdict here)
MAX_POWER = 16


class NotPolynomial(Exception):
    """The term is outside the polynomial fragment (or too large to expand)."""


def _accumulate(out: Polynomial, q: Polynomial, negate: bool = False) -> None:
    """out += q (or -q) in place; zero coefficients are left in (see :func:`_pruned`)."""
    get = out.get
    for m, c in q.items():
        if negate:
            c = -c
        v = get(m)
        out[m] = c if v is None else v + c


def _pruned(p: Polynomial) -> Polynomial:
    return {m: c for m, c in p.items() if c}


def _add(p: Polynomial, q: Polynomial, sign: int = 1) -> Polynomial:
    out = dict(p)
    _accumulate(out, q, sign < 0)
    return _pruned(out)


def _mul(p: Polynomial, q: Polynomial) -> Polynomial:
    if len(p) * len(q) > MAX_TERMS:
        raise NotPolynomial("too many terms")
    out: Polynomial = {}
    get = out.get
    for m1, c1 in p.items():
        for m2, c2 in q.items():
            m = tuple(sorted(m1 + m2)) if m1 and m2 else (m1 or m2)
            v = get(m)
            out[m] = c1 * c2 if v is None else v + c1 * c2
    return _pruned(out)


def _scale(p: Polynomial, k: Fraction) -> Polynomial:
    return {m: c * k for m, c in p.items()} if k else {}


def _constant(p: Polynomial) -> Optional[Fraction]:
    """The value of a constant polynomial (0 for the empty one); None when it has a variable."""
    if not p:
        return Fraction(0)
    if len(p) == 1 and () in p:
        return p[()]
    return None


class Reader:
    """Reads Z3 real terms into polynomials, sharing the work across the terms of one obligation (the
    terms are DAGs: a Winograd output reuses its tile's transforms). Variables are numbered in the order
    met; ``names[i]`` is variable i's Z3 constant."""

    def __init__(self, ctx: Optional[z3.Context] = None):
        self.ctx = (ctx or z3.main_ctx()).ref()
        self.memo: Dict[int, Polynomial] = {}
        self.index: Dict[str, int] = {}
        self.names: List[z3.ArithRef] = []
        # The memo is keyed by AST id, and Z3 reuses the id of a freed AST: every term read is kept alive
        # (with it, each subterm the memo names) for the reader's lifetime.
        self.read_terms: List[z3.ExprRef] = []

    def read(self, term) -> Polynomial:
        """The term's normal form; raises NotPolynomial outside the fragment."""
        if not isinstance(term, z3.ArithRef) or not term.is_real():
            raise NotPolynomial("not a real term")
        self.read_terms.append(term)
        return self._read(term.as_ast(), term)

    def _read(self, a, owner) -> Polynomial:
        ctx = self.ctx
        key = C.Z3_get_ast_id(ctx, a)
        got = self.memo.get(key)
        if got is not None:
            return got
        if C.Z3_get_sort_kind(ctx, C.Z3_get_sort(ctx, a)) != z3.Z3_REAL_SORT:
            raise NotPolynomial("an integer or boolean subterm")
        kind = C.Z3_get_ast_kind(ctx, a)
        if kind == z3.Z3_NUMERAL_AST:
            v = Fraction(C.Z3_get_numeral_string(ctx, a))
            out: Polynomial = {(): v} if v else {}
        elif kind != z3.Z3_APP_AST:
            raise NotPolynomial("a quantifier or bound variable")
        else:
            decl = C.Z3_get_app_decl(ctx, a)
            op = C.Z3_get_decl_kind(ctx, decl)
            n = C.Z3_get_app_num_args(ctx, a)
            if op == z3.Z3_OP_UNINTERPRETED and n == 0:
                name = C.Z3_get_symbol_string(ctx, C.Z3_get_decl_name(ctx, decl))
                if name not in self.index:
                    self.index[name] = len(self.names)
                    self.names.append(z3.Real(name))
                out = {(self.index[name],): Fraction(1)}
            elif op == z3.Z3_OP_AGNUM:
                raise NotPolynomial("an algebraic number")
            else:
                args = [C.Z3_get_app_arg(ctx, a, i) for i in range(n)]
                out = self._apply(op, args, owner)
        if len(out) > MAX_TERMS:
            raise NotPolynomial("too many terms")
        self.memo[key] = out
        return out

    def _apply(self, op, args, owner) -> Polynomial:
        if op in (z3.Z3_OP_ADD, z3.Z3_OP_SUB):
            out: Polynomial = {}
            for i, x in enumerate(args):
                _accumulate(out, self._read(x, owner), negate=op == z3.Z3_OP_SUB and i > 0)
            return _pruned(out)
        if op == z3.Z3_OP_UMINUS:
            return _scale(self._read(args[0], owner), Fraction(-1))
        if op == z3.Z3_OP_MUL:
            out = {(): Fraction(1)}
            for x in args:
                out = _mul(out, self._read(x, owner))
            return out
        if op == z3.Z3_OP_DIV:
            k = _constant(self._read(args[1], owner))
            if k is None or k == 0:
                # division by a variable is a rational function; by zero, undefined: Z3 decides both
                raise NotPolynomial("division by a non-constant")
            return _scale(self._read(args[0], owner), 1 / k)
        if op == z3.Z3_OP_POWER:
            e = _constant(self._read(args[1], owner))
            if e is None or e.denominator != 1 or not 0 <= e <= MAX_POWER:
                raise NotPolynomial("a power that is not a small natural number")
            base, out = self._read(args[0], owner), {(): Fraction(1)}
            for _ in range(int(e)):
                out = _mul(out, base)
            return out
        raise NotPolynomial(f"operator {op}")


def normal_forms(lhs, rhs, reader: Optional[Reader] = None) -> Optional[Tuple[Reader, List[Polynomial], List[Polynomial]]]:
    """The normal forms of every element of both sides (equal shapes), or None when one element is not a
    polynomial (then the identity is Z3's to decide)."""
    lhs, rhs = np.asarray(lhs, dtype=object), np.asarray(rhs, dtype=object)
    if lhs.shape != rhs.shape:
        return None
    reader = reader or Reader()
    try:
        left = [reader.read(x) for x in lhs.reshape(-1)]
        right = [reader.read(x) for x in rhs.reshape(-1)]
    except (NotPolynomial, z3.Z3Exception, ValueError, RecursionError, ctypes.ArgumentError):
        return None     # (a term nested deeper than Python's recursion limit: Z3's to decide, as before)
    return reader, left, right


def evaluate(p: Polynomial, point: Sequence[Fraction]) -> Fraction:
    """The exact value of a polynomial at a point (one value per variable)."""
    total = Fraction(0)
    for m, c in p.items():
        v = c
        for i in m:
            v *= point[i]
        total += v
    return total


def difference_points(left: Sequence[Polynomial], right: Sequence[Polynomial], nvars: int,
                      tries: int = 64, seed: int = 0) -> Iterator[List[Fraction]]:
    """Points (exact rationals) where some element's two normal forms take different values. A non-zero
    polynomial of degree d vanishes on at most a d/|S| fraction of S^n, so a few draws from a set larger
    than the degree find one; the first candidates are small integers and halves, for readable
    counterexamples."""
    diffs = [_add(a, b, -1) for a, b in zip(left, right) if a != b]
    if not diffs:
        return
    rng = np.random.default_rng(seed)
    for t in range(tries):
        span = 2 + 4 * t
        point = [Fraction(int(rng.integers(-span, span + 1)), int(rng.choice([1, 1, 2]))) for _ in range(nvars)]
        if any(evaluate(d, point) != 0 for d in diffs):
            yield point
