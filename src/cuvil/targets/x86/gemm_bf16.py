"""bfloat16 contractions on x86 with AVX512_BF16 (``vdpbf16ps``): the pieces the GEMM micro-kernels
(:mod:`cuvil.targets.x86.gemm` for convolutions, :mod:`cuvil.targets.x86.matmul` for MatMul / Gemm) swap in
for a contraction whose ``precision`` is ``"bf16"`` (set from ``Node.precision`` by the precision policy).

``vdpbf16ps acc, a, b`` adds, in each 32-bit lane ``i``, ``a[2i] * b[2i] + a[2i+1] * b[2i+1]`` (bfloat16
products, exact in float32) to the float32 ``acc[i]``: one instruction does the work of two FMAs. Its
operands hold *pairs* of consecutive ``k`` per lane, so

* the weights are rounded to bfloat16 and packed at compile time in pairs along K
  (:func:`cuvil.kernels.contraction.pack_columns_bf16`: ``[Mb, ceil(K/2), cols, 2]``;
  :func:`cuvil.kernels.contraction.pack_weights_bf16`: ``[G, Mb, ceil(K/2), mr, 2]``), odd K padded with a
  zero: a k-step of the micro-kernel reads a pair as one 32-bit word (broadcast) or 16 pairs as a vector;
* the activations are rounded once per panel (``vcvtneps2bf16``, nearest even; denormals flush to zero):
  a MatMul's rows of A into per-thread scratch (consecutive k are already pairs there), a convolution's
  packed float32 B panel into a pair panel ``[ceil(K/2), cols, 2]`` (rows k and k+1 interleaved);
* the k-loop runs over pairs, with the same register tile, accumulators, epilogues (bias, BatchNorm,
  residual, activations) and stores as the float32 kernels: accumulators and outputs stay float32.

Each stage emitted this way is recorded as ``km.narrow_paths[sym] = "avx512_bf16"``, which the manifest's
steps report as ``precision`` / ``path``.
"""
from __future__ import annotations

from typing import Optional

import llvmlite.ir as ir

from ..llvm.types import F32, I32, I64, PTR
from .amx import AMX_BF16_PATH, has_amx

#: the ISA feature (LLVM spelling) the bf16 kernels need; its cpuid name is ``avx512_bf16``
BF16_FEATURE = "avx512bf16"
#: the path recorded for a kernel emitted here
AVX512_BF16 = "avx512_bf16"


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no type for it): only used in vector types of intrinsic operands."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


BFLOAT = _BFloat()
VW = 16                     # float32 lanes of a zmm register
PAIRS = ir.VectorType(I32, VW)          # 16 lanes of bfloat16 pairs, as the kernels load and store them
BF32 = ir.VectorType(BFLOAT, 2 * VW)    # the same bits as the intrinsic's operand type
F32X16 = ir.VectorType(F32, VW)


def bf16_supported(km) -> bool:
    """Whether the kernel module's CPU runs the bf16 micro-kernels (AVX-512 with AVX512_BF16)."""
    return km.vector_bits >= 512 and BF16_FEATURE in getattr(km, "cpu_features", ())


def dpbf16(km, b: ir.IRBuilder):
    """``mac(a, w, acc)``: ``acc + dot of the pairs`` lane by lane (``vdpbf16ps``); ``a`` and ``w`` are
    ``<16 x i32>`` vectors of bfloat16 pairs, ``acc`` float32."""
    fn = km.declare("llvm.x86.avx512bf16.dpbf16ps.512", F32X16, [F32X16, BF32, BF32])

    def mac(a, w, acc):
        return b.call(fn, [acc, b.bitcast(a, BF32), b.bitcast(w, BF32)])
    return mac


#: AVX512_BF16's rounding of 16 floats, as its intrinsic (what LLVM lowers an fptrunc to bfloat to on such a CPU)
CVTNEPS2BF16 = "llvm.x86.avx512bf16.cvtneps2bf16.512"


