"""``.rule`` text, mutated from the built-in rules and generated at random from the grammar
(src/cuvil/dsl/rule.lark), run through parse, validation and the prover with a small Z3 timeout.

A case passes when the text is refused with a RuleError (or another CuvilError) or every rule gets a
verdict; any other exception, a crash or a hang is a finding."""
from __future__ import annotations

import functools
import re
from typing import List, Tuple

import numpy as np

from ..dsl.parser import parse_rules
from ..errors import CuvilError
from ..ir.registry import all_ops
from ..rewrite_rules.prove import prove_rule
from ..rewrite_rules.verdicts import builtin_rules
from .oracle import foreign
from .report import ACCEPTED, CLEAN_ERROR, FamilyReport
from .sandbox import run_cases

NAME = "rule_text"
TIMEOUT_S = 60.0
Z3_TIMEOUT_MS = 300
MAX_RULES_PROVED = 2

_TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|\.\.|=>|==|!=|<=|>=|.")
_KEYWORDS = ["rule", "benefit", "on", "graph", "kernel", "x86", "when", "and", "prove", "exact", "real", "bogus"]
_GUARDS = ["const", "rank", "dim", "shape", "single_use", "is_float", "nope"]
_PUNCT = ["(", ")", ",", "=>", "[", "]", "..", "=", "==", "!=", "<", ">=", "+", "-", "*", "/", "_", "\n", "#", "é", "\x00"]
_NUMBERS = ["0", "-0.0", "1", "2", "0.5", "1e38", "3.4e39", "1e-45", "inf", "nan", "999999999999999999999", "-1", "007"]
_UNARY = ["Relu", "Neg", "Abs", "Sqrt", "Exp", "Log", "Sigmoid", "Tanh", "Floor", "Ceil", "Reciprocal", "Identity"]
_BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"]
_STRUCT = [("Transpose", "perm=[1, 0]"), ("Softmax", "axis=-1"), ("ReduceSum", "keepdims=1"), ("Flatten", "axis=1"),
           ("Unsqueeze", "axes=[0]"), ("Squeeze", "axes=[0]"), ("LeakyRelu", "alpha=a"), ("Clip", "..r"),
           ("Conv", "pads=[1, 0, 1, 0]"), ("MaxPool", "kernel_shape=[2, 2]"), ("Reshape", "shape=[-1]")]


@functools.lru_cache(maxsize=None)
def _seed_texts() -> List[str]:
    return [r.text for r in builtin_rules() if r.text]


@functools.lru_cache(maxsize=None)
def _op_names() -> List[str]:
    return sorted(all_ops())


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _expr(rng, depth: int, vars_: List[str]) -> str:
    k = int(rng.integers(6)) if depth > 0 else 0
    if k == 0:
        return _pick(rng, vars_ + _NUMBERS[:6] + ["_"])
    if k == 1:
        return f"{_pick(rng, _UNARY)}({_expr(rng, depth - 1, vars_)})"
    if k == 2:
        return f"{_pick(rng, _BINARY)}({_expr(rng, depth - 1, vars_)}, {_expr(rng, depth - 1, vars_)})"
    if k == 3:
        op, attr = _pick(rng, _STRUCT)
        return f"{op}({_expr(rng, depth - 1, vars_)}, {attr})"
    if k == 4:
        return f"{_expr(rng, depth - 1, vars_)} {_pick(rng, ['+', '-', '*', '/'])} {_expr(rng, depth - 1, vars_)}"
    return f"{_pick(rng, _op_names())}({', '.join(_expr(rng, depth - 1, vars_) for _ in range(int(rng.integers(0, 3))))})"


