"""``cuvil verify``: fuzz an optimized model against the original through onnx.reference.

Hypothesis draws inputs (symbolic dims inside their ranges); the optimized model must agree bit for bit
when only ``prove exact`` rules fired, and within :data:`cuvil.testing.rules.REAL_RTOL` otherwise. On a
difference Hypothesis shrinks the input to a minimal one, which is reported.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import attrs
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from .artifact import load
from .dsl.parser import load_rules
from .ir.dim import SymExpr
from .pipeline import Pipeline
from .rewrite_rules.verdicts import builtin_rules
from .testing.rules import REAL_RTOL
from .testing.strategies import inputs_for


@attrs.define
class VerifyResult:
    examples: int
    exact: bool                         # only exact rules fired: compared bit for bit
    rules_fired: Dict[str, int]
    failure: Optional[str] = None       # the message, with the minimal failing input
    failing_input: Optional[Dict[str, np.ndarray]] = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def compare(want: np.ndarray, got: np.ndarray, exact: bool, rtol: float = REAL_RTOL) -> Optional[str]:
    if want.shape != got.shape or want.dtype != got.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    if exact:
        if want.dtype.kind == "f":
            same = (want.view(f"u{want.itemsize}") == got.view(f"u{got.itemsize}")) | (np.isnan(want) & np.isnan(got))
        else:
            same = want == got
        if not np.all(same):
            i = tuple(np.argwhere(~same)[0])
            return f"bits differ at {list(i)}: original {want[i]!r}, optimized {got[i]!r}"
        return None
    finite = np.isfinite(want)
    if not finite.any():
        return None
    scale = max(float(np.max(np.abs(want[finite]))), 1.0)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    err[~finite] = 0
    if np.max(err) > rtol * scale:
        i = tuple(np.unravel_index(int(np.argmax(err)), err.shape))
        return f"error {err[i]:.3g} at {list(i)} over tolerance {rtol} x {scale:.3g}: original {want[i]!r}, optimized {got[i]!r}"
    return None


def verify(source, *, rules: Sequence = (), examples: int = 50, seed: Optional[int] = 0, max_dim: int = 4) -> VerifyResult:
    src = source if isinstance(source, Pipeline) else Pipeline.from_onnx(source)
    opt = src.optimize(rules=list(rules) or None)
    obligations = {r.name: r.proof for r in builtin_rules() + (load_rules(list(rules)) if rules else [])}
    fired = {k: v for k, v in opt.report.applied.items() if v}
    exact = all(obligations.get(name) == "exact" for name in fired)
    state = {"n": 0, "fail": None, "input": None}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(feeds=inputs_for(src, max_dim=max_dim, special=exact))
    def check(feeds):
        state["n"] += 1
        want, got = src.run_reference(feeds), opt.run_reference(feeds)
        for name in src.graph.output_names:
            msg = compare(want[name], got[name], exact)
            if msg:
                state["fail"], state["input"] = f"output {name!r}: {msg}", feeds
                raise AssertionError(msg)

    try:
        check()
    except AssertionError:
        pass  # the last failure recorded is Hypothesis's shrunk, minimal one
    except Unsatisfiable:
        pass
    return VerifyResult(state["n"], exact, fired, state["fail"], state["input"])


# Native kernels reassociate reductions and contract multiply-adds: compiled outputs are compared with
# the original through onnx.reference within this relative tolerance (of the output's largest magnitude).
NATIVE_RTOL = 1e-4


def verify_artifact(source, library: str, *, examples: int = 30, seed: Optional[int] = 0,
                    max_dim: int = 4, num_threads: int = 0) -> VerifyResult:
    """Fuzz a compiled library against the *original* model through onnx.reference (finite inputs of the
    library's shapes; a symbolic dim inside the library's profile, at most ``max_dim`` where the profile allows);
    a difference is shrunk to a minimal input. ``num_threads``: the library's threads (0 = all cores)."""
    src = source if isinstance(source, Pipeline) else Pipeline.from_onnx(source)
    lib = load(library, num_threads=num_threads)
    # Inputs take the library's shapes: a dim it fixed at that value, a symbol inside the library's own profile
    # (the source model's symbols carry no range).
    fixed = {}
    for v, spec in zip(src.graph.inputs, lib.inputs):
        for d, n in zip(v.shape or (), spec.shape):
            if n is not None and isinstance(d, SymExpr) and str(d) in src.graph.symbols:
                fixed[str(d)] = int(n)
    drawn = src.specialize(fixed) if fixed else src
    profiles = {name: (p.min, p.max) for name, p in lib.symbols.items() if name in drawn.graph.symbols}
    drawn = drawn.with_profiles(profiles, check=False) if profiles else drawn
    state = {"n": 0, "fail": None, "input": None}

    @st.composite
    def feeds(draw):
        return draw(inputs_for(drawn, max_dim=max_dim))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(f=feeds())
    def check(f):
        state["n"] += 1
        want = src.run_reference(f)
        got = dict(zip([o.name for o in lib.outputs], lib.run(**f)))
        for name in src.graph.output_names:
            w, g = want[name], got[name]
            msg = compare(w, g, exact=False, rtol=NATIVE_RTOL)
            if msg:
                state["fail"], state["input"] = f"output {name!r}: {msg}", f
                raise AssertionError(msg)

    try:
        check()
    except AssertionError:
        pass
    return VerifyResult(state["n"], False, {}, state["fail"], state["input"])
