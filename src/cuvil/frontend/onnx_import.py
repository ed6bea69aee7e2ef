"""ONNX ModelProto -> cuvil.ir.Graph, canonicalised into Cuvil's one form of each op.

Every opset from 7 to the installed onnx package's newest is accepted. Legacy forms are rewritten by
:mod:`cuvil.frontend.legacy`; constant inputs at an op's lifted positions become attributes.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Dict, List, Mapping, Optional, Union

import numpy as np
import onnx
import onnx.defs
import onnx.external_data_helper
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ..errors import (CHECK_MODEL_HINT, CuvilError, DeclaredShapeWarning, InvalidAttributeError, ModelLoadError, ShapeError, UnsupportedDomainError,
                      UnsupportedOpError, UnsupportedTypeError)
from ..ir.dim import SymExpr, Symbol, symbol_name
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.registry import all_ops
from ..ir.types import TensorType
from . import functions, legacy, subgraphs
from .survey import unsupported_error, unsupported_nodes
from .torch_scopes import node_scope

MIN_OPSET = 7
DEFAULT_DOMAINS = ("", "ai.onnx")


def load_model(src: Union[str, os.PathLike, bytes, onnx.ModelProto]) -> onnx.ModelProto:
    """Read a model from a path, bytes or ModelProto, external data included; errors are ModelLoadError."""
    if isinstance(src, onnx.ModelProto):
        return src
    if isinstance(src, (bytes, bytearray)):
        m = onnx.ModelProto()
        try:
            m.ParseFromString(bytes(src))
        except DecodeError as e:
            raise ModelLoadError(f"not an ONNX model: protobuf parse failed ({e})",
                                 hint="give the bytes of an .onnx file (ModelProto.SerializeToString())") from None
        return _check_nonempty(m, "<bytes>")
    try:
        path = os.fspath(src)
    except TypeError:
        raise ModelLoadError(f"cannot load a model from a {type(src).__name__}",
                             hint="give a path, bytes or an onnx.ModelProto") from None
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: a directory, not a model file",
                             hint=f"give the .onnx file inside it (ls {os.path.join(path, '*.onnx')})")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file", hint="check the path; `cuvil zoo resnet50 -o resnet50.onnx` "
                             "writes a model to try")
    if os.path.getsize(path) == 0:
        raise ModelLoadError(f"{path}: an empty file, not an ONNX model",
                             hint="write the model again (an export or copy that stopped early leaves an empty file)")
    try:
        m = onnx.load(path, load_external_data=False)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e.strerror or e})",
                             hint="make the file readable (ls -l shows its permissions), or copy it somewhere it is") from None
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not an ONNX model: protobuf parse failed ({_one_line(e)})",
                             hint="give an .onnx file (a PyTorch .pt/.pt2 goes through Pipeline.from_file / cuvil "
                                  "compile, which export it)") from None
    try:
        onnx.external_data_helper.load_external_data_for_model(m, os.path.dirname(os.path.abspath(path)))
    except Exception as e:  # onnx raises OSError, ValueError or its ValidationError (paths outside the model's folder)
        raise ModelLoadError(f"{path}: cannot read external weights: {_one_line(e)}",
                             hint="put the external data files in the model's folder, whole (every byte the "
                                  "tensors' dims need)") from None
    return _check_nonempty(m, path)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_nonempty(m: onnx.ModelProto, where: str) -> onnx.ModelProto:
    if not m.HasField("graph") or (not m.graph.node and not m.graph.output):
        raise ModelLoadError(f"{where}: not an ONNX model: it has no graph")
    return m


def default_opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    if not versions:
        return 1 if model.ir_version < 3 else onnx.defs.onnx_opset_version()
    return max(versions)


def import_model(model: onnx.ModelProto, *, constant_initializer_inputs: bool = True,
                 input_values: Optional[Mapping[str, np.ndarray]] = None) -> Graph:
    """Build the canonical Graph of ``model``.

    Graph inputs that also have an initializer are treated as constants when
    ``constant_initializer_inputs`` (the usual inference setting; old exporters list every weight as an
    input). ``input_values`` binds graph inputs to values fixed at compile time (e.g. ``{"sr": 16000}``, a
    sample rate an ``If`` branches on): they become constants and leave the compiled model's inputs.
    """
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise ModelLoadError(f"opset {opset} is older than the oldest supported ({MIN_OPSET})",
                             hint=f"convert it: onnx.version_converter.convert_version(model, {max(MIN_OPSET, 13)}), "
                                  f"then save it and compile that")
    if opset > newest:
        raise ModelLoadError(f"opset {opset} is newer than the installed onnx package knows ({newest})",
                             hint="upgrade onnx (pip install -U onnx), or export the model at an older opset")
    if model.functions:
        try:
            model = onnx.inliner.inline_local_functions(model)
        except Exception as e:  # onnx's ValidationError for recursive or undefined functions, and others
            raise ModelLoadError(f"cannot inline the model's local functions: {_one_line(e)}") from None
    _check_text(model)
    try:
        return _Importer(model, opset, constant_initializer_inputs, dict(input_values or {})).run()
    except (UnsupportedOpError, UnsupportedDomainError) as e:
        # Name every op Cuvil lacks at once, not only the first one reached (an If branch that a fixed input
        # leaves out is never reached, so the whole model is surveyed only once import has failed).
        bad = unsupported_nodes(model)
        if not bad:
            raise
        err = unsupported_error(bad)
        if isinstance(e, UnsupportedOpError) and e.node not in {b.node for b in bad}:   # an attribute value: keep it
            err.details.append(f"also: {e.message}")
        raise err from None
    except CuvilError as e:
        if e.hint is None:   # shapes or types that contradict each other inside the file: the model is broken
            e.hint = CHECK_MODEL_HINT
        raise


def _check_text(model: onnx.ModelProto) -> None:
    """Every name the importer reads is text: protobuf hands back ``bytes`` for strings that are not UTF-8."""
    def need(s, what):
        if isinstance(s, bytes):
            raise ModelLoadError(f"{what} {s!r} is not valid UTF-8; rename it in the model")

    mg = model.graph
    need(mg.name, "graph name")
    for o in model.opset_import:
        need(o.domain, "opset domain")
    for t in list(mg.initializer) + [sp.values for sp in mg.sparse_initializer] + [sp.indices for sp in mg.sparse_initializer]:
        need(t.name, "initializer name")
    for vi in list(mg.input) + list(mg.output) + list(mg.value_info):
        need(vi.name, "value name")
        if vi.type.HasField("tensor_type"):
            for d in vi.type.tensor_type.shape.dim:
                need(d.dim_param, f"dim_param of {vi.name!r}")
    for n in mg.node:
        need(n.name, "node name")
        need(n.op_type, "op type")
        need(n.domain, "node domain")
        for name in list(n.input) + list(n.output):
            need(name, f"value name in node {n.name!r}")
        for a in n.attribute:
            need(a.name, f"attribute name in node {n.name!r}")


def is_anonymous_dim(d: onnx.TensorShapeProto.Dimension) -> bool:
    """A dim the model leaves unknown: no value and no name, a ``dim_param`` without a letter or digit
    (``?``), or a negative ``dim_value`` (``-1``: onnxruntime reads any negative value as unknown). A
    ``dim_value`` of 0 is a real, empty dim (onnxruntime refuses any other size for it), not unknown."""
    if d.HasField("dim_value"):
        return d.dim_value < 0
    return not any(c.isalnum() for c in d.dim_param)


def anonymous_symbol(input_name: str, axis: int, taken) -> str:
    """A fresh symbol for axis ``axis`` of input ``input_name``: ``x.2``, unique against ``taken``."""
    base = f"{symbol_name(input_name)}.{axis}"
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


class _Importer:
    def __init__(self, model: onnx.ModelProto, opset: int, const_inits: bool, input_values: Dict[str, np.ndarray]):
        self.model, self.opset, self.const_inits, self.input_values = model, opset, const_inits, input_values
        self.g = Graph(name=model.graph.name or "main", opset=opset)
        self.env: Dict[str, Optional[Value]] = {"": None}
        self._checked = set()
        self.declared = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
        # Every named dim of the inputs, so a fresh name (x.2) never captures a symbol the model names itself.
        self.named_dims = {symbol_name(d.dim_param) for vi in model.graph.input if vi.type.HasField("tensor_type")
                           for d in vi.type.tensor_type.shape.dim if not is_anonymous_dim(d)
                           and not d.HasField("dim_value")}
        # Other domains' versions: an op there is imported only as its ONNX function body (FlexAttention).
        self.domains = {o.domain: o.version for o in model.opset_import if o.domain not in DEFAULT_DOMAINS}

    def run(self) -> Graph:
        mg = self.model.graph
        # The spec forbids two initializers (dense or sparse) of one name; onnxruntime only warns and takes the
        # last, so a model that relies on either reading is ambiguous: refuse it.
        for name, arr in [(t.name, _to_array(t)) for t in mg.initializer] + \
                         [(sp.values.name, sparse_to_dense(sp)) for sp in mg.sparse_initializer]:
            if name in self.env:
                raise ModelLoadError(f"initializer {name!r} is defined twice; initializer names must be unique")
            self.env[name] = _const(self.g, arr, f"initializer {name!r}", name)
        inputs = set()
        for vi in mg.input:
            if vi.name in inputs:
                raise ModelLoadError(f"graph input {vi.name!r} is listed twice; input names must be unique")
            inputs.add(vi.name)
            # A graph input of an initializer's name is that initializer's overridable default (IR >= 4).
            if vi.name in self.env and self.const_inits:
                continue
            if vi.name in self.input_values:
                self.env[vi.name] = self._input_value(vi)
                continue
            self.env[vi.name] = self.g.add_input(vi.name, self._type(vi, vi.name))
        unknown = sorted(set(self.input_values) - inputs)
        if unknown:
            raise ModelLoadError(f"input_values names {', '.join(map(repr, unknown))}, which the model has no "
                                 f"input of", hint=f"name its inputs: {', '.join(repr(vi.name) for vi in mg.input)}")
        for node in _topological(mg):
            self._node(node)
        scopes = {n.name: sc for n in mg.node if n.name and (sc := node_scope(n))}
        for n in self.g.nodes:
            n.scope = scopes.get(n.name, "")
        for vi in mg.output:
            v = self.env.get(vi.name)
            if v is None:
                raise ModelLoadError(f"graph output {vi.name!r} is not produced by any node")
            if vi.name not in self._checked:
                self._check_declared(vi.name, v, "graph output")
            self.g.add_output(v, vi.name)
        return self.g

    def _input_value(self, vi: onnx.ValueInfoProto) -> Value:
        """The constant a graph input is bound to by ``input_values``, checked against the declared type."""
        declared = self._type(vi, vi.name)
        try:
            arr = np.asarray(self.input_values[vi.name], dtype=DType(declared.dtype).numpy)
        except (TypeError, ValueError) as e:
            raise ShapeError(f"input_values[{vi.name!r}] cannot be read as {DType(declared.dtype).name}: {e}") from None
        if declared.shape is not None and (len(declared.shape) != arr.ndim or any(
                isinstance(d, int) and d != n for d, n in zip(declared.shape, arr.shape))):
            raise ShapeError(f"input_values[{vi.name!r}] has shape {list(arr.shape)}; the model declares "
                             f"{declared}", hint=f"give input_values[{vi.name!r}] a value of shape {declared}")
        return _const(self.g, arr, f"input_values[{vi.name!r}]", vi.name)

    def _type(self, vi: onnx.ValueInfoProto, owner: str) -> TensorType:
        if not vi.type.HasField("tensor_type"):
            kind = vi.type.WhichOneof("value")
            raise UnsupportedOpError("<input>", owner, detail=f"input {vi.name!r} is a {kind}, only tensors are supported")
        tt = vi.type.tensor_type
        if tt.elem_type == 0:
            raise UnsupportedTypeError(f"input {vi.name!r} has no element type (data_type 0)")
        if tt.elem_type not in _KNOWN_DTYPES:
            raise UnsupportedTypeError(f"input {vi.name!r} has element type {_dtype_name(tt.elem_type)}, which "
                                       f"Cuvil does not support")
        if not tt.HasField("shape"):
            return TensorType(tt.elem_type, None)
        dims = []
        for k, d in enumerate(tt.shape.dim):
            if is_anonymous_dim(d):   # each its own symbol: two '?' of one input are not forced equal
                name = anonymous_symbol(vi.name, k, self.named_dims | set(self.g.symbols))
            elif d.HasField("dim_value"):
                dims.append(int(d.dim_value))
                continue
            else:
                name = symbol_name(d.dim_param)
            self.g.symbols.setdefault(name, Symbol(name))
            dims.append(SymExpr.symbol(name))
        return TensorType(tt.elem_type, dims)

    def _node(self, np_: onnx.NodeProto, opset: Optional[int] = None):
        """Import one node written at ``opset`` (the model's, or the one of the function body it comes from)."""
        opset = self.opset if opset is None else opset
        where = np_.name or (np_.output[0] if np_.output else np_.op_type)
        if np_.domain not in DEFAULT_DOMAINS:
            version = self.domains.get(np_.domain)
            if version is not None and functions.has_function_body(np_.op_type, version, np_.domain):
                self._expand(np_, self._inputs(np_, where), where, opset, np_.domain, version)
                return
            raise UnsupportedDomainError(
                f"node {where!r} ({np_.op_type}) is in domain {np_.domain!r}; only the default ONNX domain is supported")
        attrs = {}
        schema = _schema(np_.op_type, opset)
        control = np_.op_type in subgraphs.CONTROL_OPS
        for a in ([] if control else np_.attribute):  # control flow reads its own (subgraph) attributes
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise UnsupportedOpError(np_.op_type, where, opset, "control flow with subgraphs is not supported")
            if a.name in attrs:
                raise InvalidAttributeError(f"node {where!r} ({np_.op_type}) sets attribute {a.name!r} twice")
            spec = schema.attributes.get(a.name) if schema is not None else None
            if schema is not None and spec is None:
                raise InvalidAttributeError(f"node {where!r} ({np_.op_type}) has attribute {a.name!r}, which the op "
                                            f"does not have at opset {opset}")
            if spec is not None and int(a.type) != int(spec.type):
                raise InvalidAttributeError(
                    f"node {where!r} ({np_.op_type}): attribute {a.name!r} is {_attr_type_name(a.type)}, the op "
                    f"(opset {opset}) declares it {_attr_type_name(spec.type)}")
            attrs[a.name] = _attr_value(a, f"node {where!r} ({np_.op_type}) attribute {a.name!r}")
        inputs = self._inputs(np_, where)
        if schema is not None:
            _check_input_types(schema, inputs, f"node {where!r} ({np_.op_type}, opset {opset})")
        if schema is not None and len(np_.input) < schema.min_input:
            raise ModelLoadError(f"node {where!r} ({np_.op_type}, opset {opset}) has {len(np_.input)} input(s); "
                                 f"the op needs at least {schema.min_input}")
        if schema is not None and not schema.min_output <= len(np_.output) <= schema.max_output:
            raise ModelLoadError(f"node {where!r} ({np_.op_type}, opset {opset}) has {len(np_.output)} output(s); "
                                 f"the op has {schema.min_output} to {schema.max_output}")
        named = [o for o in np_.output if o]
        for k, name in enumerate(named):
            # One definition per name (SSA): a second one would silently shadow the first.
            if name in self.env or name in named[:k]:
                raise ModelLoadError(f"node {where!r} ({np_.op_type}) defines {name!r}, which is already defined; "
                                     f"every value name must be assigned once")
        if control:
            outs = subgraphs.expand(self, np_, inputs, where)
        else:
            if _expands(np_.op_type, opset):
                self._expand(np_, inputs, where, opset)
                return
            outs = legacy.canonicalize(self.g, np_.op_type, inputs, attrs, list(np_.output), where, opset)
        for name, v in zip(np_.output, outs):
            if name and v is not None:
                self.env[name] = v
                self._check_declared(name, v, f"node {where!r} ({np_.op_type}) output")

    def import_body(self, body: onnx.GraphProto, bound: Dict[str, Value], where: str) -> List[Optional[Value]]:
        """Import the subgraph ``body`` inline: its formal inputs are the values ``bound`` gives, every other
        name it reads resolves in the enclosing scope (outer-scope values); returns its outputs' values.
        Each call imports the nodes afresh (a Loop body once per iteration)."""
        saved = self.env, self.declared, self._checked
        self.env = dict(self.env)
        try:
            for t in body.initializer:
                self.env[t.name] = _const(self.g, _to_array(t), f"initializer {t.name!r} of {where!r}", t.name)
            for sp in body.sparse_initializer:
                self.env[sp.values.name] = _const(self.g, sparse_to_dense(sp), f"initializer of {where!r}",
                                                  sp.values.name)
            self.env.update(bound)
            self.declared = {vi.name: vi for vi in list(body.value_info) + list(body.output)}
            self._checked = set()
            for node in _topological(body):
                self._node(node)
            outs = []
            for vi in body.output:
                if vi.name not in self.env or self.env[vi.name] is None:
                    raise ModelLoadError(f"subgraph output {vi.name!r} of node {where!r} is not produced by any node")
                if vi.name not in self._checked:
                    self._check_declared(vi.name, self.env[vi.name], f"subgraph output of node {where!r}")
                outs.append(self.env[vi.name])
            return outs
        finally:
            self.env, self.declared, self._checked = saved

    def _inputs(self, np_: onnx.NodeProto, where: str):
        inputs = []
        for name in np_.input:
            if name not in self.env:
                raise ModelLoadError(f"node {where!r} ({np_.op_type}) reads {name!r}, which nothing defines")
            inputs.append(self.env[name])
        return inputs

    def _expand(self, np_: onnx.NodeProto, inputs, where: str, opset: int, domain: str = "",
                version: Optional[int] = None):
        """Import an op Cuvil does not register as the nodes of its ONNX function body (frontend/functions.py);
        ``version``: the opset of the node's ``domain`` where that is not the default one."""
        version = opset if version is None else version
        fn = functions.function_body(np_, inputs, version, where, domain)
        prefix = f"{where}/"
        while any(prefix + v in self.env for n in fn.node for v in n.output):
            prefix = f"{prefix.rstrip('/')}_/"  # a model value already has a name of this form
        inner_opset = functions.body_opset(fn, opset)
        try:
            for inner in functions.inline_body(np_, fn, version, prefix, domain):
                self._node(inner, inner_opset)
        except UnsupportedOpError as e:
            if e.op == np_.op_type and e.node == where:
                raise
            raise UnsupportedOpError(np_.op_type, where, version, f"its function body needs what Cuvil lacks: "
                                     f"{e.message}", domain=domain) from None
        except CuvilError as e:
            raise e.with_context(f"in the function body of {np_.op_type} node {where!r} (opset {version}): ") from None
        for name in np_.output:
            if name and name not in self.env:
                raise ModelLoadError(f"node {where!r} ({np_.op_type}, opset {opset}): its function body does not "
                                     f"define output {name!r}")

    def _check_declared(self, name: str, v: Value, what: str):
        """A declared dtype that differs from the inferred one is a ShapeError (onnxruntime refuses such a
        model too); a declared shape that contradicts the inferred one is a :class:`DeclaredShapeWarning`,
        and the inferred shape is kept: it follows from the inputs' declared shapes and the ops, where the
        declaration is a note the exporter wrote (onnxruntime also only warns)."""
        self._checked.add(name)
        vi = self.declared.get(name)
        if vi is None or not vi.type.HasField("tensor_type"):
            return
        tt = vi.type.tensor_type
        if tt.elem_type and tt.elem_type != int(v.dtype):
            raise ShapeError(f"{what} {name!r}: the model declares {_dtype_name(tt.elem_type)} but "
                             f"Cuvil infers {v.dtype.name}")
        if tt.HasField("shape") and v.shape is not None:
            declared = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tt.shape.dim]
            if len(declared) != len(v.shape) or any(
                    d is not None and isinstance(s, int) and d != s for d, s in zip(declared, v.shape)):
                shown = [d if d is not None else "?" for d in declared]
                warnings.warn(f"{what} {name!r}: the model declares shape {shown} but Cuvil infers {v.type} "
                              f"from the inputs; using the inferred shape", DeclaredShapeWarning, stacklevel=2)