def to_bf16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``<16 x float>`` rounded to ``<16 x bfloat>`` (nearest even: ``vcvtneps2bf16``), through the instruction's
    intrinsic rather than an ``fptrunc``: LLVM's combiner moves shuffles of fptrunc results above the fptrunc,
    and an fptrunc of 32 floats picked from two strided masked loads (a stride-2 pair-planes pass) stopped its
    instruction selection on an assertion (an abort, LLVM 22.1 in llvmlite 0.50). The same instruction either way,
    so the same bits. (Other widths than 16 lanes: the fptrunc.)"""
    if x.type.count != VW:
        return b.fptrunc(x, ir.VectorType(BFLOAT, x.type.count))
    mod = b.module
    fn = mod.globals.get(CVTNEPS2BF16)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ir.VectorType(BFLOAT, VW), [ir.VectorType(F32, VW)]), CVTNEPS2BF16)
    return b.call(fn, [x])


def consecutive_pairs(b: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """32 consecutive floats (``lo`` then ``hi``, 16 each) as 16 bfloat16 pairs (``<16 x i32>``)."""
    cat = b.shuffle_vector(to_bf16(b, lo), to_bf16(b, hi), ir.Constant(ir.VectorType(I32, 2 * VW), list(range(2 * VW))))
    return b.bitcast(cat, PAIRS)


def interleaved_pairs(b: ir.IRBuilder, even: ir.Value, odd: ir.Value) -> ir.Value:
    """Two rows of 16 floats (``even``: k, ``odd``: k + 1) as the 16 pairs ``(even[i], odd[i])``."""
    idx = [i // 2 + (VW if i % 2 else 0) for i in range(2 * VW)]
    cat = b.shuffle_vector(to_bf16(b, even), to_bf16(b, odd), ir.Constant(ir.VectorType(I32, 2 * VW), idx))
    return b.bitcast(cat, PAIRS)


def row_stride_pairs(k: int) -> int:
    """i32 words per row of A rounded in scratch: ceil(K / 2) rounded up to whole vectors (16 pairs)."""
    return -(-k // (2 * VW)) * VW


def convert_rows(em, src_rows, dst, k: int) -> None:
    """Rows of float32 (``src_rows``: one pointer per row, ``k`` floats each) to bfloat16 pairs at ``dst``
    (an i32 pointer; row r at ``r * row_stride_pairs(k)``), 32 floats per step, the last step masked to the
    row (the pairs past ``k`` are zero)."""
    b = em.b
    stride = row_stride_pairs(k)
    full = k // (2 * VW)
    tail = k - full * 2 * VW
    i1v = ir.VectorType(ir.IntType(1), VW)
    mload = em.km.declare(f"llvm.masked.load.v{VW}f32.p0", F32X16, [PTR, I32, i1v, F32X16])
    zero = ir.Constant(F32X16, [0.0] * VW)

    def fp(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    for r, src in enumerate(src_rows):
        row = b.gep(dst, [I64(r * stride)], source_etype=I32, inbounds=True)

        def step(s, src=src, row=row):
            lo = b.load(fp(src, b.mul(s, I64(2 * VW))), typ=F32X16, align=4)
            hi = b.load(fp(src, b.add(b.mul(s, I64(2 * VW)), I64(VW))), typ=F32X16, align=4)
            b.store(consecutive_pairs(b, lo, hi), b.gep(row, [b.mul(s, I64(VW))], source_etype=I32, inbounds=True),
                    align=4)
        if full:
            em.loop_range(I64(0), I64(full), step)
        if tail:
            halves = []
            for h in range(2):
                n = min(max(tail - h * VW, 0), VW)
                if n == 0:
                    halves.append(zero)
                    continue
                mask = ir.Constant(i1v, [lane < n for lane in range(VW)])
                halves.append(b.call(mload, [fp(src, I64(full * 2 * VW + h * VW)), I32(4), mask, zero]))
            b.store(consecutive_pairs(b, *halves), b.gep(row, [I64(full * VW)], source_etype=I32, inbounds=True),
                    align=4)


def narrow_path(km, spec) -> Optional[str]:
    """The path a contraction ``spec`` takes on this kernel module: ``"amx_bf16"`` for a bf16 one lowered for
    AMX tiles (``spec.amx``, :mod:`cuvil.targets.x86.amx`), ``"avx512_bf16"`` for a bf16 one on a CPU
    with AVX512_BF16, None for a float32 one. A bf16 contraction on a CPU without it is evaluated by the
    generic loop nest (its expression rounds the same way), ``"fp32 fallback"``."""
    if getattr(spec, "precision", "") != "bf16":
        return None
    if getattr(spec, "amx", False):      # weights in the AMX tile layouts (lowered for a CPU with AMX)
        return AMX_BF16_PATH if bf16_supported(km) and has_amx(km.cpu_features) else "fp32 fallback"
    return AVX512_BF16 if bf16_supported(km) else "fp32 fallback"


def narrow_formats(cpu) -> tuple:
    """The Node.precision formats the x86 micro-kernels compute in on ``cpu`` (a CpuDescription):
    ``("bf16",)`` with AVX-512 and AVX512_BF16, else none."""
    return ("bf16",) if cpu.vector_bits >= 512 and BF16_FEATURE in cpu.features else ()


#: the ops whose contractions take the bf16 micro-kernels (a Conv's depthwise form stays float32)
BF16_OPS = frozenset({"Conv", "MatMul", "Gemm"})


def bf16_isa_checks(*targets) -> list:
    """``["avx512bf16"]`` when one of the code generator's results (``generate_object``'s third value, None
    skipped) has a kernel on the avx512_bf16 path: the library's C code then checks that feature at
    session creation too (``__builtin_cpu_supports``), so that a C program gets CUVIL_ERR_UNSUPPORTED
    instead of SIGILL."""
    used = any(AVX512_BF16 in (t or {}).get("narrow_paths", {}).values() for t in targets)
    return [BF16_FEATURE] if used else []