def generate(rng) -> str:
    """A random rule from the grammar: mostly well-formed, with names the registry knows."""
    vars_ = ["x", "y", "w"][: int(rng.integers(1, 4))]
    lhs = _expr(rng, int(rng.integers(1, 4)), vars_)
    if "(" not in lhs:
        lhs = f"{_pick(rng, _UNARY)}({lhs})"
    guards = []
    for _ in range(int(rng.integers(0, 3))):
        v = _pick(rng, vars_)
        guards.append(_pick(rng, [f"rank({v}) >= {int(rng.integers(0, 4))}", f"const({v})", f"single_use({v})",
                                  f"dim({v}, {int(rng.integers(-1, 3))}) == {int(rng.integers(1, 4))}",
                                  f"shape({v}) == shape({_pick(rng, vars_)})", f"a > {_pick(rng, _NUMBERS)}"]))
    when = f"\n  when {', '.join(guards)}" if guards else ""
    benefit = f" benefit {int(rng.integers(0, 20))}" if rng.random() < 0.3 else ""
    on = f" on {_pick(rng, ['graph', 'kernel', 'x86'])}" if rng.random() < 0.15 else ""
    return (f"rule g{int(rng.integers(1 << 30))}{benefit}{on}\n  {lhs}{when}\n  => {_expr(rng, int(rng.integers(0, 3)), vars_)}"
            f"\n  prove {_pick(rng, ['exact', 'real'])}\n")


def mutate(rng, text: str) -> str:
    tokens = _TOKEN.findall(text)
    for _ in range(int(rng.integers(1, 5))):
        if not tokens:
            break
        k = int(rng.integers(len(tokens)))
        kind = int(rng.integers(6))
        if kind == 0:
            del tokens[k]
        elif kind == 1:
            tokens.insert(k, tokens[k])
        elif kind == 2:
            tokens[k] = _pick(rng, _op_names())
        elif kind == 3:
            tokens[k] = _pick(rng, _NUMBERS)
        elif kind == 4:
            tokens[k] = _pick(rng, _KEYWORDS + _GUARDS)
        else:
            tokens.insert(k, _pick(rng, _PUNCT))
    return "".join(tokens)


_NUMBER = re.compile(r"(?<![A-Za-z_0-9.])[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?")


def mutate_values(rng, text: str) -> str:
    """Numbers (attribute values, guard bounds, constants) replaced, so the rule still parses and validates
    and reaches the prover with odd values: negative pads, huge axes, NaN constants."""
    pool = _NUMBERS + ["-1", "-2", "3", "4", "8", "65536", "2147483648"]

    def sub(m):
        return _pick(rng, pool) if rng.random() < 0.5 else m.group(0)
    body = text.split("\n", 1)
    return body[0] + "\n" + _NUMBER.sub(sub, body[1]) if len(body) == 2 else text


def make_text(seed: int) -> str:
    rng = np.random.default_rng(seed)
    seeds = _seed_texts()
    kind = int(rng.integers(12))
    if kind >= 10:
        return mutate_values(rng, _pick(rng, seeds))
    if kind < 4:
        return mutate(rng, _pick(rng, seeds))
    if kind < 8:
        text = generate(rng)
        return mutate(rng, text) if rng.random() < 0.3 else text
    if kind == 8:
        a, b = _pick(rng, seeds), _pick(rng, seeds)
        return a[: int(rng.integers(len(a) + 1))] + b[int(rng.integers(len(b) + 1)):]
    depth = int(rng.integers(50, 3000))
    op = _pick(rng, _UNARY)
    return f"rule deep\n  {op}(" * 1 + f"{op}(" * depth + "x" + ")" * (depth + 1) + " => x\n  prove exact\n"


def case(seed: int) -> Tuple[str, str]:
    text = make_text(seed)
    try:
        rules = parse_rules(text, f"<fuzz {seed}>")
        for r in rules[:MAX_RULES_PROVED]:
            prove_rule(r, timeout_ms=Z3_TIMEOUT_MS)
    except CuvilError as e:
        return CLEAN_ERROR, str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001
        return foreign(e)
    return ACCEPTED, ""


def run(budget: int, seed: int, *, timeout_s: float = TIMEOUT_S, progress=None) -> FamilyReport:
    _seed_texts()
    _op_names()
    return run_cases(NAME, case, budget, seed, timeout_s, progress)
