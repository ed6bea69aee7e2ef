"""What the x86 artifact generators (model.c, the public header) need to know about a compiled model.

Plain attrs records, validated on construction so that whatever reaches the C generators is safe to
print into C: identifiers are C identifiers, dtypes are ONNX ``TensorProto`` codes with a fixed size.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

import attrs

from cuvil.errors import CuvilError
from cuvil.ir.dim import SymExpr

_C_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: ONNX TensorProto codes usable at the C ABI (everything with a fixed element size; not STRING).
ABI_DTYPES = {1: "float", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
              10: "float16", 11: "double", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128",
              16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2", 20: "float8e5m2fnuz",
              21: "uint4", 22: "int4", 23: "float4e2m1", 24: "float8e8m0", 25: "uint2", 26: "int2"}   # the narrow ones: one per byte

#: Names the public ABI takes under a prefix (``<prefix>_<name>``); kernels may not use them.
ABI_FUNCTIONS = ("num_inputs", "num_outputs", "input_name", "output_name", "input_info", "output_info",
                 "session_create", "output_shape", "run", "strerror", "last_error", "session_destroy", "profile",
                 "num_symbols", "symbol_info", "weights_info", "bind_weights", "num_lora_slots", "lora_slot_info",
                 "adapter_load", "adapter_activate", "adapter_unload", "adapter_bytes")


_C_KEYWORDS = frozenset(
    "auto break case char const continue default do double else enum extern float for goto if inline int long "
    "register restrict return short signed sizeof static struct switch typedef union unsigned void volatile while "
    "_Alignas _Alignof _Atomic _Bool _Complex _Generic _Imaginary _Noreturn _Static_assert _Thread_local".split())


def is_c_identifier(s: object) -> bool:
    """A C identifier that is not a keyword (usable as a symbol and as the ABI prefix)."""
    return isinstance(s, str) and bool(_C_IDENT.match(s)) and s not in _C_KEYWORDS


#: These checks guard what reaches the C generators; a model that trips one found a gap in an earlier check.
_REPORT = "report it with the model's `cuvil inspect MODEL --raw` output; the message names what failed"


def _ident(inst, attribute, value):
    if not is_c_identifier(value):
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be a C identifier, got {value!r}",
                         hint="give a C identifier (letters, digits, _; not a C keyword), e.g. --prefix mymodel")


def _opt_ident(inst, attribute, value):
    if value is not None:
        _ident(inst, attribute, value)


def _name(inst, attribute, value):
    if not isinstance(value, str) or "\0" in value:
        raise CuvilError(f"tensor name {value!r} holds a NUL character, which C strings cannot carry",
                         hint="rename the input/output in the model (onnx.compose.add_prefix or editing the "
                              "ValueInfoProto)")


def _dtype(inst, attribute, value):
    if int(value) not in ABI_DTYPES:
        raise CuvilError(f"tensor {inst.name!r}: element type code {value!r} cannot cross the C ABI",
                         hint="export the model with numeric inputs and outputs (float32, int64, ...)")


def _shape(inst, attribute, value):
    for d in value:
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
            shown = "[" + ", ".join("?" if x is None else str(x) for x in value) + "]"
            raise CuvilError(f"tensor {inst.name!r} has shape {shown}: a dim is not a size >= 0", hint=_REPORT)


def _nonneg(inst, attribute, value):
    if not isinstance(value, int) or value < 0:
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be an int >= 0, got {value!r}", hint=_REPORT)


def _positive(inst, attribute, value):
    if not isinstance(value, int) or value < 1:
        raise CuvilError(f"{type(inst).__name__}.{attribute.name} must be an int >= 1, got {value!r}", hint=_REPORT)


def _dims(inst, attribute, value):
    if value and len(value) != len(inst.shape):
        raise CuvilError(f"tensor {inst.name!r}: dims {value!r} and shape {inst.shape!r} differ in rank", hint=_REPORT)
    for d, s in zip(value, inst.shape):
        if isinstance(d, SymExpr) != (s is None) or (isinstance(d, int) and d != s):
            raise CuvilError(f"tensor {inst.name!r}: dims {value!r} do not match shape {inst.shape!r}", hint=_REPORT)


@attrs.frozen
class IODesc:
    """One model input or output: name, ONNX dtype code, shape (None = symbolic dim); ``dims``: the shape's
    expressions over the model's symbols (empty when the shape is static)."""

    name: str = attrs.field(validator=_name)
    dtype: int = attrs.field(converter=int, validator=_dtype)
    shape: tuple = attrs.field(converter=tuple, validator=_shape)
    dims: tuple = attrs.field(default=(), converter=tuple, validator=_dims)

    @classmethod
    def of(cls, name: str, dtype: int, dims) -> "IODesc":
        dims = tuple(dims)
        symbolic = any(isinstance(d, SymExpr) for d in dims)
        return cls(name, dtype, tuple(None if isinstance(d, SymExpr) else int(d) for d in dims),
                   dims if symbolic else ())

    @property
    def dtype_name(self) -> str:
        return ABI_DTYPES[self.dtype]

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _extent(inst, attribute, value):
    if not isinstance(value, SymExpr):
        _nonneg(inst, attribute, value)


