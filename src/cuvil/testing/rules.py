"""Property testing of rewrite rules: instantiate a rule's pattern as a model with random values, run it
before and after the rule, and compare (bit for bit for ``prove exact``, within a tolerance for
``prove real``). The shapes are those the prover found, or any shape for elementwise rules."""
from __future__ import annotations

import functools
from typing import Dict, Tuple

import attrs
import numpy as np
import onnx
from hypothesis import reject
from hypothesis import strategies as st

from ..dsl.ast import FuncCall, OpCall, Rule, Var
from ..dsl.cases import expand_cases
from ..errors import CuvilError
from ..frontend.onnx_export import export_model
from ..frontend.onnx_import import import_model
from ..ir.graph import Graph
from ..reference import run_reference
from ..ir.types import TensorType
from ..rewrite_rules.engine import RewriteReport, rewrite
from ..rewrite_rules.prove import (BOUNDED_INSTANCES, BOUNDED_MAX_DIM, BOUNDED_MAX_ELEMS, SEED, _build_lhs,
                                    _float_attr_vars, draw_instances, elementwise_instance, is_elementwise,
                                    search_instances, var_kinds)
from .strategies import float_arrays, shapes

# ``prove real`` rules change rounding: outputs must agree to this relative tolerance (of the output's
# largest magnitude), on finite inputs where the original is finite.
REAL_RTOL = 1e-4


@st.composite
def rule_cases(draw, rule: Rule) -> Tuple[onnx.ModelProto, Dict[str, np.ndarray]]:
    """A model computing ``rule``'s pattern on random values, and its inputs (for a rule with optional inputs,
    the pattern of one of its cases, drawn: with and without the bias ...)."""
    rule = draw(st.sampled_from([case for _, case in expand_cases(rule)]))
    if is_elementwise(rule):
        base = elementwise_instance(rule)
        shape = draw(shapes(0, 3, 1, 3))
        inst = attrs.evolve(base, shapes={k: shape for k in base.shapes}, wild={k: shape for k in base.wild})
        if not _builds(rule, inst):
            # scalar-only inputs (Dropout's ratio and training_mode): only first inputs take the shape
            firsts = {c.args[0].name for c in _calls(rule.lhs) if c.args and isinstance(c.args[0], Var)}
            inst = attrs.evolve(inst, shapes={k: (shape if k in firsts else ()) for k in inst.shapes})
    else:
        found = _instances(rule)
        if not found:
            raise ValueError(f"rule {rule.name}: no instance to test")
        inst = draw(st.sampled_from(found))
    exact = rule.proof == "exact"
    fattrs = {name: draw(st.floats(0.0625, 2.0, width=32)) for name in _float_attr_vars(rule)}
    inst = attrs.evolve(inst, attrs={**inst.attrs, **fattrs})
    kinds = var_kinds(rule)
    consts = {a.name for gd in rule.guards if isinstance(gd, FuncCall) and gd.name == "const"
              for a in gd.args if isinstance(a, Var)}
    g = Graph(name=rule.name)
    vals, feeds = {}, {}
    for name, shape in inst.shapes.items():
        if kinds.get(name) == "bool":
            n = int(np.prod(shape))
            arr = np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool).reshape(shape)
        else:
            arr = draw(float_arrays(shape, special=exact))
        if name in consts:
            vals[name] = g.const(arr, name)
        else:
            vals[name] = g.add_input(name, TensorType(9 if arr.dtype == bool else 1, shape))
            feeds[name] = arr
    try:
        root = _build_lhs(rule.lhs, g, vals, inst)
    except CuvilError:
        reject()  # values the op refuses (a Dropout ratio outside [0, 1)): not an instance
    for v in g.inputs:  # wildcards became inputs too
        if v.name not in feeds:
            feeds[v.name] = draw(float_arrays(tuple(v.shape), special=exact))
    g.add_output(root, g.fresh_name("out"))
    return export_model(g), feeds


@functools.lru_cache(maxsize=None)
def _instances(rule: Rule) -> Tuple:
    """The instances the prover checks a bounded rule on (the deterministic search, then random drawing from a
    fixed seed): the search alone finds none for a chain of four MatMul-shaped constants (the LoRA merge rules).
    Both are functions of the rule alone, so they are found once per process, not once per drawn example
    (drawing took ~0.8 s of CPU per example of a LoRA merge rule, most of its property test)."""
    return tuple(search_instances(rule) or draw_instances(rule, np.random.default_rng(SEED + 1), BOUNDED_INSTANCES,
                                                          BOUNDED_MAX_DIM, BOUNDED_MAX_ELEMS))


def _calls(e):
    if isinstance(e, OpCall):
        yield e
        for a in e.args:
            yield from _calls(a)


def _builds(rule: Rule, inst) -> bool:
    g = Graph()
    vals = {k: g.add_input(k, TensorType(1, s)) for k, s in inst.shapes.items()}
    try:
        _build_lhs(rule.lhs, g, vals, inst)
        return True
    except CuvilError:
        return False


def check_rule_case(rule: Rule, model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> RewriteReport:
    """Apply ``rule`` to ``model`` and compare outputs; raises AssertionError when they differ.

    Returns the report (``applied[rule.name]`` says whether the rule fired)."""
    want = run_reference(model, feeds)[0]
    g = import_model(model)
    report = rewrite(g, [rule])
    got = run_reference(export_model(g), feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    if rule.proof == "exact":
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)) \
            if want.dtype == np.float32 else got == want
        assert np.all(same), f"rule {rule.name} changed bits: {want} -> {got}"
    else:
        finite = np.isfinite(want)
        scale = float(np.max(np.abs(want[finite]))) if finite.any() else 0.0
        err = np.abs(got[finite] - want[finite])
        assert np.all(err <= REAL_RTOL * max(scale, 1.0)), \
            f"rule {rule.name}: max abs error {err.max()} over tolerance {REAL_RTOL} x {max(scale, 1.0)}"
    return report
