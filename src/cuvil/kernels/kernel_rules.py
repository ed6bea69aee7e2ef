"""Kernel-level rewriting: ``on kernel`` rules applied to the scalar expressions (:class:`~cuvil.kernels.texpr.E`
trees) of scheduled stages, after fusion and before code generation.

A rule's pattern and replacement are read as expressions over float scalars. Each DSL op has one *kernel
form*, the E structure its lowering produces:

==================  =============================================================================
DSL                 E form
==================  =============================================================================
Add Sub Mul Div     ``add`` ``sub`` ``mul`` ``div`` (float dtype only: index arithmetic is never touched)
Neg                 ``neg``
Fma(a, b, c)        ``fma`` (one rounding: ``fma.rn`` on the GPU)
Max(a, b), Min      ``select(cmp.uno(a, a), a, select(cmp.gt(a, b), a, b))`` (np.maximum; ``lt`` for Min)
Relu(x)             ``Max(x, 0)`` in that form
Sqrt Exp Log Tanh   ``call[sqrt](x)`` ... (the lowering's unary calls), Abs as ``call[fabs]``
Reciprocal(x)       ``div(1, x)``
==================  =============================================================================

Literals match constants bit for bit in the expression's dtype. A name used twice must match structurally
equal sub-expressions. The operands of Add and Mul are tried in both orders where the rule's verdict allows
it (``Rule.commutative``: commutativity proved over the reals for ``prove real`` rules, in float32 for exact
ones; :mod:`cuvil.rewrite_rules.commutativity`). Guards and attributes are not supported at kernel level (a clear error says so).

Rewriting is bottom-up over the expression DAG (shared sub-expressions are rewritten once), trying rules by
descending benefit at every node and again on what a rule produced, to a fixpoint (bounded per node).

**Reductions.** The accumulation step of a float ``sum`` reduction, ``acc' = acc + body``, is offered to the
rules as the expression ``Add(acc, body)`` with ``acc`` an opaque float. When a rule turns it into
``Fma(a, b, acc)`` (``fma_contract`` does, for a body ``Mul(a, b)``, matching ``Add(acc, Mul(a, b))`` with its
operands swapped), the reduction becomes a fused
multiply-accumulate (``reduce[fma](a, b)``): each step is that rule's instance, so it is justified by the
rule's proof.

**Which rules run.** Only rules whose verdict is ``proved`` (:func:`select_kernel_rules`, through the same
verdict store as graph rules). ``prove exact`` rules hold bit for bit in IEEE float32 and are applied to
float32 expressions only; ``prove real`` rules change rounding (fma contraction rounds once where
``a * b + c`` rounds twice), so they run only when the caller allows contraction (``fma=True``, the GPU
default, as nvcc's ``-fmad=true`` and PyTorch's kernels do), and then at any float width.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..dsl.ast import Expr, Num, OpCall, Rule, Var, Wildcard
from ..dsl.errors import RuleError
from ..ir.dtype import DType
from ..rewrite_rules.verdicts import builtin_rules, proved_rules
from .texpr import BOOL, E, call, cmp, const, select

# ONNX unary op -> the libm-style call its lowering emits
UNARY_CALLS = {"Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Sin": "sin", "Cos": "cos", "Tan": "tan",
               "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
               "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Erf": "erf", "Floor": "floor",
               "Ceil": "ceil", "Round": "roundeven", "Tanh": "tanh", "Abs": "fabs"}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}
KERNEL_FORMS = sorted(set(UNARY_CALLS) | set(BINARY) | {"Neg", "Fma", "Max", "Min", "Relu", "Reciprocal"})
MAX_REWRITES_PER_NODE = 16


# --- structural equality -----------------------------------------------------------------------------------

def same(a: E, b: E, memo=None) -> bool:
    """Structurally equal expressions (the same object, or equal op, dtype, payload and arguments)."""
    if a is b:
        return True
    if memo is None:
        memo = {}
    key = (a.uid, b.uid)
    if key in memo:
        return memo[key]
    if a.op != b.op or a.dtype != b.dtype or len(a.args) != len(b.args):
        out = False
    elif a.op == "const":
        out = _bits(a.attr, a.dtype) == _bits(b.attr, b.dtype)
    elif a.op in ("reduce", "argscan", "contract"):
        out = False   # bound variables / opaque payloads: only identity
    else:
        out = _attr_eq(a.attr, b.attr) and all(same(x, y, memo) for x, y in zip(a.args, b.args))
    memo[key] = out
    return out


def _attr_eq(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _bits(v, dt: DType):
    if dt.is_float:
        return np.asarray(v, dtype=dt.numpy).tobytes()
    return v


def _is_float(e: E) -> bool:
    return e.dtype.is_float and e.dtype != BOOL


# --- the kernel forms of Max / Min -------------------------------------------------------------------------

def nan_max(a: E, b: E) -> E:
    """np.maximum as the lowering writes it (NaN if ``a`` is NaN; ``a`` when ``a > b``, else ``b``)."""
    return select(cmp("uno", a, a), a, select(cmp("gt", a, b), a, b))


def nan_min(a: E, b: E) -> E:
    return select(cmp("uno", a, a), a, select(cmp("lt", a, b), a, b))


def _minmax_parts(e: E, pred: str) -> Optional[Tuple[E, E]]:
    """(a, b) when ``e`` is the kernel form of Max (pred gt) or Min (pred lt) of float a, b."""
    if e.op != "select" or not _is_float(e):
        return None
    c0, x0, inner = e.args
    if c0.op != "cmp" or c0.attr != "uno" or not (same(c0.args[0], c0.args[1]) and same(c0.args[0], x0)):
        return None
    if inner.op != "select":
        return None
    c1, x1, y1 = inner.args
    if c1.op != "cmp" or c1.attr != pred:
        return None
    a, b = c1.args
    if not (same(a, x0) and same(a, x1) and same(b, y1)):
        return None
    return x0, y1


# --- compiling a rule --------------------------------------------------------------------------------------

def _err(rule: Rule, msg: str, loc=None):
    loc = loc or rule.loc
    return RuleError(f"kernel rule {rule.name}: {msg}", loc.path, loc.line, loc.col, None)


def _check(rule: Rule, e: Expr, side: str):
    if isinstance(e, OpCall):
        if e.attrs or e.rest:
            raise _err(rule, f"attributes are not supported in kernel rules ({e.op})", e.loc)
        if e.op not in KERNEL_FORMS:
            raise _err(rule, f"{e.op} has no kernel form (kernel rules use {', '.join(KERNEL_FORMS)})", e.loc)
        want = {"Fma": 3, "Neg": 1, "Relu": 1, "Reciprocal": 1, **{k: 1 for k in UNARY_CALLS},
                **{k: 2 for k in BINARY}, "Max": 2, "Min": 2}[e.op]
        if len(e.args) != want:
            raise _err(rule, f"{e.op} takes {want} inputs at kernel level, got {len(e.args)}", e.loc)
        for a in e.args:
            _check(rule, a, side)
    elif isinstance(e, Num):
        if not isinstance(e.value, (int, float)):
            raise _err(rule, "literals are numbers", e.loc)
    elif isinstance(e, Wildcard):
        if side == "rhs":
            raise _err(rule, "_ cannot appear in a replacement", e.loc)
    elif not isinstance(e, Var):
        raise _err(rule, f"{type(e).__name__} is not allowed in a kernel rule", getattr(e, "loc", None))


@attrs.define(eq=False)
class KernelRule:
    """A compiled ``on kernel`` rule: ``apply(e)`` returns the replacement of ``e`` or None."""
    rule: Rule

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def exact(self) -> bool:
        return self.rule.proof == "exact"

    def match(self, e: E) -> Optional[Dict[str, E]]:
        b: Dict[str, E] = {}
        for _ in _matches(self.rule.lhs, e, b, self.rule.commutative):
            return dict(b)
        return None

    def apply(self, e: E) -> Optional[E]:
        if not _is_float(e):
            return None
        b = self.match(e)
        if b is None:
            return None
        out = _build(self.rule.rhs, b, e.dtype)
        if out is None or out.dtype != e.dtype:
            return None
        return out


def compile_kernel_rule(rule: Rule) -> KernelRule:
    """Check that ``rule`` (``on kernel``) can be read over E trees; RuleError (with its location) if not."""
    if rule.on != "kernel":
        raise _err(rule, "is not an 'on kernel' rule")
    if rule.guards:
        raise _err(rule, "guards ('when') are not supported in kernel rules", rule.guards[0].loc)
    _check(rule, rule.lhs, "lhs")
    _check(rule, rule.rhs, "rhs")
    return KernelRule(rule)


def _matches(p: Expr, e: E, b: Dict[str, E], commutative) -> Iterator[None]:
    """Yields once per way ``p`` matches ``e``, with ``b`` extended by it (undone when resumed): the operands
    of the ops in ``commutative`` (Add, Mul, where the rule's verdict allows) are tried as written, then
    swapped."""
    if isinstance(p, Wildcard):
        if _is_float(e):
            yield
        return
    if isinstance(p, Var):
        if not _is_float(e):
            return
        if p.name in b:
            if same(b[p.name], e):
                yield
            return
        b[p.name] = e
        yield
        del b[p.name]
        return
    if isinstance(p, Num):
        if e.op != "const" or not _is_float(e):
            return
        try:
            if _bits(float(p.value), e.dtype) == _bits(e.attr, e.dtype):
                yield
        except (OverflowError, ValueError):
            pass
        return
    assert isinstance(p, OpCall)
    if not _is_float(e):
        return
    op = p.op
    if op in BINARY:
        if e.op == BINARY[op] and len(e.args) == 2:
            yield from _all_match(p.args, e.args, b, commutative)
            if op in commutative:
                yield from _all_match(p.args, e.args[::-1], b, commutative)
    elif op == "Neg":
        if e.op == "neg":
            yield from _matches(p.args[0], e.args[0], b, commutative)
    elif op == "Fma":
        if e.op == "fma":
            yield from _all_match(p.args, e.args, b, commutative)
    elif op in UNARY_CALLS:
        if e.op == "call" and e.attr == UNARY_CALLS[op] and len(e.args) == 1:
            yield from _matches(p.args[0], e.args[0], b, commutative)
    elif op == "Reciprocal":
        if e.op == "div" and e.args[0].op == "const" and _bits(1.0, e.dtype) == _bits(e.args[0].attr, e.dtype):
            yield from _matches(p.args[0], e.args[1], b, commutative)
    elif op in ("Max", "Min", "Relu"):
        parts = _minmax_parts(e, "lt" if op == "Min" else "gt")
        if parts is None:
            return
        if op == "Relu":
            z = parts[1]
            if z.op == "const" and _bits(0.0, e.dtype) == _bits(z.attr, e.dtype):
                yield from _matches(p.args[0], parts[0], b, commutative)
        else:
            yield from _all_match(p.args, parts, b, commutative)


def _all_match(patterns, exprs, b: Dict[str, E], commutative) -> Iterator[None]:
    if not patterns:
        yield
        return
    for _ in _matches(patterns[0], exprs[0], b, commutative):
        yield from _all_match(patterns[1:], exprs[1:], b, commutative)


def _build(p: Expr, b: Dict[str, E], dt: DType) -> Optional[E]:
    if isinstance(p, Var):
        return b[p.name]
    if isinstance(p, Num):
        return const(float(p.value), dt)
    assert isinstance(p, OpCall)
    args = [_build(a, b, dt) for a in p.args]
    if any(a is None for a in args):
        return None
    t = args[0].dtype if args else dt
    if any(a.dtype != t for a in args):
        return None
    op = p.op
    if op in BINARY:
        return E(BINARY[op], args, t)
    if op == "Neg":
        return E("neg", args, t)
    if op == "Fma":
        return E("fma", args, t)
    if op in UNARY_CALLS:
        return call(UNARY_CALLS[op], args[0])
    if op == "Reciprocal":
        return E("div", (const(1.0, t), args[0]), t)
    if op == "Max":
        return nan_max(*args)
    if op == "Min":
        return nan_min(*args)
    if op == "Relu":
        return nan_max(args[0], const(0.0, t))
    return None


# --- choosing the rules --------------------------------------------------------------------------------------

def builtin_kernel_rules() -> List[Rule]:
    """The ``on kernel`` rules of the built-in library (``rules/kernel.rule``)."""
    return [r for r in builtin_rules() if r.on == "kernel"]


def select_kernel_rules(rules: Optional[Sequence[Rule]] = None, *, fma: bool = True,
                        on_unproved: str = "error") -> List[Rule]:
    """The kernel rules that may run: proved (verdict store / prover, as for graph rules), and ``prove real``
    ones only when ``fma`` (contraction, fast-math-like) is allowed. ``rules`` None: the built-in ones;
    graph rules in ``rules`` are ignored."""
    rules = builtin_kernel_rules() if rules is None else [r for r in rules if r.on == "kernel"]
    for r in rules:
        compile_kernel_rule(r)
    rules = proved_rules(rules, on_unproved=on_unproved)
    return [r for r in rules if fma or r.proof == "exact"]


# --- the rewriter --------------------------------------------------------------------------------------------

class KernelRewriter:
    """Applies compiled kernel rules bottom-up; ``counts`` says how often each fired."""

    def __init__(self, rules: Iterable[Rule]):
        compiled = [compile_kernel_rule(r) for r in rules]
        self.rules = sorted(compiled, key=lambda k: -k.rule.benefit)   # stable: file order among equals
        self.counts: Dict[str, int] = {k.name: 0 for k in self.rules}
        self._memo: Dict[int, E] = {}

    def _allowed(self, k: KernelRule, e: E) -> bool:
        # exact obligations are proved in IEEE float32: other widths only take real (contraction) rules
        return not k.exact or e.dtype == DType.FLOAT

    def _top(self, e: E) -> E:
        for _ in range(MAX_REWRITES_PER_NODE):
            for k in self.rules:
                if not self._allowed(k, e):
                    continue
                out = k.apply(e)
                if out is not None:
                    self.counts[k.name] += 1
                    e = self._settle(out)
                    break
            else:
                return e
        return e

    def _settle(self, e: E) -> E:
        """A replacement: the nodes it binds are rewritten already; the nodes it created below its root are
        rewritten now (its root is retried by the caller)."""
        if e.uid in self._memo:
            return self._memo[e.uid]
        args = [a if a.uid in self._memo else self.rewrite(a) for a in e.args]
        return e if all(a is b for a, b in zip(args, e.args)) else E(e.op, args, e.dtype, e.attr)

    def rewrite(self, e: E) -> E:
        if not self.rules:
            return e
        stack = [(e, False)]
        memo = self._memo
        while stack:
            x, ready = stack.pop()
            if x.uid in memo:
                continue
            if not ready:
                stack.append((x, True))
                stack.extend((a, False) for a in x.args if a.uid not in memo)
                continue
            args = [memo[a.uid] for a in x.args]
            y = x if all(a is b for a, b in zip(args, x.args)) else E(x.op, args, x.dtype, x.attr)
            if y.op == "reduce":
                y = self._reduction(y)
            elif _is_float(y) and y.op not in ("const", "var", "load", "gload", "argscan", "contract", "cast"):
                y = self._top(y)
            memo[x.uid] = y
            memo[y.uid] = y
        return memo[e.uid]

    def _reduction(self, r: E) -> E:
        kind, vs, extents = r.attr
        if kind != "sum" or not _is_float(r) or r.args[0].dtype != r.dtype:
            return r
        acc = E("var", (), r.dtype, f"__acc{r.uid}")
        step = E("add", (acc, r.args[0]), r.dtype)
        for k in self.rules:
            if not self._allowed(k, step):
                continue
            out = k.apply(step)
            if out is not None and out.op == "fma" and out.args[2] is acc and not _mentions(out.args[:2], acc):
                self.counts[k.name] += 1
                return E("reduce", out.args[:2], r.dtype, ("fma", vs, extents))
        return r


def _mentions(es: Sequence[E], target: E) -> bool:
    stack, seen = list(es), set()
    while stack:
        x = stack.pop()
        if x is target:
            return True
        if x.uid in seen:
            continue
        seen.add(x.uid)
        stack.extend(x.args)
    return False


def rewrite_stages(stages, rules: Sequence[Rule]):
    """New stages (same buffers and variables) whose expressions are rewritten by ``rules``; and the
    per-rule firing counts."""
    rw = KernelRewriter(rules)
    out = [attrs.evolve(st, expr=rw.rewrite(st.expr)) for st in stages]
    return out, dict(rw.counts)