@attrs.frozen
class StepDesc:
    """One step: run kernel ``symbol(bufs, begin, end)`` over [0, extent) in chunks of >= grain iterations.
    ``extent`` is an int, or a SymExpr evaluated from the run's symbol values."""

    symbol: str = attrs.field(validator=_ident)
    extent: object = attrs.field(validator=_extent)
    grain: int = attrs.field(default=1, validator=_positive)
    split: int = attrs.field(default=1, validator=_positive)   # chunks per thread at most
    # (buffer table index, byte offset, polarity): skip the step when the bool at bufs[index] + offset is not
    # polarity (a branch of a run-time If); None: always run
    guard: Optional[Tuple[int, int, bool]] = None
    # (target step, condition): after the step runs (not when it is skipped), the run goes on at the target
    # step when the condition, (buffer table index, byte offset, value) as for ``guard``, holds, or always
    # when it is None: a run-time loop's exit test and back edge
    jump: Optional[Tuple[int, Optional[Tuple[int, int, bool]]]] = None


@attrs.frozen
class SymbolDesc:
    """A run-time shape symbol and its profile: every run binds it from the input shapes and checks
    ``min <= value <= max`` and that ``multiple`` divides it; ``opt`` is the value the kernels were tuned for."""

    name: str = attrs.field(validator=_name)
    min: int = attrs.field(validator=_nonneg)
    opt: int = attrs.field(validator=_nonneg)
    max: int = attrs.field(validator=_nonneg)
    multiple: int = attrs.field(default=1, validator=_nonneg)


