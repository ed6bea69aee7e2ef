"""The one interface of a loaded model, whatever the target: :func:`cuvil.load` returns a :class:`Model`
(``X86Model`` for ``libNAME.so``, ``GpuModel`` for ``NAME.cuvil/``), and ``Artifact.run`` / ``Bundle.run``
go through it.

How ``run`` is called and what it returns (the one rule, also in docs/c-abi.md "Loading a model"):

    m.run(ids, mask)                                  # positional, in input order  -> list, in output order
    m.run(input_ids=ids, attention_mask=mask)         # by keyword                   -> list, in output order
    m.run({"input_ids": ids, "attention_mask": mask}) # one dict of named inputs     -> dict {output name: array}

A dict in, a dict out; otherwise a list. Options of a target's ``run`` (``num_threads``, ``mode``) are
keywords that no input may be called; give such an input in a dict.

Every model describes itself the same way: ``inputs`` and ``outputs`` are :class:`TensorSpec` (name, numpy
dtype, ``shape`` with None for a symbolic dim, ``dims`` with the symbol's name there, the ONNX dtype code),
``symbols`` maps each shape symbol to its :class:`SymbolProfile` (min, opt, max, multiple; a symbol fixed at
compile time has min = opt = max). The inputs are checked in one place, :meth:`Signature.prepare`, before any
target-specific work: names, count, dtype (never cast), rank, static dims, each symbol's profile and that
every dim of one symbol has one value. A refusal is a :class:`ShapeError` whose message names the input as
the model spells it and whose hint is the next step; its code is the C ABI's (docs/c-abi.md), so a Python
user and a C user read the same words.
"""
from __future__ import annotations

import abc
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import attrs
import numpy as np

from ..errors import CuvilError, ShapeError, UnsupportedTypeError
from ..ir.dtype import DType

#: The runtime's error texts by code (runtime.c ``messages``; a test checks they agree), so that an input
#: refused in Python reads as the library would refuse it.
RUNTIME_ERRORS = {
    -6: "tensor dtype does not match the model",
    -7: "tensor rank (ndim) does not match the model",
    -8: "tensor dimension does not match the model",
    -19: "tensor dimension is outside the model's shape profile",
}

#: The ONNX names of the dtype codes, as the runtime prints them (runtime.c dtype_name).
CODE_NAMES = ("undefined", "float", "uint8", "int8", "uint16", "int16", "int32", "int64", "string", "bool",
              "float16", "double", "uint32", "uint64", "complex64", "complex128", "bfloat16", "float8e4m3fn",
              "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "uint4", "int4", "float4e2m1", "float8e8m0", "uint2",
              "int2")


def numpy_dtype(code: int) -> Optional[np.dtype]:
    """The numpy dtype of ONNX dtype ``code``; None where numpy has none (bfloat16, the float8 types)."""
    try:
        dt = DType(code).numpy
    except (ValueError, UnsupportedTypeError):
        return None
    return None if dt is None else np.dtype(dt)


_CODES: Dict[np.dtype, int] = {}
for _code in range(1, len(CODE_NAMES)):
    _dt = numpy_dtype(_code)
    if _dt is not None and _dt.kind != "O":
        _CODES.setdefault(_dt, _code)


def dtype_code(dt: np.dtype) -> int:
    """ONNX code of a numpy dtype; 0 (undefined) when it has none (an object array, non-native byte order)."""
    return _CODES.get(dt, 0)


def code_name(code: int) -> str:
    return CODE_NAMES[code] if 0 <= code < len(CODE_NAMES) else "unknown"


def shape_text(dims) -> str:
    """``[?, 3, 224, 224]``: a shape as the user sees it (``?`` for a dim that is not fixed)."""
    return "[" + ", ".join("?" if v is None else str(v) for v in dims) + "]"


