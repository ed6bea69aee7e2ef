"""Intel AMX (Advanced Matrix Extensions) on x86: the feature test, the Linux permission and the tile
operations the AMX micro-kernels (bf16: :mod:`cuvil.targets.x86.gemm`, :mod:`cuvil.targets.x86.matmul`;
int8 builds on the same pieces) emit.

AMX adds eight tile registers ``tmm0..7`` of up to 16 rows x 64 bytes and a tile unit that multiplies them:
``tdpbf16ps c, a, b`` adds to the float32 tile ``c[M x N]`` the products of the bfloat16 tiles ``a[M x 2K]``
(rows of consecutive k) and ``b[K x 2N]`` (rows of *pairs* of k, "VNNI-2": the word ``b[k2, n]`` holds
``(B[2 k2, n], B[2 k2 + 1, n])``): with full tiles 16 x 16 x 32, 16384 multiply-adds per instruction.

How the pieces are emitted here: through LLVM's shape-carrying intrinsics
(``llvm.x86.tileloadd64.internal``, ``llvm.x86.tdpbf16ps.internal``, ``llvm.x86.tilestored64.internal``,
``llvm.x86.tilezero.internal``), whose operands give each tile's rows and bytes per row. LLVM (22 in
llvmlite 0.50) allocates the tile registers, writes the 64-byte configuration (palette 1: bytes per row and
rows of each tile) and issues ``ldtilecfg`` in the prologue of each function that uses tiles and
``tilerelease`` before it returns. The tile state is per thread: every kernel call configures its own
thread, so the runtime's worker threads need nothing more. Tile values (``x86_amx``) may be carried by phi
nodes across a loop (the accumulators of a k-loop); the shapes must be constants or values defined before the
first tile operation of the function.

Linux keeps the tile data state (XTILEDATA, xfeature 18) off for a process until it asks for it:
``arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, 18)``; the first tile instruction without it raises SIGILL. A
library with AMX kernels makes that request when a session is created (:func:`amx_permission_c`, in the
library's ``missing_isa`` check, after ``__builtin_cpu_supports``); a refusal (an old kernel, a seccomp
filter) fails the session with CUVIL_ERR_UNSUPPORTED and a message, never a SIGILL. The in-process test of
this module (:func:`request_permission`) does the same through ctypes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Iterable, Optional

import llvmlite.ir as ir

from ...kernels.contraction import AMX_TILES
from ..llvm.types import I64

#: LLVM's names of the AMX features (cpuid: amx_tile, amx_bf16, amx_int8 in /proc/cpuinfo)
AMX_TILE = "amx-tile"
AMX_BF16 = "amx-bf16"
AMX_INT8 = "amx-int8"
#: the path recorded in ``km.narrow_paths`` / the manifest for a kernel on bf16 tiles
AMX_BF16_PATH = "amx_bf16"

#: tile geometry (palette 1): rows per tile, bytes per row
TILE_ROWS = 16
TILE_BYTES = 64
#: Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before the first tile instruction
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158          # x86-64

I16 = ir.IntType(16)


class _Amx(ir.Type):
    """LLVM's ``x86_amx`` (llvmlite has no type for it): the value of a tile register."""

    def _to_string(self) -> str:
        return "x86_amx"

    def __eq__(self, other) -> bool:
        return isinstance(other, _Amx)

    def __hash__(self) -> int:
        return hash("x86_amx")


X86_AMX = _Amx()


def has_amx(features: Iterable[str], kind: str = AMX_BF16) -> bool:
    """Whether a CPU with ISA ``features`` (LLVM spellings) runs tiles of ``kind`` (amx-bf16 / amx-int8): it
    needs AMX-TILE too, and AVX-512 for the kernels' conversions and epilogues around the tiles."""
    feats = set(features)
    return AMX_TILE in feats and kind in feats and "avx512f" in feats and "avx512bf16" in feats


def amx_formats(cpu) -> tuple:
    """What the lowering adds to a CpuDescription's narrow formats: ``(AMX_TILES,)`` when its bf16 contractions
    take AMX tiles (the dispatch order: AMX > AVX512_BF16 > float32), else none."""
    return (AMX_TILES,) if cpu.vector_bits >= 512 and has_amx(cpu.features) else ()


def amx_isa_checks(kind: str, *targets) -> list:
    """``["amx-tile", kind]`` when one of the code generator's results (``generate_object``'s third value,
    None skipped) has a kernel on an AMX path (``amx_<kind's type>``): the library's C code then checks the
    features (and AVX512_BF16 for bf16) and asks Linux for the tile state at session creation (model_c.py)."""
    path = "amx_" + kind.split("-")[1]
    used = any(path in (t or {}).get("narrow_paths", {}).values() for t in targets)
    # the bf16 kernels round their activations with AVX512_BF16's vcvtneps2bf16
    return ([AMX_TILE, kind] + (["avx512bf16"] if kind == AMX_BF16 else [])) if used else []


def amx_permission_c() -> list:
    """C lines (inside the library's ``missing_isa`` check, after the cpuid tests) that ask Linux for the tile
    data state once per process; a refusal names itself as the missing feature."""
    return ["  {",
            "    extern long syscall(long, ...);",
            f"    if (syscall({SYS_ARCH_PRCTL}, {ARCH_REQ_XCOMP_PERM}, {XFEATURE_XTILEDATA}) != 0)",
            '      return "amx-tile (Linux refused the tile state: arch_prctl(ARCH_REQ_XCOMP_PERM) failed; '
            'recompile with --precision fp32 or on a CPU without AMX)";',
            "  }"]