def _topological(mg: onnx.GraphProto):
    """Nodes in an order where each follows its producers (ONNX requires it; some exporters forget)."""
    produced = {o: k for k, n in enumerate(mg.node) for o in n.output if o}
    if all(produced.get(i, -1) < k for k, n in enumerate(mg.node) for i in n.input):
        return list(mg.node)
    order, state = [], {}
    # Depth-first with an explicit stack: a chain of thousands of nodes listed backwards must not recurse.
    for root in range(len(mg.node)):
        if state.get(root) == 2:
            continue
        stack = [(root, iter(mg.node[root].input))]
        state[root] = 1
        while stack:
            k, pending = stack[-1]
            for i in pending:
                p = produced.get(i)
                if p is None or state.get(p) == 2:
                    continue
                if state.get(p) == 1:
                    raise ModelLoadError(f"the graph has a cycle through node {mg.node[p].name or mg.node[p].op_type!r}")
                state[p] = 1
                stack.append((p, iter(mg.node[p].input)))
                break
            else:
                stack.pop()
                state[k] = 2
                order.append(mg.node[k])
    return order


# Largest tensor the importer materialises (dense initializers, sparse ones densified, constants): sizes are
# checked against it from the dims, before anything is allocated.
MAX_TENSOR_BYTES = 1 << 34
_KNOWN_DTYPES = {int(d) for d in DType}


