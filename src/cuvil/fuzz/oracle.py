"""What every ONNX fuzz case checks: import, optimize, export, and (for a graph that runs) the optimized
graph against an independent oracle on random inputs.

The oracle is onnxruntime on the original model bytes where onnxruntime accepts the model (that covers the
import as well as the rewrites), else ``onnx.reference`` on the imported, unoptimized graph.
"""
from __future__ import annotations

import math
import os
import traceback
from typing import Dict, Optional, Tuple, Union

import numpy as np
import onnx

from ..errors import CuvilError
from ..frontend import export_model
from ..frontend.onnx_import import sparse_to_dense
from ..ir.constraints import first_violation_at
from ..ir.dim import evaluate
from ..ir.dtype import DType
from ..ir.graph import Graph
from ..ir.hash import structural_hash
from ..ir.printer import print_graph
from ..pipeline import Pipeline
from ..reference import run_reference
from .report import ACCEPTED, CLEAN_ERROR, FOREIGN, WRONG

RTOL, ATOL = 1e-3, 1e-4
# Every compile_every-th accepted case is also compiled to an x86 library and run (0: never).
COMPILE_EVERY = int(os.environ.get("CUVIL_FUZZ_COMPILE_EVERY", "0"))


def foreign(e: BaseException) -> Tuple[str, str]:
    """A non-Cuvil exception, with where it came from (the few innermost frames)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-4:]))
    return FOREIGN, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} | {where}"


def symbol_values(g: Graph) -> Dict[str, int]:
    """The value random inputs give each symbol: 2, or its range's nearest value."""
    return {name: min(max(2, s.min), s.max) for name, s in g.symbols.items()}


def random_inputs(g: Graph, rng: np.random.Generator) -> Optional[Dict[str, np.ndarray]]:
    """Inputs for every graph input (symbolic dims set by :func:`symbol_values`), or None."""
    env = symbol_values(g)
    feeds = {}
    for v in g.inputs:
        if v.shape is None:
            return None
        try:
            shape = tuple(d if isinstance(d, int) else evaluate(d, env) for d in v.shape)
        except Exception:  # noqa: BLE001 - a derived dim the symbol values do not satisfy
            return None
        if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape) or math.prod(shape) > 1 << 20:
            return None
        dt = v.dtype
        if dt == DType.BFLOAT16:  # the oracle's tolerances are for float16/32/64: no oracle run for bfloat16
            return None
        if dt.is_float:
            feeds[v.name] = rng.standard_normal(shape).astype(dt.numpy)
        elif dt.is_int:
            feeds[v.name] = rng.integers(0, 3, shape).astype(dt.numpy)
        elif dt.name == "BOOL":
            feeds[v.name] = rng.random(shape) < 0.5
        else:
            return None
    return feeds


def _ort(model_bytes: bytes, feeds) -> Optional[list]:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    try:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        opts.log_severity_level = 4
        sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        if sorted(names) != sorted(feeds):
            return None
        return sess.run(None, feeds)
    except Exception:  # noqa: BLE001 - onnxruntime refusing a mutated model only means no oracle
        return None


def disagreement(want, got) -> Optional[str]:
    """Why two output arrays differ beyond float tolerance (NaN positions must match), or None."""
    want, got = np.asarray(want), np.asarray(got)
    if want.shape != got.shape:
        return f"shape {got.shape} where the oracle has {want.shape}"
    if want.dtype.kind in "fc" or got.dtype.kind in "fc":
        w, g = want.astype(np.float64), got.astype(np.float64)
        if not np.array_equal(np.isnan(w), np.isnan(g)):
            return "NaN at different positions"
        ok = np.isclose(w, g, rtol=RTOL, atol=ATOL, equal_nan=True) | (w == g)
        if not ok.all():
            k = int(np.argmin(ok.reshape(-1)))
            return f"element {k}: {g.reshape(-1)[k]!r} where the oracle has {w.reshape(-1)[k]!r}"
        return None
    if not np.array_equal(want, got):
        return "integer or boolean elements differ"
    return None


