"""An ``onnx.backend`` for Cuvil: ONNX's backend API (``prepare`` / ``run`` / ``run_node``) over native
compilation.

    from cuvil.onnx_backend import backend
    rep = backend.prepare(model)              # imports and optimises; compiles at the first run
    (y,) = rep.run([x])                        # inputs in graph-input order (or a dict by name)

Every run executes a library built by ``Pipeline.from_onnx(model).optimize().compile(...)``; nothing is
interpreted (no onnx.reference, no onnxruntime). Graph inputs that have an initializer are constants.

Cuvil compiles for static shapes, so a prepared model is specialised at run time, lazily, once per
*signature* (cached in the rep):

* inputs with symbolic dims take the shapes of the arrays actually given;
* inputs whose *values* decide shapes or attributes (a Reshape's target shape, Slice's starts, a
  Reduce's axes, TopK's k, Resize's scales, ... directly or through a chain of nodes; see
  :func:`value_specialized_inputs`) are compiled in as constants, so the signature includes their
  values. A model that keeps such tensors as initializers (the usual export) has none.

Anything Cuvil cannot compile raises :class:`cuvil.errors.UnsupportedOpError` (ops, attribute values,
element types) or another :class:`cuvil.errors.CuvilError`; never a crash.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from .errors import CuvilError, ShapeError, UnsupportedOpError
from .frontend import load_model
from .ir.dim import SymExpr
from .ir.dtype import DType
from .ir.registry import all_ops, ops_with
from .pipeline import Pipeline

__all__ = ["CuvilBackend", "CuvilBackendRep", "backend", "prepare", "run_model", "run_node", "supports_device"]

#: Element types the x86 backend computes in; others (strings, complex, ...) are refused up front
#: with UnsupportedOpError. float16 is computed in float16 (sums accumulate in float32), bfloat16 in float32;
#: float8, float4 and 2/4-bit integers are stored one per byte (targets/llvm/narrow.py).
SUPPORTED_DTYPES = frozenset({DType.FLOAT, DType.DOUBLE, DType.FLOAT16, DType.INT8, DType.UINT8, DType.INT16, DType.UINT16,
                              DType.INT32, DType.UINT32, DType.INT64, DType.UINT64, DType.BOOL, DType.BFLOAT16,
                              DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2, DType.FLOAT8E5M2FNUZ,
                              DType.FLOAT4E2M1, DType.FLOAT8E8M0, DType.INT4, DType.UINT4, DType.INT2, DType.UINT2})


def _dtype_name(code: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(code)
    except ValueError:
        return str(code)


def _check_value_dtypes(model: onnx.ModelProto) -> None:
    """UnsupportedOpError for an input, output or initializer of an element type the backend lacks."""
    g = model.graph
    typed = [("input", vi) for vi in g.input] + [("output", vi) for vi in g.output]
    for what, vi in typed:
        kind = vi.type.WhichOneof("value")
        if kind is None and what == "output":
            continue  # an output left for inference to type
        if kind != "tensor_type":
            kind = kind or "untyped value"
            raise UnsupportedOpError("<graph>", vi.name, detail=f"graph {what} {vi.name!r} is a {kind}; only tensors are supported")
        code = vi.type.tensor_type.elem_type
        if code and _unsupported_code(code):
            raise UnsupportedOpError("<graph>", vi.name, detail=f"graph {what} {vi.name!r} has element type "
                                     f"{_dtype_name(code)}, which the x86 backend does not support")
    for t in g.initializer:
        if _unsupported_code(t.data_type):
            raise UnsupportedOpError("<graph>", t.name, detail=f"initializer {t.name!r} has element type "
                                     f"{_dtype_name(t.data_type)}, which the x86 backend does not support")


def _dtype_of(a: np.ndarray) -> Optional[DType]:
    """The Cuvil element type of an array (ml_dtypes' types included); None when there is none."""
    try:
        return DType.from_numpy(a.dtype)
    except TypeError:
        return None


def _unsupported_code(code: int) -> bool:
    try:
        return DType(code) not in SUPPORTED_DTYPES
    except ValueError:
        return True


# Inputs whose *values* (not only shapes) decide output shapes or the op's meaning: (op, input index).
# The lifted int64 positions of the op registry (Reshape's shape, Slice's starts, Reduce*'s axes, TopK's k,
# ...) plus these.
_EXTRA_VALUE_POSITIONS = {
    "Resize": (1, 2, 3), "Upsample": (1,), "Range": (0, 1, 2), "Compress": (1,), "MaxUnpool": (2,),
    "Dropout": (1, 2), "EyeLike": (), "CenterCropPad": (1,), "Col2Im": (1, 2), "DFT": (1, 2),
    "STFT": (1, 3), "HannWindow": (0,), "HammingWindow": (0,), "BlackmanWindow": (0,),
    "Loop": (0, 1),  # the trip count and the initial condition: loops are unrolled at compile time
    "MelWeightMatrix": (0, 1, 2, 3, 4),
}
# Ops whose output depends on their input's shape only: value dependence stops there.
_SHAPE_ONLY = ops_with("shape_only")


def _value_positions(op: str) -> Tuple[int, ...]:
    d = all_ops().get(op)
    out = set(_EXTRA_VALUE_POSITIONS.get(op, ()))
    if d is not None:
        out |= {idx for _, idx, kind in d.lifted if kind == "i64"}
    return tuple(sorted(out))


def value_specialized_inputs(model: onnx.ModelProto) -> List[str]:
    """Graph inputs whose values decide shapes or attributes (a Reshape's target shape, a ReduceSum's axes,
    directly or through a chain of nodes): the backend compiles them in as constants."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    nodes = _all_nodes(g)
    producer = {o: n for n in nodes for o in n.output if o}
    need, stack = set(), []
    for n in nodes:
        for k in _value_positions(n.op_type):
            if k < len(n.input) and n.input[k]:
                stack.append(n.input[k])
    while stack:
        name = stack.pop()
        if name in need:
            continue
        need.add(name)
        n = producer.get(name)
        if n is not None and n.op_type not in _SHAPE_ONLY:
            stack.extend(i for i in n.input if i)
            # A control-flow node's outputs also depend on every outer value its subgraphs read.
            stack.extend(i for sub in _all_nodes(_subgraph_holder(n)) for i in sub.input if i)
    return [vi.name for vi in g.input if vi.name in need and vi.name not in inits]


def _all_nodes(g: onnx.GraphProto) -> List[onnx.NodeProto]:
    """The nodes of ``g`` and of every subgraph in it (If branches, Loop and Scan bodies), which may read
    the outer graph's inputs."""
    out = []
    for n in g.node:
        out.append(n)
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                        list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                out.extend(_all_nodes(sub))
    return out


def _subgraph_holder(n: onnx.NodeProto) -> onnx.GraphProto:
    """A graph whose nodes are ``n``'s subgraphs' nodes (none for an ordinary node)."""
    holder = onnx.GraphProto()
    for a in n.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                    list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
            holder.node.extend(sub.node)
    return holder


def _freeze_inputs(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` where the graph inputs in ``values`` are initializers with those values."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [vi for vi in m.graph.input if vi.name not in values]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    for name, arr in values.items():
        m.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(arr), name))
    return m


class CuvilBackendRep(BackendRep):
    """A prepared model: the optimised pipeline and one compiled library per input signature.

    The signature is the input shapes when the model has symbolic dims, plus the values of the inputs that
    decide shapes (:func:`value_specialized_inputs`), which are compiled in as constants.
    """

    def __init__(self, model: onnx.ModelProto, opt_level: int = 3, num_threads: int = 0, cache: bool = True,
                 optimize: bool = True):
        _check_value_dtypes(model)
        self.model = model
        self.opt_level, self.num_threads, self.cache, self.optimize = opt_level, num_threads, cache, optimize
        inits = {t.name for t in model.graph.initializer}
        self.input_names: List[str] = [vi.name for vi in model.graph.input if vi.name not in inits]
        self.output_names: List[str] = [vi.name for vi in model.graph.output]
        self.value_inputs: List[str] = value_specialized_inputs(model)
        self._pipelines: Dict[Tuple, Any] = {}
        self._artifacts: Dict[Tuple, Any] = {}
        if not self.value_inputs:
            self._pipeline(())  # import and optimise now: errors surface at prepare

    def _pipeline(self, key: Tuple, values: Optional[Mapping[str, np.ndarray]] = None):
        p = self._pipelines.get(key)
        if p is None:
            model = _freeze_inputs(self.model, values) if values else self.model
            p = Pipeline.from_onnx(model)
            p = p.optimize() if self.optimize else p
            g = p.graph
            for v in list(g.inputs) + list(g.outputs):
                if DType(v.dtype) not in SUPPORTED_DTYPES:
                    raise UnsupportedOpError("<graph>", v.name, detail=f"value {v.name!r} has element type "
                                             f"{DType(v.dtype).name}, which the x86 backend does not support")
            self._pipelines[key] = p
        return p

    @property
    def pipeline(self):
        """The pipeline of the last signature prepared (the only one for a model without value inputs)."""
        return next(reversed(self._pipelines.values())) if self._pipelines else None

    # --- compilation ---------------------------------------------------------------------------------
    @staticmethod
    def _bind_symbols(g, feeds: Mapping[str, np.ndarray]) -> Dict[str, int]:
        """Symbol values from the shapes of the given arrays (each symbolic input dim names one symbol)."""
        env: Dict[str, int] = {}
        for v in g.inputs:
            a = feeds.get(v.name)
            if v.shape is None or a is None:
                continue
            if a.ndim != len(v.shape):
                raise ShapeError(f"input {v.name!r}: expected rank {len(v.shape)} ({v.type}), got shape {a.shape}")
            for k, (d, got) in enumerate(zip(v.shape, a.shape)):
                if isinstance(d, SymExpr) and len(d.free_symbols) == 1 and str(d) in g.symbols:
                    if env.setdefault(str(d), int(got)) != int(got):
                        raise ShapeError(f"input {v.name!r} dim {k}: {d} = {got}, but another input has {d} = {env[str(d)]}")
        return env

    def artifact_for(self, feeds: Mapping[str, np.ndarray]):
        """The compiled library for these inputs (compiled at the first request for their signature)."""
        values = {n: feeds[n] for n in self.value_inputs}
        vkey = tuple((n, a.dtype.str, a.shape, a.tobytes()) for n, a in values.items())
        p = self._pipeline(vkey, values)
        g = p.graph
        skey = tuple(tuple(feeds[v.name].shape) for v in g.inputs if v.name in feeds) if g.symbols else ()
        key = (vkey, skey)
        art = self._artifacts.get(key)
        if art is None:
            fixed = self._bind_symbols(g, feeds) if g.symbols else None
            art = p.compile(opt_level=self.opt_level, fixed=fixed, cache=self.cache)
            self._artifacts[key] = art
        return art

    # --- running -----------------------------------------------------------------------------------
    def _feeds(self, inputs) -> Dict[str, np.ndarray]:
        names = self.input_names
        if isinstance(inputs, Mapping):
            unknown = sorted(set(inputs) - set(names))
            if unknown:
                raise ShapeError(f"unknown input(s) {unknown}; the model's inputs are {names}")
            missing = [n for n in names if n not in inputs]
            if missing:
                raise ShapeError(f"missing input(s) {missing}")
            return {n: np.asarray(inputs[n]) for n in names}
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        inputs = list(inputs)
        if len(inputs) != len(names):
            raise ShapeError(f"{len(inputs)} inputs given, the model has {len(names)} ({names})")
        return {n: np.asarray(x) for n, x in zip(names, inputs)}

    def run(self, inputs, **kwargs) -> Tuple[np.ndarray, ...]:
        feeds = self._feeds(inputs)
        for n, a in feeds.items():
            if _dtype_of(a) not in SUPPORTED_DTYPES:
                raise UnsupportedOpError("<graph>", n, detail=f"input {n!r} has dtype {a.dtype}, which the x86 backend does not support")
        art = self.artifact_for(feeds)
        model = art.model(num_threads=self.num_threads)
        outs = model.run(*[feeds[spec.name] for spec in model.inputs])
        by_name = {spec.name: y for spec, y in zip(model.outputs, outs)}
        return tuple(by_name[n] for n in self.output_names)


class CuvilBackend(Backend):
    """ONNX backend API over Cuvil's x86-64 compiler. ``prepare`` keywords: ``opt_level`` (0-3, default 3),
    ``num_threads`` (0 = all cores), ``cache`` (reuse compiled libraries by content, default True)."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return Device(device).type == DeviceType.CPU
        except Exception:  # noqa: BLE001 - onnx raises assorted errors for unknown device strings
            return False

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> CuvilBackendRep:
        if not cls.supports_device(device):
            raise CuvilError(f"device {device!r} is not supported; Cuvil compiles for CPU")
        if isinstance(model, (bytes, str)):
            model = load_model(model)
        opts = {k: kwargs[k] for k in ("opt_level", "num_threads", "cache", "optimize") if k in kwargs}
        return CuvilBackendRep(model, **opts)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs) -> Tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Optional[Sequence[Tuple[Any, Tuple[int, ...]]]] = None, **kwargs) -> Tuple[np.ndarray, ...]:
        """Run one node: a one-node model is built around it (inputs typed from the arrays given) and compiled."""
        if isinstance(inputs, Mapping):
            names = [n for n in node.input if n]
            arrays = [np.asarray(inputs[n]) for n in names]
        else:
            arrays = [np.asarray(x) for x in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
            names = [n for n in node.input if n][:len(arrays)]
        g_inputs = []
        for n, a in zip(names, arrays):
            try:
                elem = onnx.helper.np_dtype_to_tensor_dtype(a.dtype)
            except (KeyError, ValueError, TypeError):
                raise UnsupportedOpError(node.op_type, node.name, detail=f"input {n!r} has dtype {a.dtype}") from None
            g_inputs.append(onnx.helper.make_tensor_value_info(n, elem, list(a.shape)))
        if outputs_info:
            g_outputs = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)), list(shape))
                         for n, (dt, shape) in zip([o for o in node.output if o], outputs_info)]
        else:
            g_outputs = [onnx.helper.make_empty_tensor_value_info(n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], f"run_node_{node.op_type}", g_inputs, g_outputs)
        opset = kwargs.pop("opset_version", None)
        imports = [onnx.helper.make_opsetid(node.domain or "", opset)] if opset else None
        model = onnx.helper.make_model(graph, opset_imports=imports) if imports else onnx.helper.make_model(graph)
        return cls.prepare(model, device, **kwargs).run(arrays)


backend = CuvilBackend()
prepare = backend.prepare
run_model = backend.run_model
run_node = backend.run_node
supports_device = backend.supports_device