@attrs.frozen
class TensorSpec:
    """An input or output as the artifact declares it. ``dtype``: the numpy dtype (None where numpy has none,
    e.g. bfloat16); ``code``: the ONNX TensorProto code; ``shape``: ints, None for a symbolic dim; ``dims``:
    the same with the symbol's name (``batch``, ``p2o.DynamicDimension.0``) where the artifact records one."""

    name: str
    dtype: Optional[np.dtype]
    shape: Tuple[Optional[int], ...]
    code: int
    dims: Tuple[Union[int, str, None], ...] = attrs.field()

    @dims.default
    def _dims_default(self):
        return tuple(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        dt = self.dtype.name if self.dtype is not None else code_name(self.code)
        return f"{self.name}: {dt}[{', '.join('?' if d is None else str(d) for d in self.dims)}]"


@attrs.frozen
class SymbolProfile:
    """The values a shape symbol may take: ``min``..``max``, tuned for ``opt``, only multiples of
    ``multiple``. A symbol fixed at compile time has ``min == opt == max``."""

    min: int
    opt: int
    max: int
    multiple: int = 1

    def __str__(self) -> str:
        return f"[{self.min}, {self.max}]" + (f", multiples of {self.multiple}" if self.multiple > 1 else "")


def tensor_spec(name: str, code: int, dims: Sequence) -> TensorSpec:
    """A spec from an artifact's metadata: ``dims`` ints, symbol names, or None/-1 for an unnamed dim."""
    dims = tuple(None if d is None or (isinstance(d, int) and d < 0) else d for d in dims)
    shape = tuple(d if isinstance(d, int) else None for d in dims)
    return TensorSpec(name=name, dtype=numpy_dtype(int(code)), shape=shape, code=int(code), dims=dims)


@attrs.frozen
class Prepared:
    """The inputs of one call, ready for a target: ``arrays`` in input order (not cast, not copied),
    ``as_dict`` (the call gave a dict: the outputs go back as one), ``bindings`` (symbol -> value)."""

    arrays: List[np.ndarray]
    as_dict: bool
    bindings: Dict[str, int]


@attrs.frozen
class Signature:
    """What a model takes and gives, and the one place a call's inputs are checked (:meth:`prepare`).
    ``artifact``: the file name the errors start with; ``fixed``: symbols fixed at compile time (a bundle's
    ``specialized``), named in the hint when a dim does not fit."""

    artifact: str
    inputs: Tuple[TensorSpec, ...]
    outputs: Tuple[TensorSpec, ...]
    symbols: Mapping[str, SymbolProfile] = attrs.field(factory=dict)
    fixed: Mapping[str, int] = attrs.field(factory=dict)
    target: str = ""
    #: per input (dtype, shape) when every input is fully static (no symbol): :meth:`prepare`'s fast path
    _exact: Optional[tuple] = attrs.field(init=False, eq=False, repr=False)
    #: [(per input (dtype, shape), bindings)] of the last positional call the full checks accepted (a model
    #: with symbols called again with the same shapes skips them: the checks read only dtypes and shapes)
    _last: list = attrs.field(init=False, eq=False, repr=False, factory=lambda: [None])

    @_exact.default
    def _exact_default(self):
        exact = []
        for d in self.inputs:
            if d.dtype is None or not all(type(v) is int for v in d.dims):
                return None
            exact.append((d.dtype, tuple(d.shape)))
        return tuple(exact)

    def input_names(self) -> str:
        return ", ".join(repr(d.name) for d in self.inputs)

    def _refuse(self, message: str, hint: str, details=()) -> None:
        raise ShapeError(f"{self.artifact}: {message}", hint=hint, details=details)

    def gather(self, args: Sequence, named: Mapping) -> Tuple[list, bool]:
        """``args``/``named`` of a ``run`` call -> (one value per input, in input order; whether a dict was
        given). Refuses an unknown name (listing the inputs), an input given twice, a missing one."""
        as_dict = len(args) == 1 and isinstance(args[0], Mapping)
        if as_dict:
            if named:
                self._refuse(f"inputs given both in a dict and as keywords ({', '.join(map(repr, named))})",
                             "put every input in the dict")
            args, named = (), args[0]
        elif any(isinstance(a, Mapping) for a in args):
            self._refuse(f"a dict of inputs among {len(args)} positional arguments",
                         "pass the dict alone, run({name: array, ...}), or only arrays in input order "
                         f"({self.input_names()})")
        n = len(self.inputs)
        if (len(args) == 1 and n > 1 and isinstance(args[0], (list, tuple)) and len(args[0]) == n
                and all(isinstance(a, np.ndarray) for a in args[0])):
            self._refuse(f"a {type(args[0]).__name__} of {n} arrays given as one input",
                         "unpack it, run(*arrays), or pass a dict by name")
        if len(args) > n:
            self._refuse(f"{len(args)} positional inputs, the model has {n} ({self.input_names()})",
                         f"pass {n} arrays in input order, or a dict by name")
        index = {d.name: k for k, d in enumerate(self.inputs)}
        given: list = list(args) + [None] * (n - len(args))
        have = [True] * len(args) + [False] * (n - len(args))
        for name, value in named.items():
            k = index.get(name)
            if k is None:
                self._refuse(f"unknown input {name!r}; the model's inputs are {self.input_names()}",
                             "name the inputs as listed (m.inputs)")
            if have[k]:
                self._refuse(f"input {name!r} given twice", f"give {name!r} once, by position or by name")
            given[k], have[k] = value, True
        missing = [self.inputs[k].name for k in range(n) if not have[k]]
        if missing:
            self._refuse(f"missing input(s) {', '.join(map(repr, missing))}; the model's inputs are "
                         f"{self.input_names()}",
                         "pass every input: run({" + ", ".join(f"{d.name!r}: ..." for d in self.inputs) + "})")
        return given, as_dict

    def prepare(self, args: Sequence = (), named: Optional[Mapping] = None) -> Prepared:
        """The inputs of ``run(*args, **named)`` as arrays in input order, every one checked (see the module
        docstring); raises :class:`ShapeError` with the next step."""
        exact, bound = self._exact, {}
        if exact is None and self._last[0] is not None:
            exact, bound = self._last[0]
        if exact is not None and not named and len(args) == len(exact):
            # the common call, run(*arrays): exact ndarrays of the declared dtype and shape (a static model) or
            # of the shapes the last call had accepted pass every check below unchanged (anything else takes
            # the full path and its messages)
            for a, (dtype, shape) in zip(args, exact):
                if type(a) is not np.ndarray or a.dtype != dtype or a.shape != shape:
                    break
            else:
                return Prepared(arrays=list(args), as_dict=False, bindings=dict(bound))
        given, as_dict = self.gather(args, named or {})
        arrays, bindings, bound_by = [], {}, {}
        for k, (d, x) in enumerate(zip(self.inputs, given)):
            try:
                a = np.asarray(x)          # no dtype: nothing is cast
            except (ValueError, TypeError) as e:
                self._refuse(f"input {k} '{d.name}' is not an array ({e})", f"pass a numpy array of dtype "
                             f"{d.dtype.name if d.dtype is not None else code_name(d.code)}")
            self._check(k, d, a, bindings, bound_by)
            arrays.append(a)
        if self._exact is None and not as_dict and not named and all(type(x) is np.ndarray for x in given):
            self._last[0] = (tuple((a.dtype, a.shape) for a in arrays), dict(bindings))
        return Prepared(arrays=arrays, as_dict=as_dict, bindings=bindings)

    def _check(self, k: int, d: TensorSpec, a: np.ndarray, bindings: dict, bound_by: dict) -> None:
        where = f"input {k} '{d.name}'"

        def refuse(code: int, detail: str, hint: str):
            self._refuse(f"{RUNTIME_ERRORS[code]}: {where}: {detail} (code {code})", hint)
        if d.dtype is None or a.dtype != d.dtype:
            got = dtype_code(a.dtype)
            refuse(-6, f"dtype is {got} ({code_name(got) if got else a.dtype}), expected {d.code} "
                       f"({code_name(d.code)})",
                   f"convert it with .astype(numpy.{d.dtype.name})" if d.dtype is not None
                   else f"numpy has no dtype for code {d.code}; call the C ABI directly")
        if a.ndim != d.ndim:
            refuse(-7, f"ndim is {a.ndim}, expected {d.ndim}", f"reshape it to {shape_text(d.shape)}")
        for i, (got, want, sym) in enumerate(zip(a.shape, d.shape, d.dims)):
            if want is not None and got != want:
                refuse(-8, f"dim {i} is {got}, expected {want}", self._fixed_hint(d, a))
            if not isinstance(sym, str):
                continue
            prof = self.symbols.get(sym)
            if prof is not None and not prof.min <= got <= prof.max:
                refuse(-19, f"dim {i} is {sym} = {got}, outside the profile {sym} in [{prof.min}, {prof.max}]",
                       f"split the input, or compile with --shape-profile {sym}=MIN:OPT:MAX covering {got} "
                       f"(or --input-shape {d.name}=MIN:OPT:MAX, three shapes)")
            if prof is not None and prof.multiple > 1 and got % prof.multiple:
                refuse(-19, f"dim {i} is {sym} = {got}, not a multiple of {prof.multiple} (the profile {sym} in "
                            f"{prof})",
                       f"pad the input to a multiple of {prof.multiple} "
                       f"(e.g. {-(-got // prof.multiple) * prof.multiple})")
            if sym in bindings and bindings[sym] != got:
                refuse(-8, f"dim {i} is {sym} = {got}, but {bound_by[sym]} bound {sym} = {bindings[sym]}",
                       f"give every dim named {sym} one value (here {bindings[sym]}, as {bound_by[sym]} has)")
            bindings.setdefault(sym, got)
            bound_by.setdefault(sym, f"input {k} '{d.name}' dim {i}")

    def _fixed_hint(self, d: TensorSpec, a: np.ndarray) -> str:
        hint = f"pass an array of shape {shape_text(d.shape)}"
        if self.fixed:
            fixed = ", ".join(f"{k}={v}" for k, v in self.fixed.items())
            target = f" --target {self.target}" if self.target else ""
            hint += (f"; the artifact was compiled for {fixed}: for this shape compile it again with "
                     f"--input-shape {d.name}={'x'.join(map(str, a.shape))}{target}")
        return hint

    def package(self, outs: Sequence[np.ndarray], as_dict: bool):
        """The outputs as ``run`` returns them: a dict by output name for a dict call, else a list."""
        outs = list(outs)
        return {d.name: y for d, y in zip(self.outputs, outs)} if as_dict else outs


def fixed_symbols(manifest: dict) -> Dict[str, int]:
    """The symbols a manifest's ``specialized`` fixed to a number (not those made one with another symbol,
    ``{"s.0": "x.0"}``)."""
    spec = manifest.get("specialized")
    if not isinstance(spec, dict):
        return {}
    return {k: int(v) for k, v in spec.items() if isinstance(v, int) and not isinstance(v, bool)}


def as_run_args(inputs) -> tuple:
    """``Artifact.run(inputs)``'s one argument as ``Model.run`` arguments: a dict stays one argument (a dict
    comes back), one array is the one input, a list or tuple gives the inputs in order."""
    if isinstance(inputs, (Mapping, np.ndarray)):
        return (inputs,)
    return tuple(inputs)


class Model(abc.ABC):
    """A loaded model, whatever its target. ``run`` (see the module docstring for the call forms and what they
    return), ``inputs``/``outputs`` (:class:`TensorSpec`), ``symbols`` (:class:`SymbolProfile` by name),
    ``path``, ``close()`` and ``with`` (a closed model raises :class:`CuvilError`)."""

    #: keywords of ``run`` that are options of the target, not inputs
    run_options: Tuple[str, ...] = ()
    signature: Signature
    path: str

    @property
    def inputs(self) -> List[TensorSpec]:
        return list(self.signature.inputs)

    @property
    def outputs(self) -> List[TensorSpec]:
        return list(self.signature.outputs)

    @property
    def symbols(self) -> Dict[str, SymbolProfile]:
        return dict(self.signature.symbols)

    def run(self, *args, **named) -> Union[List[np.ndarray], Dict[str, np.ndarray]]:
        """Runs the model: ``run(a, b)`` or ``run(name=a, ...)`` returns the outputs as a list in output order;
        ``run({name: a, ...})`` returns a dict by output name. Inputs are numpy arrays (or what
        ``numpy.asarray`` makes one of), never cast: a wrong dtype is refused with the cast to use."""
        options = {k: named.pop(k) for k in self.run_options if k in named}
        self._ensure_open()
        prep = self.signature.prepare(args, named)
        return self.signature.package(self._run_arrays(prep.arrays, **options), prep.as_dict)

    @abc.abstractmethod
    def _run_arrays(self, arrays: List[np.ndarray], **options) -> List[np.ndarray]:
        """One inference on inputs :meth:`Signature.prepare` checked, in input order; outputs in order."""

    @abc.abstractmethod
    def _ensure_open(self) -> None:
        """Raises :class:`CuvilError` when the model was closed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the model holds; it then raises :class:`CuvilError` if run (closing twice is harmless)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def closed_error(self) -> CuvilError:
        return CuvilError(f"{self.signature.artifact}: the model was closed (close() or the end of its with block)",
                          hint=f"load it again with cuvil.load({self.path!r}) to run it")


__all__ = ["Model", "as_run_args", "fixed_symbols", "Signature", "Prepared", "TensorSpec", "SymbolProfile", "tensor_spec",
           "RUNTIME_ERRORS", "numpy_dtype", "dtype_code", "code_name", "shape_text"]
