"""Element types narrower than their arithmetic, as LLVM IR shared by the x86 and PTX backends.

* bfloat16 is computed in float32 (``ll``) and stored as its upper 16 bits (``mem_type``): loads widen
  exactly, stores and conversions round to nearest even (NaN stays a quiet NaN of the same sign).
* float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ) and float4 (E2M1) values are kept as their bit patterns, one
  byte each (as ml_dtypes and onnx.numpy_helper hold them); they have no arithmetic, only conversions, which
  go through float32: :func:`decode_minifloat` is exact, :func:`encode_minifloat` rounds to nearest even and
  either saturates to the largest finite value or overflows to inf/NaN (Cast's ``saturate``), as
  ``onnx.numpy_helper.saturate_cast`` and ml_dtypes' ``astype`` do.
* 2- and 4-bit integers are held one per byte in the low bits (as ml_dtypes holds them) and computed as
  8-bit integers, sign- or zero-extended on load (:func:`load_narrow_int`) and masked on store.
"""
from __future__ import annotations

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from .types import F32, I8, I32

I16 = ir.IntType(16)


@attrs.frozen
class Minifloat:
    """A small float format: ``bits`` wide (sign included), ``m`` mantissa bits, exponent ``bias``; the
    largest finite code ``max_code`` (sign clear); ``inf_code`` where the format has infinities;
    ``nan_code`` the NaN it produces (sign clear; None: no NaN, see ``unsigned_nan``); ``unsigned_nan``:
    the FNUZ formats' single NaN is the negative-zero pattern and they have no negative zero."""
    bits: int
    m: int
    bias: int
    max_code: int
    inf_code: int | None = None
    nan_code: int | None = None
    unsigned_nan: bool = False

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def sign_shift(self) -> int:
        return self.bits - 1


MINIFLOAT_FORMATS = {
    DType.FLOAT8E4M3FN: Minifloat(8, 3, 7, 0x7E, nan_code=0x7F),
    DType.FLOAT8E4M3FNUZ: Minifloat(8, 3, 8, 0x7F, unsigned_nan=True),
    DType.FLOAT8E5M2: Minifloat(8, 2, 15, 0x7B, inf_code=0x7C, nan_code=0x7E),
    DType.FLOAT8E5M2FNUZ: Minifloat(8, 2, 16, 0x7F, unsigned_nan=True),
    DType.FLOAT4E2M1: Minifloat(4, 1, 1, 0x7),   # no inf, no NaN: always saturates
}


def _pow2(b: ir.IRBuilder, e: ir.Value) -> ir.Value:
    """2**e as float32 for an i32 exponent e in [-126, 127] (built from its bits)."""
    return b.bitcast(b.shl(b.add(e, I32(127)), I32(23)), F32)


