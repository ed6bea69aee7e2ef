"""Commutativity of Add and Mul, proved by Z3 per element-type domain, before the matcher may use it.

The matcher tries the operands of an ``Add`` or ``Mul`` pattern node in both orders (``cuvil.dsl.compiler``),
so a rule proved for ``Add(Mul(a, b), c)`` also rewrites ``Add(c, Mul(a, b))``. That instance is justified
by the rule's proof only together with ``Add(c, m) = Add(m, c)`` in the semantics the rule was proved in:
for a ``prove real`` rule over the reals, for a ``prove exact`` rule bit for bit in every element type its
proof covers. These facts are obligations like any rule's: :func:`prove_fact` proves each (op, domain) once
with Z3, and the verdicts are cached with the rules' (shipped in ``rules/verdicts.json``).

What "exact" means here is what it means for every exact rule: equal as SMT-LIB floating-point values,
where +0 and -0 differ and there is a single NaN. IEEE 754 does not fix the payload of a NaN result, and
hardware may pick either operand's payload depending on the order, so a commuted Add may return a NaN with
another payload; that difference is outside the prover's model for every rule alike (and onnxruntime, like
our kernels, commutes these operations freely). Integer Add and Mul wrap modulo 2^n (as numpy and ONNX
compute them): commutative in every width, proved on bit-vectors.

Max and Min are not commutative in this sense (``np.maximum`` returns its second argument on ties of +0
and -0, and which NaN it returns depends on the order), so the matcher never swaps their operands.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, Tuple

import z3

from ..ir.registry import ops_with
from . import semantics as sem

COMMUTATIVE_OPS = tuple(sorted(ops_with("commutative")))   # Add, Mul
FACTS_VERSION = "1"
FACT_TIMEOUT_MS = 120_000  # proved once and cached: Z3's float64 multiplier takes seconds
INT_WIDTHS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8, "uint16": 16, "uint32": 32,
              "uint64": 64}
# Every domain a rule's proof may cover: the reals (``prove real``), the IEEE formats, the integer types.
DOMAINS = ("real", "float", "float16", "bfloat16", "double") + tuple(INT_WIDTHS)


def fact_key(op: str, domain: str) -> str:
    """The cache key of a fact (versions included, so changed semantics prove it again)."""
    return f"commutes:{op}:{domain}:{sem.SEMANTICS_VERSION}:{FACTS_VERSION}"


def _operands(domain: str):
    if domain == "real":
        return sem.RealDomain(), z3.Reals("a b")
    if domain in INT_WIDTHS:
        return None, z3.BitVecs("a b", INT_WIDTHS[domain])
    dom = sem.FP32Domain() if domain == "float" else sem.FPDomain(domain, *sem.FP_FORMATS[domain])
    return dom, (z3.FP("a", dom.sort), z3.FP("b", dom.sort))


def prove_fact(op: str, domain: str, timeout_ms: int = FACT_TIMEOUT_MS) -> dict:
    """Z3's verdict on ``op(a, b) = op(b, a)`` for every a, b of ``domain``: a JSON-ready record."""
    t0 = time.perf_counter()
    dom, (a, b) = _operands(domain)
    if dom is None:  # integers: wrapping bit-vector arithmetic
        ab, ba = (a + b, b + a) if op == "Add" else (a * b, b * a)
        same = ab == ba
    else:
        fn = dom.add if op == "Add" else dom.mul
        same = dom.equal(fn(a, b), fn(b, a))
    s = z3.Solver()
    s.set("timeout", int(timeout_ms))
    s.add(z3.Not(same))
    res = s.check()
    status = "proved" if res == z3.unsat else "refuted" if res == z3.sat else "unknown"
    return {"fact": f"{op}(a, b) = {op}(b, a)", "domain": domain, "status": status,
            "ms": round(1e3 * (time.perf_counter() - t0), 1)}


def all_facts(timeout_ms: int = FACT_TIMEOUT_MS) -> Dict[str, dict]:
    """Every (op, domain) fact proved from scratch, by key."""
    return {fact_key(op, d): prove_fact(op, d, timeout_ms) for op in COMMUTATIVE_OPS for d in DOMAINS}


def domains_of(proof: str, dtypes: Iterable[str], every_type: bool) -> Tuple[str, ...]:
    """The domains a rule's matches live in: the reals for ``prove real``; for ``prove exact`` the element
    types its proof covers (``every_type``: a data-movement rule, every domain)."""
    if proof == "real":
        return ("real",)
    if every_type:
        return DOMAINS[1:]
    return tuple(dtypes)