@attrs.frozen
class ModelInfo:
    inputs: list = attrs.field(converter=list)
    outputs: list = attrs.field(converter=list)
    arena_bytes: int = attrs.field(validator=_nonneg)
    steps: list = attrs.field(converter=list)
    weights_symbol: str | None = attrs.field(default=None, validator=_opt_ident)
    prefix: str = attrs.field(default="cuvil", validator=_ident)
    scratch_bytes: int = attrs.field(default=0, validator=_nonneg)   # per thread
    symbols: list = attrs.field(factory=list, converter=list)      # SymbolDesc, in run-time slot order
    # kernels specialised for the symbols' opt values (static extents), run when a call's shapes are the opt point
    opt_steps: list = attrs.field(factory=list, converter=list)
    opt_weights_symbol: str | None = attrs.field(default=None, validator=_opt_ident)
    # the last this many symbols are sizes a step writes during the run (NonZero's count), not bound by inputs:
    # before the run they hold their max (the bound outputs are allocated at)
    num_run_time_symbols: int = attrs.field(default=0, validator=_nonneg)
    # ISA features (LLVM spellings, which __builtin_cpu_supports shares) a session refuses to start without
    isa_checks: tuple = attrs.field(factory=tuple, converter=tuple)
    # external weights (libNAME.weights, bound at run time): their size and SHA-256, and where in them the opt
    # steps' own weights start (-1: the opt steps read none); 0 bytes: the weights are embedded (weights_symbol)
    external_weights_bytes: int = attrs.field(default=0, validator=_nonneg)
    external_weights_sha256: bytes = b""
    external_opt_weights_offset: int = -1
    # LoRA slots, (module, in, out, rank) each: their buffers follow the symbol table (cuvil_runtime.h)
    lora_slots: tuple = attrs.field(factory=tuple, converter=tuple)
    # batch slices (cuvil.kernels.batch_rows): the index of the symbol every row is computed alone along (-1:
    # none), and the bytes of one opt-point slice of each input, then each output; a run whose value of that
    # symbol is a multiple of its opt (the others at theirs) runs the opt steps once per slice
    batch_symbol: int = -1
    batch_slice_bytes: tuple = attrs.field(factory=tuple, converter=tuple)
    # the embedded blobs' sizes (weights_symbol, opt_weights_symbol; 0 where absent): the runtime asks for them in
    # huge pages (cuvil_runtime.h)
    weights_bytes: int = attrs.field(default=0, validator=_nonneg)
    opt_weights_bytes: int = attrs.field(default=0, validator=_nonneg)

    def __attrs_post_init__(self):
        for sym, n in ((self.weights_symbol, self.weights_bytes), (self.opt_weights_symbol, self.opt_weights_bytes)):
            if n and sym is None:
                raise CuvilError(f"{n} bytes of embedded weights without their symbol")
        names = [s.name for s in self.symbols]
        for kind, descs in (("input", self.inputs), ("output", self.outputs)):
            for d in descs:
                for e in d.dims:
                    extra = set(e.free_symbols) - set(names) if isinstance(e, SymExpr) else set()
                    if extra:
                        raise CuvilError(f"{kind} {d.name!r}: dim {e} uses undeclared symbol(s) {sorted(extra)}")
        for d in self.inputs:
            for e in d.dims:
                if isinstance(e, SymExpr) and str(e) not in names:
                    raise CuvilError(f"input {d.name!r}: dim {e} is not a plain symbol")
        for kind, descs in (("input", self.inputs), ("output", self.outputs)):
            for d in descs:
                if not isinstance(d, IODesc):
                    raise CuvilError(f"ModelInfo.{kind}s must hold IODesc, got {d!r}")
        for s in self.steps:
            if not isinstance(s, StepDesc):
                raise CuvilError(f"ModelInfo.steps must hold StepDesc, got {s!r}")
        for s in self.opt_steps:
            if not isinstance(s, StepDesc) or isinstance(s.extent, SymExpr):
                raise CuvilError(f"ModelInfo.opt_steps must hold StepDesc with static extents, got {s!r}")
        if self.num_run_time_symbols > len(self.symbols) or (self.num_run_time_symbols and self.opt_steps):
            raise CuvilError(f"ModelInfo: {self.num_run_time_symbols} run-time symbol(s) of {len(self.symbols)}, "
                             f"{len(self.opt_steps)} opt steps (run-time sizes have no opt point)")
        if self.batch_symbol != -1 and not (0 <= self.batch_symbol < len(self.symbols) and self.opt_steps
                                            and self.symbols[self.batch_symbol].opt >= 1
                                            and len(self.batch_slice_bytes) == len(self.inputs) + len(self.outputs)
                                            and all(isinstance(b, int) and b >= 0 for b in self.batch_slice_bytes)):
            raise CuvilError(f"ModelInfo: batch symbol {self.batch_symbol} needs opt steps, a symbol of opt >= 1 and "
                             f"the slice bytes of every input and output, got {list(self.batch_slice_bytes)}",
                             hint=_REPORT)
        if self.opt_steps and not self.symbols:
            raise CuvilError("ModelInfo.opt_steps without symbols: nothing to specialise")
        if self.external_weights_bytes and (len(self.external_weights_sha256) != 32 or self.weights_symbol
                                            or self.opt_weights_symbol):
            raise CuvilError("ModelInfo: external weights need a 32-byte SHA-256 and no embedded weights symbol")
        reserved = {f"{self.prefix}_{f}" for f in ABI_FUNCTIONS} | {f"{self.prefix}__model"}
        symbols = {s.symbol for s in self.steps} | {s.symbol for s in self.opt_steps}
        for w in {self.weights_symbol, self.opt_weights_symbol} - {None}:
            if w in symbols:
                raise CuvilError(f"weights symbol {w!r} is also a kernel symbol")
            symbols.add(w)
        clash = sorted(symbols & reserved)
        if clash:
            raise CuvilError(f"symbol(s) {', '.join(clash)} clash with the public ABI of prefix {self.prefix!r}")