def request_permission() -> bool:
    """Ask Linux for the tile data state in this process (what a library does at session creation); True when
    granted (or already granted)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                        ctypes.c_long(XFEATURE_XTILEDATA)) == 0


class Tiles:
    """Emits tile operations with ``b`` (an IRBuilder) in kernel module ``km``. Shapes are (rows, bytes per
    row) Python ints: they become the intrinsics' constant shape operands."""

    def __init__(self, km, b: ir.IRBuilder):
        self.b = b
        self._load = km.declare("llvm.x86.tileloadd64.internal", X86_AMX, [I16, I16, ir.PointerType(ir.IntType(8)), I64])
        self._load_t1 = km.declare("llvm.x86.tileloaddt164.internal", X86_AMX,
                                   [I16, I16, ir.PointerType(ir.IntType(8)), I64])
        self._store = km.declare("llvm.x86.tilestored64.internal", ir.VoidType(),
                                 [I16, I16, ir.PointerType(ir.IntType(8)), I64, X86_AMX])
        self._zero = km.declare("llvm.x86.tilezero.internal", X86_AMX, [I16, I16])
        self._dpbf16 = km.declare("llvm.x86.tdpbf16ps.internal", X86_AMX, [I16, I16, I16, X86_AMX, X86_AMX, X86_AMX])

    def zero(self, rows: int = TILE_ROWS, colsb: int = TILE_BYTES):
        return self.b.call(self._zero, [I16(rows), I16(colsb)])

    def load(self, ptr, stride_bytes, rows: int = TILE_ROWS, colsb: int = TILE_BYTES, streamed: bool = False):
        """A tile from ``rows`` rows of ``colsb`` bytes at ``ptr``, ``stride_bytes`` (i64 or int) apart;
        ``streamed``: ``tileloaddt1``, a hint that the data will not be reused soon (kept out of L1)."""
        stride = I64(stride_bytes) if isinstance(stride_bytes, int) else stride_bytes
        return self.b.call(self._load_t1 if streamed else self._load,
                           [I16(rows), I16(colsb), self.b.bitcast(ptr, ir.PointerType(ir.IntType(8))), stride])

    def store(self, tile, ptr, stride_bytes, rows: int = TILE_ROWS, colsb: int = TILE_BYTES) -> None:
        stride = I64(stride_bytes) if isinstance(stride_bytes, int) else stride_bytes
        self.b.call(self._store, [I16(rows), I16(colsb), self.b.bitcast(ptr, ir.PointerType(ir.IntType(8))),
                                  stride, tile])

    def dpbf16(self, c, a, w, m: int = TILE_ROWS, n_bytes: int = TILE_BYTES, k_bytes: int = TILE_BYTES):
        """``c + a @ w``: ``c`` m x n float32 (n_bytes = 4n), ``a`` m rows of k_bytes (k_bytes / 2 bfloat16),
        ``w`` k_bytes / 4 rows of pairs, n_bytes each (``tdpbf16ps``)."""
        return self.b.call(self._dpbf16, [I16(m), I16(n_bytes), I16(k_bytes), c, a, w])


def bf16_tile_loop(em, tiles: Tiles, steps, a_at, a_stride, b_at, b_stride, mi: int, nj: int,
                   a_streamed: bool = False, init: Optional[list] = None) -> list:
    """The k-loop of an ``mi`` x ``nj`` block of 16 x 16 float32 tiles (mi * nj + mi + nj <= 8 tiles): for
    step s in [0, steps) (an i64, at least 1), A tiles ``a_at(s, i)`` (16 rows of 32 bfloat16, ``a_stride``
    bytes apart) and B tiles ``b_at(s, j)`` (16 rows of 16 pairs, ``b_stride`` bytes apart) are loaded and
    ``tdpbf16ps`` accumulates ``C[i][j] += A_i B_j``. The accumulators start at zero and stay in tile
    registers (x86_amx phis); ``init``: they start at these tiles instead (another loop's, over other operands).
    Returns the mi * nj tiles (row-major) after the loop."""
    b, fn = em.b, em.fn
    init = [tiles.zero() for _ in range(mi * nj)] if init is None else list(init)
    pre = b.block
    head = fn.append_basic_block("amx_k")
    done = fn.append_basic_block("amx_k_done")
    b.branch(head)
    b.position_at_end(head)
    s = b.phi(I64)
    s.add_incoming(I64(0), pre)
    accs = []
    for x in init:
        ph = b.phi(X86_AMX)
        ph.add_incoming(x, pre)
        accs.append(ph)
    a_t = [tiles.load(a_at(s, i), a_stride, streamed=a_streamed) for i in range(mi)]
    new = list(accs)
    for j in range(nj):              # one B tile live at a time: mi * nj + mi + 1 tiles
        w = tiles.load(b_at(s, j), b_stride)
        for i in range(mi):
            new[i * nj + j] = tiles.dpbf16(accs[i * nj + j], a_t[i], w)
    sn = b.add(s, I64(1))
    s.add_incoming(sn, b.block)
    for ph, x in zip(accs, new):
        ph.add_incoming(x, b.block)
    b.cbranch(b.icmp_signed("<", sn, steps), head, done)
    b.position_at_end(done)
    return new