def _dtype_name(code: int) -> str:
    try:
        return onnx.TensorProto.DataType.Name(code)
    except ValueError:
        return f"code {code}"


def _attr_type_name(code) -> str:
    try:
        return onnx.AttributeProto.AttributeType.Name(int(code))
    except ValueError:
        return f"type {int(code)}"


def _expands(op: str, opset: int) -> bool:
    """Whether ``op`` is imported as its function body: Cuvil does not register it (nor rewrite it from a legacy
    form) and onnx defines it by a function at ``opset``."""
    return op not in all_ops() and op not in legacy.ADAPTERS and op != "Constant" and \
        functions.has_function_body(op, opset)


def _schema(op: str, opset: int):
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def _check_input_types(schema, inputs, what: str) -> None:
    """Inputs against the op's schema, as onnxruntime checks them: not more than the op takes, each of an
    element type its type constraint allows, and inputs that share a type parameter of one element type."""
    formals = list(schema.inputs)
    variadic = bool(formals) and formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    if len(inputs) > len(formals) and not variadic:
        raise ShapeError(f"{what} has {len(inputs)} inputs; the op takes at most {len(formals)}")
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    bound = {}
    for k, v in enumerate(inputs):
        if v is None:
            continue
        f = formals[min(k, len(formals) - 1)]
        got = f"tensor({v.dtype.name.lower()})"
        ok = allowed.get(f.type_str, {f.type_str})
        if got not in ok:
            raise UnsupportedTypeError(f"{what} input {k} ({f.name}) is {got}, which the op does not take "
                                       f"(it takes {', '.join(sorted(ok))})")
        if f.type_str in allowed and f.is_homogeneous:
            first = bound.setdefault(f.type_str, (k, got))
            if first[1] != got:
                raise ShapeError(f"{what} input {k} is {got} but input {first[0]} is {first[1]}; they must match")


