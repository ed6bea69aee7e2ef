"""Semantic checks of parsed rules against the op registry; errors point at the offending token."""
from __future__ import annotations

from typing import List, Set

import onnx.defs

from ..errors import UnsupportedOpError
from ..ir.registry import lookup, op_schema
from .ast import (DTYPE_NAMES, Arith, Coalesce, Compare, Expr, FuncCall, ListLit, Num, OpCall, OptionalVar, Rule,
                  Var, Wildcard)
from .cases import GUARDS_OVER_PRESENT, expand_cases, first_optional_slot, may_be_absent
from .errors import RuleError

# Guards: name -> (number of arguments or None for 1+, what the call yields)
GUARDS = {"const": (None, "bool"), "single_use": (None, "bool"), "rank": (1, "int"), "dim": (2, "int"),
          "shape": (1, "shape"), "dtype": (1, "dtype")}
# Scalar ops that kernel-level rules (``on kernel``) may use, besides the elementwise ONNX ops.
KERNEL_OPS = {"Fma"}
BINARY_SUGAR = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}


def validate_rules(rules: List[Rule], source: str) -> None:
    for r in rules:
        _Checker(r, source).run()


class _Checker:
    def __init__(self, rule: Rule, source: str):
        self.r, self.source = rule, source
        self.values: Set[str] = set()
        self.attrs: Set[str] = set()
        self.rests: Set[str] = set()
        self.optional: Set[str] = set()   # names bound by ``name?`` inputs

    def err(self, msg, loc):
        raise RuleError(msg, loc.path, loc.line, loc.col, self.source)

    def run(self):
        self.pattern(self.r.lhs, top=True)
        for g in self.r.guards:
            self.guard(g)
        self.replacement(self.r.rhs)
        if may_be_absent(self.r.rhs, self.optional):
            self.err("the replacement is absent when an optional input is: give it a default with ??, "
                     "e.g. (b + c) ?? c", getattr(self.r.rhs, "loc", self.r.loc))
        try:
            expand_cases(self.r)   # every case's replacement leaves out trailing inputs only
        except ValueError:
            self.err("in some case an absent input comes before a present one: only trailing inputs can be "
                     "left out", getattr(self.r.rhs, "loc", self.r.loc))

    # --- ops -------------------------------------------------------------------------------------------
    def check_op(self, c: OpCall):
        if self.r.on == "kernel" and c.op in KERNEL_OPS:
            return None
        try:
            opdef = lookup(c.op)
        except UnsupportedOpError:
            self.err(f"unknown op {c.op!r}", c.loc)
        schema = op_schema(c.op)
        n = len(c.args)
        lifted = set(opdef.lifted_names.values())
        single = onnx.defs.OpSchema.FormalParameterOption.Single
        required = [i for i, f in enumerate(schema.inputs) if f.option == single and i not in lifted]
        lo, hi = (max(required) + 1 if required else 0), schema.max_input
        if n < lo or n > hi:  # inputs lifted into attributes (Unsqueeze's axes, ...) need not be given
            want = (f"{lo}" if lo == hi else f"{lo} to {hi}" if hi < 1 << 20 else f"at least {lo}")
            self.err(f"{c.op} takes {want} inputs, got {n}", c.loc)
        known = set(schema.attributes) | set(opdef.lifted_names)
        for name, _ in c.attrs:
            if name not in known:
                self.err(f"{c.op} has no attribute {name!r} (it has: {', '.join(sorted(known)) or 'none'})", c.loc)
        return opdef

    # --- left side -----------------------------------------------------------------------------------
    def pattern(self, e: Expr, top=False):
        if isinstance(e, OpCall):
            self.check_op(e)
            first = first_optional_slot(e.op)
            for i, a in enumerate(e.args):
                if isinstance(a, OptionalVar):
                    self.optional_input(e, i, a, first)
                elif any(isinstance(x, OptionalVar) for x in e.args[:i]):
                    self.err("optional inputs (name?) come last: an input after one cannot be required", a.loc)
                else:
                    self.pattern(a)
            for _, a in e.attrs:
                self.attr_pattern(a)
            if e.rest:
                if e.rest in self.rests:
                    self.err(f"..{e.rest} is bound twice", e.loc)
                self.rests.add(e.rest)
        elif isinstance(e, Var):
            if e.name in self.optional:
                self.err(f"{e.name!r} is an optional input (bound once, by {e.name}?)", e.loc)
            self.values.add(e.name)
        elif isinstance(e, (Wildcard, Num)):
            pass
        elif isinstance(e, OptionalVar):
            self.err(f"{e.name}? is an input of an op: write it among the op's inputs", e.loc)
        elif isinstance(e, Coalesce):
            self.err("?? belongs in a replacement", e.loc)
        elif isinstance(e, ListLit):
            self.err("a list can only be an attribute value", e.loc)
        elif isinstance(e, FuncCall):
            self.err(f"{e.name}(...) is a guard; use it after 'when'", e.loc)

    def optional_input(self, c: OpCall, i: int, a: OptionalVar, first: int):
        if i < first:
            self.err(f"input {i + 1} of {c.op} is required; only its optional inputs can be written {a.name}?",
                     a.loc)
        if a.name in self.values or a.name in self.attrs:
            self.err(f"{a.name!r} is bound twice; an optional input is bound once", a.loc)
        self.values.add(a.name)
        self.optional.add(a.name)

    def attr_pattern(self, e: Expr):
        if isinstance(e, Var):
            self.attrs.add(e.name)
        elif isinstance(e, ListLit):
            for x in e.items:
                if not isinstance(x, (Num, Wildcard, Var)):
                    self.err("attribute lists hold numbers, names or _", x.loc)
                if isinstance(x, Var):
                    self.attrs.add(x.name)
        elif not isinstance(e, (Num, Wildcard)):
            self.err("an attribute pattern is a number, a list, a name or _", e.loc)

    # --- guards ----------------------------------------------------------------------------------------
    def guard(self, g):
        if isinstance(g, FuncCall):
            kind = self.func(g)
            if kind != "bool":
                self.err(f"{g.name}(...) is not a condition; compare it, e.g. {g.name}(...) == 4", g.loc)
        elif isinstance(g, Compare) and g.op == "in":
            if not (isinstance(g.left, FuncCall) and g.left.name == "dtype"):
                self.err("'in' takes dtype(name) on its left, e.g. dtype(x) in [float, float16]", g.loc)
            self.func(g.left)
            for item in g.right.items:
                if not (isinstance(item, Var) and item.name in DTYPE_NAMES):
                    what = item.name if isinstance(item, Var) else "this"
                    self.err(f"unknown dtype {what!r} (known: {', '.join(sorted(DTYPE_NAMES))})", item.loc)
        elif isinstance(g, Compare):
            if any(isinstance(x, FuncCall) and x.name == "dtype" for x in (g.left, g.right)):
                self.err("dtype(...) is compared with 'in', e.g. dtype(x) in [float, float16]", g.loc)
            self.guard_expr(g.left)
            self.guard_expr(g.right)
        else:
            self.err("a guard is a call such as const(w) or a comparison such as rank(x) == 4", g.loc)

    def func(self, f: FuncCall) -> str:
        if f.name not in GUARDS:
            self.err(f"unknown guard {f.name!r} (known: {', '.join(sorted(GUARDS))})", f.loc)
        arity, kind = GUARDS[f.name]
        if (arity is None and not f.args) or (arity is not None and len(f.args) != arity):
            self.err(f"{f.name} takes {'one or more arguments' if arity is None else arity}", f.loc)
        for k, a in enumerate(f.args):
            if f.name == "dim" and k == 1:
                self.guard_expr(a)
                continue
            if not isinstance(a, Var):
                self.err(f"{f.name}(...) takes names bound by the pattern", a.loc)
            if a.name not in self.values:
                self.err(f"{a.name!r} is not bound to a value by the pattern", a.loc)
            if a.name in self.optional and f.name not in GUARDS_OVER_PRESENT:
                self.err(f"{a.name!r} may be absent: only {' and '.join(GUARDS_OVER_PRESENT)} guards take optional "
                         "inputs (they hold for the present ones)", a.loc)
        return kind

    def guard_expr(self, e):
        if isinstance(e, FuncCall):
            self.func(e)
        elif isinstance(e, Var):
            if e.name not in self.attrs and e.name not in self.values:
                self.err(f"{e.name!r} is not bound by the pattern", e.loc)
            if e.name in self.optional:
                self.err(f"{e.name!r} may be absent: only {' and '.join(GUARDS_OVER_PRESENT)} guards take optional "
                         "inputs", e.loc)
        elif isinstance(e, OpCall) and e.op in BINARY_SUGAR or isinstance(e, OpCall) and e.op == "Neg":
            for a in e.args:
                self.guard_expr(a)
        elif isinstance(e, (Num, ListLit, Arith)):
            pass
        else:
            self.err("guards compare numbers, bound names, rank/dim/shape and arithmetic on them", e.loc)

    # --- right side -------------------------------------------------------------------------------------
    def replacement(self, e: Expr):
        if isinstance(e, OpCall):
            self.check_op(e)
            first = first_optional_slot(e.op)
            for i, a in enumerate(e.args):
                self.replacement(a)
                if i >= first and may_be_absent(a, self.optional) and \
                        not all(may_be_absent(x, self.optional) for x in e.args[i + 1:]):
                    self.err(f"input {i + 1} of {e.op} may be absent, but a later input is not: only trailing "
                             "inputs can be left out", getattr(a, "loc", e.loc))
            for _, a in e.attrs:
                self.attr_value(a)
            if e.rest and e.rest not in self.rests:
                self.err(f"..{e.rest} is not bound by the pattern", e.loc)
        elif isinstance(e, Var):
            if e.name not in self.values and e.name not in self.attrs:
                self.err(f"{e.name!r} is not bound by the pattern", e.loc)
        elif isinstance(e, Wildcard):
            self.err("_ cannot appear in a replacement", e.loc)
        elif isinstance(e, ListLit):
            self.err("a list can only be an attribute value", e.loc)
        elif isinstance(e, FuncCall):
            self.err(f"{e.name}(...) is a guard; it cannot build a value", e.loc)
        elif isinstance(e, OptionalVar):
            self.err(f"{e.name}? belongs in a pattern; the replacement uses {e.name}", e.loc)
        elif isinstance(e, Coalesce):
            self.replacement(e.left)
            self.replacement(e.right)
            if not may_be_absent(e.left, self.optional):
                self.err("the left side of ?? is never absent (it uses no optional input, or only as an "
                         "optional input of an op)", e.loc)

    def attr_value(self, e: Expr):
        if isinstance(e, Var):
            if e.name not in self.attrs:
                self.err(f"{e.name!r} is not bound to an attribute by the pattern", e.loc)
        elif isinstance(e, ListLit):
            for x in e.items:
                self.attr_value(x)
        elif isinstance(e, Wildcard):
            self.err("_ cannot appear in a replacement", e.loc)
        elif not isinstance(e, Num):
            self.err("an attribute value is a number, a list or a bound name", e.loc)
