"""bf16 *relative to float32*: the certificate an explicit ``--precision bf16`` accepts for a contraction whose
float32 range is not certified.

bfloat16 keeps float32's 8-bit exponent, so rounding a float32 value to it cannot overflow unless the value is
already within 2^-8 of float32's largest one. Precisely (:func:`rounding_lemma`, proved bit-exactly by Z3 over
every float32 ``x``, round to nearest even, subnormals included):

    |x| <= 0x1.fep127 (bf16's largest finite)  =>  bf16(x) is finite and |bf16(x)| <= |x|·(1 + 2^-8) + 2^-126

A contraction narrowed to bf16 (``Conv``, ``MatMul``, ``Gemm``: inputs and weights rounded, products exact in
float32, float32 accumulation) therefore holds, term by term, at most ``(1 + 2^-8)^2`` times (plus the subnormal
slack) what the same float32 contraction's ``sum |a|·|w|`` holds on the same inputs: narrowing it can make a value
non-finite only where float32's own sum of magnitudes comes within 0.8% of float32's largest value
(3.4e38), i.e. where float32 itself is at the edge of overflowing.

That is a proof of a *relative* statement, not of a range: it says bf16 adds no overflow float32 does not nearly
have, not that float32 has none. The policy uses it only where the user asked for bf16 explicitly and the
absolute verdict is ``unknown`` (the intervals, compounding over a deep network, passed ±1.7e38): the node is
narrowed and its reason says "relative to float32". ``auto`` never narrows on it (``auto`` promises no value
non-finite that float32 computes finite, for every input of the box), nor does fp16 (its range is not
float32's).
"""
from __future__ import annotations

import functools
from typing import Optional

#: NodePlan.certificate of a node narrowed on this certificate
RELATIVE = "relative to float32"

#: The ops the relative certificate covers: rounded inputs, exact products, float32 accumulation.
CONTRACTIONS = frozenset({"Conv", "MatMul", "Gemm"})

#: Ops whose output magnitude is bounded by a monotone function of their inputs' magnitudes (no divisor, root,
#: logarithm or exponential): a bf16-rounded input larger by a factor makes their output larger by at most a
#: bounded factor, so they can overflow only where float32's magnitudes nearly do. The policy's re-check of the
#: ranges after narrowing (``_recheck_narrowed``) lets an explicit bf16 keep its narrowed contractions where only
#: such ops' bounds outgrew float32 (``auto`` reverts them).
MAGNITUDE_OPS = CONTRACTIONS | frozenset({
    "Add", "Sub", "Sum", "Mul", "Neg", "Relu", "LeakyRelu", "PRelu", "Clip", "Max", "Min", "MaxPool",
    "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "BatchNormalization", "Concat", "Identity",
    "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Pad", "Slice", "Split", "Gather"})

#: How much a bf16 contraction's magnitudes may exceed float32's (two rounded factors per product).
GROWTH = (1 + 2.0 ** -8) ** 2


@functools.lru_cache(maxsize=None)
def rounding_lemma() -> str:
    """Prove the rounding lemma of the module doc with Z3 (bit-exact floating point; about a second, once per
    process); returns the proof's one-line statement, or raises ``RuntimeError`` if Z3 does not prove it."""
    import z3
    f32, f64 = z3.Float32(), z3.Float64()
    x = z3.FP("x", f32)
    r = z3.fpFPToFP(z3.RNE(), x, z3.FPSort(8, 8))                  # float32 -> bf16, nearest even
    wide = lambda v: z3.fpFPToFP(z3.RNE(), v, f64)                  # exact widenings
    ax, ar = z3.fpAbs(wide(x)), z3.fpAbs(wide(z3.fpFPToFP(z3.RNE(), r, f32)))
    # the bound rounded downward in float64, so proving |r| below it proves |r| below the exact bound
    bound = z3.fpAdd(z3.RTN(), z3.fpMul(z3.RTN(), ax, z3.FPVal(1 + 2.0 ** -8, f64)), z3.FPVal(2.0 ** -126, f64))
    s = z3.Solver()
    s.add(z3.Not(z3.fpIsNaN(x)), z3.Not(z3.fpIsInf(x)),
          z3.fpLEQ(z3.fpAbs(x), z3.FPVal(float.fromhex("0x1.fep127"), f32)))
    s.add(z3.Not(z3.And(z3.Not(z3.fpIsInf(r)), z3.fpLEQ(ar, bound))))
    verdict = s.check()
    if verdict != z3.unsat:
        raise RuntimeError(f"Z3 did not prove the bf16 rounding lemma ({verdict}): bf16 relative certificates "
                           "are unavailable; --precision bf16 then narrows only certified nodes")
    return ("Z3 (bit-exact): for every float32 |x| <= 0x1.fep127, bf16(x) is finite and |bf16(x)| <= "
            "|x|(1+2^-8) + 2^-126")


def relative_reason(op: str, absolute: str, unit: Optional[float] = None) -> str:
    """The reason recorded for a contraction narrowed on the relative certificate; ``absolute`` is why its
    absolute verdict is unknown. ``unit``: where the target computes it in transformed form (x86's bf16 Winograd
    F(2x2): :data:`cuvil.targets.x86.choose.BF16_WINOGRAD_UNIT`), the unit roundoff that bounds its rounding. Its
    error is then not relative to float32's own sum of |products| at that output (a transformed tile mixes every
    input of its window with every weight: where float32's products are all zero the Winograd value need not be),
    but to the magnitudes the interval analysis bounds it by: at most 2.01·unit times the sum over its input
    channels of (the largest |input| of its 4x4 input tile) x (the sum of the channel's |weights|), so the statement names
    that quantity."""
    if unit is None:
        return (f"bf16 relative to float32 (--precision bf16): {op} rounds its inputs to bf16 and accumulates in "
                f"float32, so it can overflow only where float32's own sum of |products| comes within {GROWTH:.4f}x "
                f"of float32's largest value [{rounding_lemma()}]; its absolute range is not certified ({absolute})")
    return (f"bf16 relative to float32's magnitudes (--precision bf16): {op} runs as the target's Winograd F(2x2) "
            f"form, its transformed input and weights rounded to bf16, float32 sums, so its values stay within "
            f"{2.01 * unit:.4f}x the sum over input channels of (largest |input| of its 4x4 input tile) x (sum of the "
            f"channel's |weights|) of the exact ones: it can overflow only where that sum comes within "
            f"{1 + 2.01 * unit:.4f}x of float32's largest value [{rounding_lemma()}]; its absolute range is not "
            f"certified ({absolute})")