def _check_size(dims, dtype_code: int, what: str) -> None:
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"{what} has a negative dimension in {list(dims)}")
    n = 1
    for d in dims:
        n *= d
    item = DType(dtype_code).itemsize if dtype_code in _KNOWN_DTYPES and dtype_code != DType.STRING else 8
    if n * item > MAX_TENSOR_BYTES:
        raise ModelLoadError(f"{what} has dims {list(dims)}: {n * item} bytes, over Cuvil's limit of "
                             f"{MAX_TENSOR_BYTES} bytes for one tensor")


def _to_array(t: onnx.TensorProto, what: str = "") -> np.ndarray:
    what = what or f"initializer {t.name!r}"
    if t.data_type == 0 or t.data_type not in _KNOWN_DTYPES:
        raise UnsupportedTypeError(f"{what} has element type {_dtype_name(t.data_type)}, which Cuvil does not support")
    if onnx.external_data_helper.uses_external_data(t):
        # Only a model loaded from its path has a folder to resolve the file in; never read the working directory.
        raise ModelLoadError(f"{what} keeps its data in an external file",
                             hint="load the model from its path (Pipeline.from_onnx(path)) so the file is read from "
                                  "the model's folder")
    _check_size(t.dims, t.data_type, what)
    try:
        arr = numpy_helper.to_array(t)
    except Exception as e:  # onnx raises several types for truncated or inconsistent tensors
        raise ModelLoadError(f"{what} cannot be read: {_one_line(e)}") from None
    return arr


