"""Float32 exp, erf, tanh and log as straight-line LLVM IR: range reduction, a polynomial, selects for the
special values. No calls and no branches, so the loop vectoriser widens a loop that uses them to AVX2 /
AVX-512 code (a libm call inside a loop keeps it scalar, one call per element).

Every function returns what glibc's float32 function returns for NaN (NaN), +-inf, +-0, denormals and past
the overflow / underflow thresholds (inf, 0, +-1 for erf and tanh). The largest errors in ULPs against the
exact result, measured over every 64th float32 (bench/vecmath.py, docs/math.md, asserted by
tests/test_vecmath.py), are below 1.5 ULP. The coefficients are near-minimax fits made by bench/vecmath_fit.py.

Multiply-adds are ``llvm.fmuladd``: one fused instruction on CPUs with FMA, a multiply and an add elsewhere
(the stated bounds are measured with FMA).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import llvmlite.ir as ir

from .types import F32, I32

# exp(r) = 1 + r + r^2 * q(r) on |r| <= ln2/2
EXP_Q = (0.5, 0.1666666716337204, 0.041666530072689056, 0.008333245292305946, 0.0013928738189861178,
         0.00019908770627807826)
# erf(x) = x + x * p(x^2) on |x| < 1
ERF_SMALL = (0.12837916612625122, -0.3761262595653534, 0.11283598840236664, -0.02685493417084217, 0.005191358271986246,
             -0.0008043400011956692, 7.981615635799244e-05)
# erfc(x) = exp(-x^2) * r(1/x) on 1 <= x <= 4
ERFC_SCALED = (0.00012107974907848984, 0.5617679357528687, 0.020536068826913834, -0.3758641183376312, 0.23039808869361877,
               0.23832830786705017, -0.5369415879249573, 0.43823447823524475, -0.17971007525920868,
               0.030713405460119247)
# tanh(x) = x + x^3 * p(x^2) on |x| < 0.875
TANH_SMALL = (-0.3333333432674408, 0.13333378732204437, -0.05396980047225952, 0.021842414513230324, -0.008651437237858772,
              0.0029857270419597626, -0.0006172444554977119)
# log(1 + f) = f - f^2/2 + f^3 * p(f) on sqrt(1/2) - 1 <= f < sqrt(2) - 1
LOG1P_P = (0.3333333134651184, -0.2499999850988388, 0.20000635087490082, -0.16667519509792328, 0.14254149794578552,
           -0.12438788264989853, 0.11588440090417862, -0.11253125965595245, 0.07533948868513107,
           -0.01310474332422018)

# ln 2 split so that n * LN2_HI is exact for |n| < 2^8 (LN2_HI has 16 significant bits)
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094172e-06
LOG2E = 1.4426950408889634
ROUND_SHIFTER = 12582912.0   # 1.5 * 2^23: adding and subtracting it rounds a float32 below 2^22 to an integer
EXP_MAX = 89.0               # exp(x) is inf in float32 from x = 88.7228394
EXP_MIN = -104.0             # and rounds to 0 below x = -103.972
ERF_SPLIT = 1.0              # erf: the polynomial below, 1 - erfc above
TANH_SPLIT = 0.875           # tanh: the polynomial below, 1 - 2 / (e^2x + 1) above


def f32(v: float) -> ir.Constant:
    return ir.Constant(F32, v)


def i32(v: int) -> ir.Constant:
    return ir.Constant(I32, v)


class VectorMath:
    """Emits the functions through builder ``b``; ``declare(name, ret, args)`` declares an intrinsic.
    ``lanes`` > 1: the functions take and return ``<lanes x float>`` vectors, each lane computed by the same
    instructions as the scalar form (the same bits), for a kernel that holds its values in vector registers
    instead of leaving a scalar loop to the vectoriser.

    ``scalef``: exp's last step, ``p * 2^n``, is one ``llvm.ldexp``, which LLVM lowers to AVX-512F's
    ``vscalefps`` (the loop vectoriser widens the scalar form): for a target with AVX-512F only (elsewhere
    LLVM expands it into ``ldexpf`` calls). The same bits: ``p`` is normal and the exact ``p * 2^n`` is
    rounded once either way (the portable form multiplies by ``2^(n/2)`` exactly, then by the rest, one
    rounding), and 9 instructions of the portable form's ~30 become 3 (``vcvttps2dq``, ``vcvtdq2ps``,
    ``vscalefps``)."""

    def __init__(self, b: ir.IRBuilder, declare: Callable[[str, ir.Type, Sequence[ir.Type]], ir.Function],
                 lanes: int = 1, scalef: bool = False):
        self.b = b
        self.lanes = lanes
        self.ft = F32 if lanes == 1 else ir.VectorType(F32, lanes)
        self.it = I32 if lanes == 1 else ir.VectorType(I32, lanes)
        suffix = "f32" if lanes == 1 else f"v{lanes}f32"
        isuffix = "i32" if lanes == 1 else f"v{lanes}i32"
        self._ldexp = declare(f"llvm.ldexp.{suffix}.{isuffix}", self.ft, [self.ft, self.it]) if scalef else None
        self._fmuladd = declare(f"llvm.fmuladd.{suffix}", self.ft, [self.ft, self.ft, self.ft])
        self._fabs = declare(f"llvm.fabs.{suffix}", self.ft, [self.ft])
        self._copysign = declare(f"llvm.copysign.{suffix}", self.ft, [self.ft, self.ft])

    # --- pieces ----------------------------------------------------------------------------------
    def f(self, v: float) -> ir.Constant:
        """The float32 constant ``v`` (in every lane)."""
        return f32(v) if self.lanes == 1 else ir.Constant(self.ft, [v] * self.lanes)

    def i(self, v: int) -> ir.Constant:
        """The int32 constant ``v`` (in every lane)."""
        return i32(v) if self.lanes == 1 else ir.Constant(self.it, [v] * self.lanes)

    def fma(self, a, c, d):
        return self.b.call(self._fmuladd, [a, c, d])

    def horner(self, x, coeffs: Sequence[float]):
        acc = self.f(coeffs[-1])
        for c in reversed(coeffs[:-1]):
            acc = self.fma(acc, x, self.f(c))
        return acc

    def below(self, x, limit: float, other):
        """``x`` where ``x < limit``, else ``other`` (NaN takes ``other``)."""
        return self.b.select(self.b.fcmp_ordered("<", x, self.f(limit)), x, other)

    def nan_passes(self, x, y):
        """``y``, or ``x`` where ``x`` is NaN."""
        return self.b.select(self.b.fcmp_unordered("uno", x, x), x, y)

    def pow2(self, n):
        """2^n for an i32 n in [-126, 127], built in the exponent bits."""
        b = self.b
        return b.bitcast(b.shl(b.add(n, self.i(127)), self.i(23)), self.ft)

    # --- functions --------------------------------------------------------------------------------
    def exp(self, x, inside: bool = False):
        """e^x = 2^n * e^r, n = round(x / ln2), r = x - n ln2 (Cody-Waite, two parts of ln2), e^r a
        polynomial; 2^n applied as two factors so that results down to the denormals come out of one
        rounding and overflow gives inf. ``inside``: the caller's ``x`` is finite and within [EXP_MIN, EXP_MAX]
        (erf's -x^2 over its clamped range), where the clamps and the NaN test are identities: left out."""
        b = self.b
        if inside:
            xc = x
        else:
            xc = self.below(x, EXP_MAX, self.f(EXP_MAX))                 # NaN -> EXP_MAX; answered at the end
            xc = b.select(b.fcmp_ordered(">", xc, self.f(EXP_MIN)), xc, self.f(EXP_MIN))
        n = b.fsub(self.fma(xc, self.f(LOG2E), self.f(ROUND_SHIFTER)), self.f(ROUND_SHIFTER))
        hi = self.fma(n, self.f(-LN2_HI), xc)                            # exact
        lo = b.fmul(n, self.f(-LN2_LO))
        r = b.fadd(hi, lo)
        # 1 + hi + (lo + r^2 q(r)): lo joins the small terms, so r's rounding does not reach the result
        p = b.fadd(b.fadd(hi, self.fma(b.fmul(r, r), self.horner(r, EXP_Q), lo)), self.f(1.0))
        ni = b.fptosi(n, self.it)                                          # in [-150, 128]
        if self._ldexp is not None:
            y = b.call(self._ldexp, [p, ni])
        else:
            n1 = b.ashr(ni, self.i(1))
            y = b.fmul(b.fmul(p, self.pow2(n1)), self.pow2(b.sub(ni, n1)))
        return y if inside else self.nan_passes(x, y)

    def erf(self, x):
        """x + x p(x^2) below |x| = 1; 1 - exp(-x^2) r(1/|x|) (with x's sign) from there (x clamped to 4,
        where erf is 1 in float32)."""
        b = self.b
        a = b.call(self._fabs, [x])
        small = self.fma(x, self.horner(b.fmul(x, x), ERF_SMALL), x)
        ac = b.select(b.fcmp_ordered(">", a, self.f(ERF_SPLIT)), a, self.f(ERF_SPLIT))
        ac = self.below(ac, 4.0, self.f(4.0))
        # -ac^2 in [-16, -1] (a NaN x gives ac = 1): exp's clamps would not change it
        erfc = b.fmul(self.exp(b.fneg(b.fmul(ac, ac)), inside=True),
                      self.horner(b.fdiv(self.f(1.0), ac), ERFC_SCALED))
        large = b.call(self._copysign, [b.fsub(self.f(1.0), erfc), x])
        return self.nan_passes(x, b.select(b.fcmp_ordered("<", a, self.f(ERF_SPLIT)), small, large))

    def tanh(self, x):
        """x + x^3 p(x^2) below |x| = 0.875; 1 - 2 / (e^(2|x|) + 1) from there (e^(2|x|) = inf gives 1); x's
        sign on both (-0 stays -0: x + x^3 p alone gives +0 there)."""
        b = self.b
        a = b.call(self._fabs, [x])
        z = b.fmul(a, a)
        small = self.fma(b.fmul(a, z), self.horner(z, TANH_SMALL), a)
        large = b.fsub(self.f(1.0), b.fdiv(self.f(2.0), b.fadd(self.exp(b.fadd(a, a)), self.f(1.0))))
        y = b.select(b.fcmp_ordered("<", a, self.f(TANH_SPLIT)), small, large)
        return self.nan_passes(x, b.call(self._copysign, [y, x]))

    def log(self, x):
        """k ln2 + log(1 + f) with x = 2^k (1 + f), 1 + f in [sqrt(1/2), sqrt(2)) (denormals scaled by 2^23
        first); 0 gives -inf, a negative x NaN, inf inf."""
        b = self.b
        tiny = b.fcmp_ordered("<", x, self.f(1.1754943508222875e-38))
        xs = b.select(tiny, b.fmul(x, self.f(8388608.0)), x)
        ix = b.sub(b.bitcast(xs, self.it), self.i(0x3F3504F3))      # exponent relative to sqrt(1/2)
        k = b.add(b.ashr(ix, self.i(23)), b.select(tiny, self.i(-23), self.i(0)))
        m = b.bitcast(b.add(b.and_(ix, self.i(0x7FFFFF)), self.i(0x3F3504F3)), self.ft)
        f = b.fsub(m, self.f(1.0))
        f2 = b.fmul(f, f)
        kf = b.sitofp(k, self.ft)
        tail = b.fsub(b.fmul(b.fmul(f2, f), self.horner(f, LOG1P_P)), b.fmul(self.f(0.5), f2))
        y = b.fadd(self.fma(kf, self.f(LN2_LO), tail), f)
        y = self.fma(kf, self.f(LN2_HI), y)
        y = b.select(b.fcmp_ordered("==", x, self.f(math.inf)), x, y)
        y = b.select(b.fcmp_ordered("==", x, self.f(0.0)), self.f(-math.inf), y)
        return b.select(b.fcmp_unordered("<", x, self.f(0.0)), self.f(math.nan), y)   # negative or NaN


# the math functions (as the kernels' ``call`` names them) that VectorMath emits for float32
VECTOR_FUNCTIONS = frozenset({"exp", "erf", "tanh", "log"})
