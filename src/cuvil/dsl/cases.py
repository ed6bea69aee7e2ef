"""Optional inputs: what a rule with ``b?`` inputs means in each of its cases.

A pattern input written ``b?`` matches a present input (``b`` bound to it) or an absent one (``b`` bound to
*absent*). The replacement reads an absent ``b`` this way:

* an expression that needs ``b`` in a required input (``b * c``, ``b - mean``) is absent too;
* an absent expression given as an optional trailing input of an op leaves that input out
  (``Conv(x, w2, b * c)`` has no bias when ``b`` is absent);
* ``x ?? y`` is ``x`` where ``x`` is present, else ``y``.

So a rule with optional inputs stands for one plain rule per combination of present and absent optional
inputs (:func:`expand_cases`); the prover proves each such case, and the matcher builds the replacement of
the case it matched (:func:`resolve`), so both read the rule through the same function.
"""
from __future__ import annotations

import functools
import itertools
from typing import FrozenSet, Iterable, List, Optional, Tuple

import attrs
import onnx.defs

from ..errors import UnsupportedOpError
from ..ir.registry import lookup, op_schema
from .ast import Coalesce, Expr, FuncCall, OpCall, OptionalVar, Rule, Var

# Guards that may name an optional input: they hold for the inputs that are present.
GUARDS_OVER_PRESENT = ("const", "single_use")


def optional_names(rule: Rule) -> List[str]:
    """The names bound by ``name?`` pattern inputs, in pattern order."""
    out: List[str] = []

    def walk(e: Expr):
        if isinstance(e, OptionalVar) and e.name not in out:
            out.append(e.name)
        for a in getattr(e, "args", ()):
            walk(a)

    walk(rule.lhs)
    return out


@functools.lru_cache(maxsize=None)
def first_optional_slot(op: str) -> int:
    """The first input position of ``op`` from which every input may be left out (its number of required
    inputs); ops without an ONNX schema (kernel ops) have none."""
    try:
        opdef, schema = lookup(op), op_schema(op)
    except (UnsupportedOpError, onnx.defs.SchemaError):
        return 1 << 30
    lifted = set(opdef.lifted_names.values())
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    required = [i for i, f in enumerate(schema.inputs) if f.option == single and i not in lifted]
    return max(required) + 1 if required else 0


def may_be_absent(e: Expr, optional: Iterable[str]) -> bool:
    """Whether the replacement expression ``e`` is absent for some case of the optional inputs."""
    optional = frozenset(optional)
    if isinstance(e, Var):
        return e.name in optional
    if isinstance(e, Coalesce):
        return may_be_absent(e.right, optional)
    if isinstance(e, OpCall):
        first = first_optional_slot(e.op)
        return any(i < first and may_be_absent(a, optional) for i, a in enumerate(e.args))
    return False


def resolve(e: Expr, absent: FrozenSet[str]) -> Optional[Expr]:
    """``e`` for the case where the optional inputs ``absent`` are absent: None if ``e`` itself is absent,
    else a plain expression (no ``??``), with absent trailing optional inputs of its ops left out."""
    if not absent and not _has_coalesce(e):
        return e
    if isinstance(e, Var):
        return None if e.name in absent else e
    if isinstance(e, Coalesce):
        left = resolve(e.left, absent)
        return left if left is not None else resolve(e.right, absent)
    if isinstance(e, OpCall):
        args = [resolve(a, absent) for a in e.args]
        first = first_optional_slot(e.op)
        if any(a is None and i < first for i, a in enumerate(args)):
            return None
        while args and args[-1] is None:
            args.pop()
        if any(a is None for a in args):  # the validator only lets absent inputs sit at the end
            raise ValueError(f"{e.loc}: an absent input of {e.op} is not its last")
        return attrs.evolve(e, args=tuple(args))
    return e


def _has_coalesce(e: Expr) -> bool:
    return isinstance(e, Coalesce) or any(_has_coalesce(a) for a in getattr(e, "args", ()))


def _pattern_case(e: Expr, absent: FrozenSet[str]) -> Expr:
    if isinstance(e, OptionalVar):
        return Var(e.name, e.loc)
    if isinstance(e, OpCall):
        args = tuple(_pattern_case(a, absent) for a in e.args
                     if not (isinstance(a, OptionalVar) and a.name in absent))
        return attrs.evolve(e, args=args)
    return e


def _guards_case(guards, absent: FrozenSet[str]):
    out = []
    for gd in guards:
        if isinstance(gd, FuncCall) and gd.name in GUARDS_OVER_PRESENT:
            args = tuple(a for a in gd.args if not (isinstance(a, Var) and a.name in absent))
            if args:
                out.append(attrs.evolve(gd, args=args))
        else:
            out.append(gd)
    return tuple(out)


def _trailing(e: Expr, absent: FrozenSet[str]) -> bool:
    """Whether, in every op of the pattern, the absent optional inputs come after the present ones."""
    if not isinstance(e, OpCall):
        return True
    opt = [a.name in absent for a in e.args if isinstance(a, OptionalVar)]
    if any(gone and not later for k, gone in enumerate(opt) for later in opt[k + 1:]):
        return False
    return all(_trailing(a, absent) for a in e.args)


def case_label(absent: FrozenSet[str], optional: List[str]) -> str:
    return ", ".join(f"{n} {'absent' if n in absent else 'present'}" for n in optional)


def expand_cases(rule: Rule) -> List[Tuple[str, Rule]]:
    """(label, plain rule) for each combination of present and absent optional inputs where the absent ones of
    an op come after its present ones (all present first); a rule without optional inputs is its own single
    case (label "")."""
    optional = optional_names(rule)
    if not optional:
        return [("", rule)]
    out = []
    for flags in itertools.product((False, True), repeat=len(optional)):
        absent = frozenset(n for n, f in zip(optional, flags) if f)
        if not _trailing(rule.lhs, absent):
            continue  # the matcher never binds such a case (see cuvil.dsl.compiler)
        label = case_label(absent, optional)
        out.append((label, attrs.evolve(rule, lhs=_pattern_case(rule.lhs, absent),
                                        guards=_guards_case(rule.guards, absent), rhs=resolve(rule.rhs, absent),
                                        text=f"{rule.text}\n# case: {label}")))
    return out