def sparse_to_dense(sp: onnx.SparseTensorProto, what: str = "") -> np.ndarray:
    """The dense array of a sparse tensor. Its indices are either linearized (``[NNZ]``, row-major offsets)
    or coordinates (``[NNZ, rank]``), as the ONNX spec allows; both are bounds-checked."""
    what = what or f"sparse initializer {sp.values.name!r}"
    dims = tuple(int(d) for d in sp.dims)
    vals = _to_array(sp.values, what + " values").reshape(-1)
    idx = _to_array(sp.indices, what + " indices")
    _check_size(dims, sp.values.data_type, what)
    if idx.dtype.kind not in "iu":
        raise ModelLoadError(f"{what}: indices must be integers, not {idx.dtype}")
    nnz = vals.shape[0]
    rank = len(dims)
    if idx.ndim == 2 and idx.shape == (nnz, rank):
        for k in range(rank):
            col = idx[:, k]
            if nnz and (col.min() < 0 or col.max() >= dims[k]):
                raise ModelLoadError(f"{what}: a coordinate index on axis {k} is outside dims {list(dims)}")
        flat = np.ravel_multi_index(tuple(idx.T.astype(np.int64)), dims) if nnz else np.zeros(0, np.int64)
    elif idx.ndim == 1 and idx.shape[0] == nnz:
        size = int(np.prod(dims, dtype=np.int64))
        if nnz and (idx.min() < 0 or idx.max() >= size):
            raise ModelLoadError(f"{what}: a linear index is outside the {size} elements of dims {list(dims)}")
        flat = idx.astype(np.int64)
    else:
        raise ModelLoadError(f"{what}: indices of shape {list(idx.shape)} fit neither [NNZ] nor [NNZ, rank] for "
                             f"{nnz} values of dims {list(dims)}")
    dense = np.zeros(dims, vals.dtype)
    dense.reshape(-1)[flat] = vals
    return dense