def _smax(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.select(b.icmp_signed(">", x, y), x, y)


def decode_minifloat(b: ir.IRBuilder, code: ir.Value, fmt: Minifloat) -> ir.Value:
    """The float32 value of a minifloat bit pattern (an i8): exact."""
    c = b.zext(code, I32)
    low = (1 << fmt.sign_shift) - 1
    mag = b.and_(c, I32(low))
    sign = b.and_(b.lshr(c, I32(fmt.sign_shift)), I32(1))
    e_field = b.lshr(mag, I32(fmt.m))
    mant = b.and_(mag, I32((1 << fmt.m) - 1))
    normal = b.icmp_unsigned("!=", e_field, I32(0))
    k = b.add(mant, b.select(normal, I32(1 << fmt.m), I32(0)))
    scale = _pow2(b, b.sub(_smax(b, e_field, I32(1)), I32(fmt.bias + fmt.m)))
    v = b.fmul(b.uitofp(k, F32), scale)
    nan = ir.Constant(F32, float("nan"))
    if fmt.inf_code is not None:   # IEEE-like: the top exponent is inf (mantissa 0) or NaN
        top = b.icmp_unsigned(">=", mag, I32(fmt.inf_code))
        v = b.select(top, b.select(b.icmp_unsigned("==", mag, I32(fmt.inf_code)), ir.Constant(F32, float("inf")), nan), v)
    elif fmt.nan_code is not None:
        v = b.select(b.icmp_unsigned("==", mag, I32(fmt.nan_code)), nan, v)
    v = b.select(b.icmp_unsigned("!=", sign, I32(0)), b.fneg(v), v)    # NaNs keep their sign bit too
    if fmt.unsigned_nan:   # the negative-zero pattern (a NaN with its sign bit set, as ml_dtypes decodes it)
        v = b.select(b.icmp_unsigned("==", c, I32(1 << fmt.sign_shift)), ir.Constant(F32, float("-nan")), v)
    return v


def encode_minifloat(b: ir.IRBuilder, x: ir.Value, fmt: Minifloat, saturate: bool, roundeven) -> ir.Value:
    """The minifloat bit pattern (an i8) nearest to the float32 ``x`` (ties to even). Magnitudes past the
    largest finite value (after rounding) become it when ``saturate``, else inf or NaN (the format's);
    ``roundeven(v)`` is the target's float32 round-half-even."""
    bits = b.bitcast(x, I32)
    sign = b.lshr(bits, I32(31))
    absbits = b.and_(bits, I32(0x7FFFFFFF))
    a = b.bitcast(absbits, F32)
    exp32 = b.lshr(absbits, I32(23))
    # The binade of |x|, no lower than the format's smallest normal one: |x| = k * 2**(e - m) with k an
    # integer after rounding, and the code is ((e - emin) << m) + k, carrying into the exponent on its own.
    e = _smax(b, b.sub(exp32, I32(127)), I32(fmt.emin))
    e = b.select(b.icmp_unsigned("==", exp32, I32(255)), I32(0), e)      # inf/NaN: any in-range exponent
    k = b.fptoui(roundeven(b.fdiv(a, _pow2(b, b.sub(e, I32(fmt.m))))), I32)
    code = b.add(b.shl(b.sub(e, I32(fmt.emin)), I32(fmt.m)), k)
    is_nan = b.fcmp_unordered("uno", x, x)
    over = b.or_(b.icmp_unsigned(">", code, I32(fmt.max_code)), b.icmp_unsigned("==", absbits, I32(0x7F800000)))
    if saturate or (fmt.inf_code is None and fmt.nan_code is None and not fmt.unsigned_nan):
        over_code = I32(fmt.max_code)
    elif fmt.inf_code is not None:
        over_code = I32(fmt.inf_code)
    elif fmt.unsigned_nan:
        over_code = None
    else:
        over_code = I32(fmt.nan_code)
    sign_bit = b.shl(sign, I32(fmt.sign_shift))
    if fmt.unsigned_nan:
        nan_pattern = I32(1 << fmt.sign_shift)
        mag = b.select(over, I32(fmt.max_code), code) if over_code is not None else code
        out = b.select(b.icmp_unsigned("==", mag, I32(0)), I32(0), b.or_(mag, sign_bit))
        if over_code is None:
            out = b.select(over, nan_pattern, out)
        out = b.select(is_nan, nan_pattern, out)
    else:
        out = b.or_(b.select(over, over_code, code), sign_bit)
        if fmt.nan_code is not None:
            out = b.select(is_nan, b.or_(I32(fmt.nan_code), sign_bit), out)
        else:   # float4 has no NaN: ml_dtypes (and so onnx's reference) gives the negative zero pattern
            out = b.select(is_nan, I32(1 << fmt.sign_shift), out)
    return b.trunc(out, I8)


def decode_e8m0(b: ir.IRBuilder, code: ir.Value) -> ir.Value:
    """float8e8m0 (an unsigned power of two, 2**(code - 127); 0xFF is NaN) as float32."""
    c = b.zext(code, I32)
    bits = b.select(b.icmp_unsigned("==", c, I32(0)), I32(0x00400000), b.shl(c, I32(23)))   # 2**-127: subnormal
    v = b.bitcast(bits, F32)
    return b.select(b.icmp_unsigned("==", c, I32(0xFF)), ir.Constant(F32, float("nan")), v)


def encode_e8m0(b: ir.IRBuilder, x: ir.Value, saturate: bool, round_mode: str) -> ir.Value:
    """float32 to float8e8m0 as onnx.numpy_helper.to_float8e8m0 does: the float32 exponent field, rounded
    ``up`` (any fraction), ``down`` or to ``nearest`` (its guard/round/sticky rule), the sign ignored; inf and
    NaN give 0xFF; ``saturate`` stops rounding at 0xFE."""
    bits = b.bitcast(x, I32)
    exponent = b.and_(b.lshr(bits, I32(23)), I32(0xFF))
    special = b.icmp_unsigned("==", exponent, I32(0xFF))
    if round_mode == "up":
        up = b.icmp_unsigned("!=", b.and_(bits, I32(0x7FFFFF)), I32(0))
    elif round_mode == "nearest":
        g = b.icmp_unsigned("!=", b.and_(bits, I32(0x400000)), I32(0))
        r = b.icmp_unsigned("!=", b.and_(bits, I32(0x200000)), I32(0))
        sticky = b.icmp_unsigned("!=", b.and_(bits, I32(0x1FFFFF)), I32(0))
        lsb = b.icmp_unsigned("!=", exponent, I32(0))
        up = b.and_(g, b.or_(r, b.or_(sticky, lsb)))
    else:
        up = ir.Constant(ir.IntType(1), 0)
    if saturate:
        up = b.and_(up, b.icmp_unsigned("!=", exponent, I32(0xFE)))
    out = b.add(exponent, b.zext(up, I32))
    return b.trunc(b.select(special, I32(0xFF), out), I8)


def round_bfloat16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """The float32 ``x`` rounded to bfloat16 precision (nearest, ties to even), as float32 bits (an i32 whose
    low 16 bits are zero); NaN stays a quiet NaN of the same sign."""
    bits = b.bitcast(x, I32)
    lsb = b.and_(b.lshr(bits, I32(16)), I32(1))
    rounded = b.and_(b.add(bits, b.add(I32(0x7FFF), lsb)), I32(0xFFFF0000 - (1 << 32)))
    quiet = b.or_(b.and_(bits, I32(0xFFFF0000 - (1 << 32))), I32(0x00400000))
    return b.select(b.fcmp_unordered("uno", x, x), quiet, rounded)


def bfloat16_to_memory(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return b.trunc(b.lshr(round_bfloat16(b, x), I32(16)), I16)


def bfloat16_from_memory(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return b.bitcast(b.shl(b.zext(v, I32), I32(16)), F32)


def bfloat16_round(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``x`` (float32) rounded to a bfloat16 value, kept in float32."""
    return b.bitcast(round_bfloat16(b, x), F32)


def load_narrow_int(b: ir.IRBuilder, v: ir.Value, dt: DType) -> ir.Value:
    """A 2- or 4-bit integer's byte as its 8-bit value (sign-extended for the signed types)."""
    n = dt.narrow_bits
    if dt in (DType.INT4, DType.INT2):
        return b.ashr(b.shl(v, I8(8 - n)), I8(8 - n))
    return b.and_(v, I8((1 << n) - 1))


def store_narrow_int(b: ir.IRBuilder, v: ir.Value, dt: DType) -> ir.Value:
    return b.and_(v, I8((1 << dt.narrow_bits) - 1))


def wrap_narrow_int(b: ir.IRBuilder, v: ir.Value, dt: DType) -> ir.Value:
    """An 8-bit value reduced to the 2- or 4-bit type's range (wrapping), in its 8-bit form."""
    return load_narrow_int(b, store_narrow_int(b, v, dt), dt)