def check_model(source: Union[bytes, onnx.ModelProto], seed: int) -> Tuple[str, str]:
    """One case: the outcome (report.py's vocabulary) and a one-line message."""
    rng = np.random.default_rng(seed)
    try:
        p = Pipeline.from_onnx(source)
        q = p.optimize()
        export_model(q.graph)
        print_graph(q.graph)
        structural_hash(q.graph)
        feeds = random_inputs(p.graph, rng)
    except CuvilError as e:
        return CLEAN_ERROR, str(e)
    except Exception as e:  # noqa: BLE001 - any other exception is what the fuzzer looks for
        return foreign(e)
    if feeds is None:
        return ACCEPTED, "no random inputs for this signature"
    env = symbol_values(p.graph)
    broken = first_violation_at(p.graph, env) or first_violation_at(q.graph, env)
    if broken:
        # Import recorded a shape condition these symbol values break (compile and check_shapes refuse them):
        # Cuvil said so, and no output is defined to compare.
        return CLEAN_ERROR, f"shape conditions fail for the chosen symbol values: {broken}"
    model_bytes = source if isinstance(source, bytes) else source.SerializeToString()
    want = _ort(model_bytes, feeds)
    original = onnx.load_from_string(model_bytes)
    if want is not None:
        want = dict(zip([o.name for o in original.graph.output], want))
    else:
        try:
            want = p.run_reference(feeds)
        except Exception:  # noqa: BLE001 - no oracle for a graph the reference cannot run
            return ACCEPTED, "no oracle"
    try:
        got = q.run_reference(feeds)
    except CuvilError as e:
        return CLEAN_ERROR, str(e)
    except Exception as e:  # noqa: BLE001
        # Where onnx.reference cannot run the imported graph either (its own limits, such as empty dims), it is
        # no oracle for this input; only a graph that ran before optimizing and fails after it is wrong.
        try:
            p.run_reference(feeds)
        except Exception:  # noqa: BLE001
            return ACCEPTED, "onnx.reference cannot run this graph before or after optimization"
        return WRONG, f"the oracle runs the model, the optimized graph fails in onnx.reference: {foreign(e)[1]}"
    why = _compare(want, got)
    if why and _reference_agrees(original, feeds, got):
        # onnxruntime and onnx.reference differ on this model (e.g. a mean over an empty axis: NaN in the
        # reference, 0 in onnxruntime) and Cuvil computes what the reference computes: not Cuvil's error.
        return ACCEPTED, f"onnxruntime differs from onnx.reference here ({why})"
    if why:
        return WRONG, why
    if COMPILE_EVERY and seed % COMPILE_EVERY == 0:
        return _check_compiled(q, feeds, got)
    return ACCEPTED, ""


def _compare(want, got) -> Optional[str]:
    for name, w in want.items():
        if name not in got:
            return f"output {name!r} is missing"
        why = disagreement(w, got[name])
        if why:
            return f"output {name!r}: {why}"
    return None


def _densified(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with sparse initializers made dense (onnx.reference does not read them)."""
    if not model.graph.sparse_initializer:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for sp in m.graph.sparse_initializer:
        m.graph.initializer.append(onnx.numpy_helper.from_array(sparse_to_dense(sp), sp.values.name))
    del m.graph.sparse_initializer[:]
    return m


def _reference_agrees(original: onnx.ModelProto, feeds, got) -> bool:
    try:
        original = _densified(original)
        ref = dict(zip([o.name for o in original.graph.output], run_reference(original, feeds)))
    except Exception:  # noqa: BLE001 - the reference cannot run the original: no second opinion
        return False
    return _compare(ref, got) is None


def _check_compiled(q: Pipeline, feeds, want) -> Tuple[str, str]:
    try:
        art = q.compile(target="x86_64-linux-gnu", opt_level=1)
        got = art.run(feeds)
    except CuvilError as e:
        return CLEAN_ERROR, f"compile: {e}"
    except Exception as e:  # noqa: BLE001
        return foreign(e)
    for name, w in want.items():
        why = disagreement(w, got.get(name))
        if why:
            return WRONG, f"compiled output {name!r}: {why}"
    return ACCEPTED, "compiled"