def _const(g: Graph, arr: np.ndarray, what: str, name: str) -> Value:
    try:
        return g.const(arr, name)
    except TypeError:
        raise UnsupportedTypeError(f"{what} has element type {arr.dtype}, which Cuvil does not support") from None


def _text(b: bytes, what: str) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelLoadError(f"{what} is not valid UTF-8") from None


def _attr_value(a: onnx.AttributeProto, what: str = ""):
    what = what or f"attribute {a.name!r}"
    try:
        v = onnx.helper.get_attribute_value(a)
    except Exception as e:  # an AttributeProto of type UNDEFINED or an unknown type code
        raise InvalidAttributeError(f"{what} cannot be read: {_one_line(e)}") from None
    if isinstance(v, bytes):
        return _text(v, what)
    if isinstance(v, onnx.TensorProto):
        return _to_array(v, what)
    if isinstance(v, onnx.SparseTensorProto):
        return sparse_to_dense(v, what)
    if isinstance(v, list):
        return [_text(x, what) if isinstance(x, bytes) else
                _to_array(x, what) if isinstance(x, onnx.TensorProto) else x for x in v]
    if v is None:
        raise InvalidAttributeError(f"{what} has no value (attribute type {_attr_type_name(a.type)})")
    return v


__all__ = ["load_model", "import_model", "symbol_name", "is_anonymous_dim", "anonymous_symbol", "default_opset"]
