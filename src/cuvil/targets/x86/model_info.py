"""What the x86 artifact generators (model.c, the public header) need to know about a compiled model.

Plain attrs records, validated on construction so that whatever reaches the C generators is safe to
print into C: identifiers are C identifiers, dtypes are ONNX ``TensorProto`` codes with a fixed size.
"""
from __future__ import annotations

import re

import attrs

from cuvil.errors import CuvilError

_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: ONNX TensorProto codes usable at the C ABI (everything with a fixed element size; not STRING).
ABI_DTYPES = {1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
              10: "float16", 11: "double", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128",
              16: "bfloat16"}

#: Names the public ABI takes under a prefix (``<prefix>_<name>``); kernels may not use them.
ABI_FUNCTIONS = ("num_inputs", "num_outputs", "input_name", "output_name", "input_info", "output_info",
                 "session_create", "output_shape", "run", "strerror", "last_error", "session_destroy", "profile")


_C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "_Alignas _Alignof _Atomic _Bool _Complex _Generic _Imaginary _Noreturn _Static_assert _Thread_local".split())


def is_c_identifier(s: object) -> bool:
    """A C identifier that is not a keyword (usable as a symbol and as the ABI prefix)."""
    return isinstance(s, str) and bool(_C_IDENT.match(s)) and s not in _C_KEYWORDS


def _ident(inst, attribute, value):
    if not is_c_identifier(value):
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be a C identifier, got {value!r}")


def _opt_ident(inst, attribute, value):
    if value is not None:
        _ident(inst, attribute, value)


def _name(inst, attribute, value):
    if not isinstance(value, str) or "\0" in value:
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be a str without NUL, got {value!r}")


def _dtype(inst, attribute, value):
    if int(value) not in ABI_DTYPES:
        raise CuvilError(f"IODesc {inst.name!r}: dtype {value!r} is not an ONNX dtype code usable at the C ABI")


def _shape(inst, attribute, value):
    for d in value:
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            raise CuvilError(f"IODesc {inst.name!r}: shape {value!r} must hold ints >= 0 or None")


def _nonneg(inst, attribute, value):
    if not isinstance(value, int) or value < 0:
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be an int >= 0, got {value!r}")


def _positive(inst, attribute, value):
    if not isinstance(value, int) or value < 1:
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class IODesc:
    """One model input or output: name, ONNX dtype code, shape (None = symbolic dim)."""

    name: str = attrs.field(validator=_name)
    dtype: int = attrs.field(converter=int, validator=_dtype)
    shape: tuple = attrs.field(converter=tuple, validator=_shape)

    @property
    def dtype_name(self) -> str:
        return ABI_DTYPES[self.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@attrs.frozen
class StepDesc:
    """One step: run kernel ``symbol(bufs, begin, end)`` over [0, extent) in chunks of >= grain iterations."""

    symbol: str = attrs.field(validator=_ident)
    extent: int = attrs.field(validator=_nonneg)
    grain: int = attrs.field(default=1, validator=_positive)


@attrs.frozen
class ModelInfo:
    inputs: list = attrs.field(converter=list)
    outputs: list = attrs.field(converter=list)
    arena_bytes: int = attrs.field(validator=_nonneg)
    steps: list = attrs.field(converter=list)
    weights_symbol: str | None = attrs.field(default=None, validator=_opt_ident)
    prefix: str = attrs.field(default="cuvil", validator=_ident)
    scratch_bytes: int = attrs.field(default=0, validator=_nonneg)   # per thread

    def __attrs_post_init__(self):
        for kind, descs in (("input", self.inputs), ("output", self.outputs)):
            for d in descs:
                if not isinstance(d, IODesc):
                    raise CuvilError(f"ModelInfo.{kind}s must hold IODesc, got {d!r}")
        for s in self.steps:
            if not isinstance(s, StepDesc):
                raise CuvilError(f"ModelInfo.steps must hold StepDesc, got {s!r}")
        reserved = {f"{self.prefix}_{f}" for f in ABI_FUNCTIONS} | {f"{self.prefix}__model"}
        symbols = {s.symbol for s in self.steps}
        if self.weights_symbol is not None:
            if self.weights_symbol in symbols:
                raise CuvilError(f"weights symbol {self.weights_symbol!r} is also a kernel symbol")
            symbols.add(self.weights_symbol)
        clash = sorted(symbols & reserved)
        if clash:
            raise CuvilError(f"symbol(s) {', '.join(clash)} clash with the public ABI of prefix {self.prefix!r}")
