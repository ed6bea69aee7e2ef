"""float16 products on x86: weights stored as IEEE half, products and sums in float32 (``vcvtph2ps``).

A MatMul or Gemm with constant weights whose ``precision`` is ``"fp16"`` (set by the precision policy where the
ranges are certified for float16, or by the caller) is computed as

* the weights rounded to float16 (nearest even) at compile time and packed in the float32 kernel's panels
  ``[Mb, K, cols]`` (:func:`cuvil.kernels.contraction.pack_columns`), half the bytes;
* the rows of A rounded to float16 once, by a stage before the product (kept as float32: the value is the same);
* the float32 register tile of :mod:`cuvil.targets.x86.matmul`, whose k-loop widens each panel vector as it
  loads it (``vcvtph2ps`` with a memory operand: exact) and accumulates in float32 with FMAs.

A product of two float16 values is exact in float32 (11 + 11 significant bits), so the only roundings are the
operands' (the certificate's) and float32's accumulation, as the policy assumes (``docs/precision.md``).

Why not AVX512-FP16's arithmetic: ``vfmadd231ph`` accumulates in float16 (11 bits), which the policy's
certificates do not cover, and this ISA has no float16 dot product into float32 (AVX10.2's ``vdpphps``). The
conversion instructions are F16C's (every AVX2 and AVX-512 CPU), so the path runs wherever the float32 kernels
run. What it buys is bytes: the dense layers of a decode step, which stream their weights from memory, read
half as many; compute-bound products (prefill, large batches) run at the float32 kernel's rate plus the widening.

Convolutions narrowed to fp16 have no kernel here: they compute from rounded inputs in the generic loop nest,
and the precision policy does not offer them (``FP16_OPS``).
"""
from __future__ import annotations

from ..llvm.types import F16

#: the ISA feature (LLVM and cpuid spelling) the float16 weight loads need
FP16_FEATURE = "f16c"
#: the path recorded for a kernel on float16 weight panels (``km.narrow_paths``, the manifest's steps)
F16C_PATH = "f16c"
#: the ops whose contractions take float16 weight panels
FP16_OPS = frozenset({"MatMul", "Gemm"})
#: LLVM's element type of a float16 weight panel
HALF = F16


def fp16_formats(cpu) -> tuple:
    """``("fp16",)`` where the float32 micro-kernels run (AVX2 or AVX-512) and the CPU has F16C."""
    return ("fp16",) if cpu.vector_bits >= 256 and FP16_FEATURE in cpu.features else ()


def fp16_supported(km) -> bool:
    """Whether the kernel module's CPU converts float16 vectors (F16C)."""
    return km.vector_bits >= 256 and FP16_FEATURE in getattr(km, "cpu_features", ())


def fp16_isa_checks(cpu, *targets, half_values: bool = False) -> list:
    """``["f16c"]`` when one of the code generator's results (None skipped) has a kernel on the f16c path or the
    model holds float16 values (``half_values``: its conversions), and ``"avx512fp16"`` too when ``cpu`` (the
    CpuDescription built for) has it: LLVM then converts with that ISA's ``vcvtph2psx`` / ``vcvtps2phx``. The
    library's C code checks them at session creation, so a C program on a CPU without them gets
    CUVIL_ERR_UNSUPPORTED instead of SIGILL."""
    used = half_values or any(F16C_PATH in (t or {}).get("narrow_paths", {}).values() for t in targets)
    if not used:
        return []
    return [f for f in (FP16_FEATURE, "avx512fp16") if f in cpu.features]
