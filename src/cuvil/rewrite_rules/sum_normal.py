"""Nested real sums in a normal form, for the generic prover (:mod:`cuvil.rewrite_rules.generic`).

A fold's constant stands for one value, so a fold inside another fold's body (``x·(a·b)``: the element
``Σ_k x[i,k] · Σ_r a[k,r]·b[r,j]``) cannot be compared as it is: the inner constant varies with the outer
index. Over the reals (``prove real`` only) a polynomial in sums is rewritten into a sum of monomials, each
one flat sum ``Σ_{k1..kn} f1·…·fm`` whose factors contain no sum, by the identities of finite sums:

* ``Σ_k (A + B) = Σ_k A + Σ_k B`` and ``Σ_k (-A) = -Σ_k A`` (linearity);
* ``c · Σ_r g = Σ_r c·g`` where ``c`` does not mention ``r`` (distributivity; each sum's indices are renamed
  to fresh constants when it is expanded, so no other factor can mention them, and a sum used twice, as in
  ``(Σ_k f)²``, becomes two independent index sets: ``Σ_k Σ_k' f(k)·f(k')``);
* ``Σ_k Σ_r f = Σ_{k,r} f``, which needs the inner bounds not to depend on ``k``: every extent is checked
  to mention no summation index, else the rule is outside the fragment.

A flat sum over a box ``[0, e1) × … × [0, en)`` does not depend on the order of its indices (finite sums of
reals commute: Fubini for finite sums), which :meth:`generic._Proof.merge_folds` uses to match
``Σ_{r,k}`` with ``Σ_{k,r}``. None of this holds in float32 (the order of the additions changes the
rounding): ``prove exact`` rules never nest folds (:meth:`index_semantics.Side.fold` refuses them).

Anything else around a sum (a division, a max, an ``If``) is outside the fragment: :class:`Unsupported`.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Tuple

import z3

from .index_semantics import Fold, Unsupported, _mentions

Monomial = Tuple[List[Any], List[Any], List[Any]]   # (indices, their extents, factors without sums)


class Normaliser:
    """Expands the fold constants of element terms into flat sums; :attr:`folds` collects them."""

    def __init__(self, folds: List[Fold]):
        self.by_name: Dict[str, Fold] = {f.value.decl().name(): f for f in folds}
        self.all_ks = [k for f in folds for k in f.ks]
        self.folds: List[Fold] = []
        self._fresh = itertools.count()

    def term(self, t, tag: str):
        """``t`` with every sum flattened: a sum of products of flat-sum constants and sum-free factors."""
        out = []
        for ks, ext, fs in self.monomials(t):
            body = _product(fs) if fs else z3.RealVal(1)
            if not ks:
                out.append(body)
                continue
            value = z3.Const(f"fold.{tag}n{len(self.folds)}", z3.RealSort())
            self.folds.append(Fold("sum", ext, ks, body, None, value))
            out.append(value)
        if not out:
            return z3.RealVal(0)
        acc = out[0]
        for x in out[1:]:
            acc = acc + x
        return acc

    def has_fold(self, t) -> bool:
        todo, seen = [t], set()
        while todo:
            e = todo.pop()
            if e.get_id() in seen:
                continue
            seen.add(e.get_id())
            if z3.is_const(e) and e.decl().name() in self.by_name:
                return True
            if z3.is_quantifier(e):
                todo.append(e.body())
            elif z3.is_app(e):
                todo.extend(e.children())
        return False

    def monomials(self, t) -> List[Monomial]:
        if not self.has_fold(t):
            return [([], [], [t])]
        if z3.is_const(t) and t.decl().name() in self.by_name:
            f = self.by_name[t.decl().name()]
            if f.kind != "sum" or f.guard is not None:
                raise Unsupported(f"a {f.kind} fold next to a nested sum")
            for e in f.extents:
                if _mentions(e, self.all_ks):
                    raise Unsupported("a sum whose bounds depend on another sum's index")
            n = next(self._fresh)
            fresh = [z3.Int(f"{k.decl().name()}~{n}") for k in f.ks]
            sub = list(zip(f.ks, fresh))
            out = []
            for ks, ext, fs in self.monomials(f.body):
                out.append((fresh + ks, list(f.extents) + ext,
                            [z3.substitute(x, *sub) if sub else x for x in fs]))
            return out
        if z3.is_app_of(t, z3.Z3_OP_ADD):
            return [m for c in t.children() for m in self.monomials(c)]
        if z3.is_app_of(t, z3.Z3_OP_SUB):
            head, *rest = t.children()
            return self.monomials(head) + [_negate(m) for c in rest for m in self.monomials(c)]
        if z3.is_app_of(t, z3.Z3_OP_UMINUS):
            return [_negate(m) for m in self.monomials(t.children()[0])]
        if z3.is_app_of(t, z3.Z3_OP_MUL):
            out: List[Monomial] = [([], [], [])]
            for c in t.children():
                out = [(k1 + k2, e1 + e2, f1 + f2) for k1, e1, f1 in out for k2, e2, f2 in self.monomials(c)]
            return out
        raise Unsupported(f"a sum under {t.decl().name()} (only +, -, * of sums are normalised)")


def _negate(m: Monomial) -> Monomial:
    ks, ext, fs = m
    return ks, ext, [z3.RealVal(-1)] + fs


def _product(fs):
    out = fs[0]
    for f in fs[1:]:
        out = out * f
    return out
