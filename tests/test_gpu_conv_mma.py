"""Whole-batch tensor-core convolutions (``cuvil.targets.ptx.conv_mma``): which convolutions take them (float16,
TF32 only with ``allow_tf32``, never strict float32), the tile plans per batch, the thread-to-tile mappings
and the ``ldmatrix`` addresses replayed in numpy against the PTX ISA's fragment layouts, the PTX assembling
with ptxas, the memory-safety pattern proved (and refuted when widened); on a GPU, every tile shape, split-K,
padding, strides and a ragged reduction against onnxruntime."""
import re

import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.kernels.bounds import BoundsProver, stage_accesses
from cuvil.kernels.contraction import Contraction
from cuvil.targets.ptx import assemble, bounds_patterns
from cuvil.targets.ptx.codegen import PtxKernelModule, build_ptx, gpu_schedule, target_machine
from cuvil.targets.ptx.conv import conv_node
from cuvil.targets.ptx.conv_mma import (ASYNC_PAD, ROW_WORDS, SMEM_LIMIT, TILES, a_word, async_a_half, async_b_half,
                                        b_word, lane_digits, ldmatrix_a_word, ldmatrix_b_word, plan_conv_mma,
                                        warp_tiles)
from cuvil.targets.ptx.matmul_mma import FRAGMENTS
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.conv_models import conv_relu_model
from cuvil.testing.requires import needs_gpu, needs_ptxas



def _spec(n, cin, cout, k, hw, dt="float16", w=None, pads=None, stride=1, x_offset=0):
    from cuvil.ir.dtype import DType
    from cuvil.kernels.texpr import Buf
    w = hw if w is None else w
    x = Buf("x", DType.FLOAT16 if dt == "float16" else DType.FLOAT, (n, cin, hw, w), offset=x_offset)
    a = Buf("a", x.dtype, (1,))
    return Contraction(a, x, n, 1, cout, cin, (k, k), (stride, stride), (1, 1), (hw // stride, w // stride), 64,
                       64, pads=pads)


def _graph(model, half):
    g = Pipeline.from_onnx(model).optimize().graph
    if half:
        from cuvil.rewrite_rules.precision import to_half
        g, _ = to_half(g)
    return g


# --- plans ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "tf32"])
def test_plans_take_large_tiles_at_batch_and_split_small_grids(fmt):
    b32 = plan_conv_mma(_spec(32, 2048, 2048, 1, 14), fmt, 264)     # 6,272 columns x 2,048 channels
    assert (b32.bm, b32.bn, b32.threads, b32.splits) == (128, 128, 256, 1) and b32.blocks >= 264
    b32 = plan_conv_mma(_spec(32, 512, 512, 3, 14), fmt, 264)       # 512 channels: 196 blocks of 128 x 128
    assert (b32.bm, b32.bn, b32.threads, b32.splits) == (64, 128, 256, 1) and b32.blocks >= 264
    b32 = plan_conv_mma(_spec(32, 256, 256, 3, 14), fmt, 264)       # 256 channels: 64 x 64
    assert (b32.bm, b32.bn, b32.threads, b32.splits) == (64, 64, 128, 1) and b32.blocks >= 264
    late = plan_conv_mma(_spec(1, 512, 512, 3, 7), fmt, 264)         # batch 1, 7 x 7: 49 columns
    assert (late.bm, late.bn) == (64, 64) and late.splits > 1 and late.blocks >= 132
    assert (late.splits - 1) * late.kchunk < late.k <= late.splits * late.kchunk and late.kchunk % late.tk == 0
    for n in (1, 2, 8, 32, 64):
        for cin, cout, k, hw in ((64, 64, 3, 56), (256, 64, 1, 56), (1024, 2048, 1, 7), (3, 64, 7, 112)):
            p = plan_conv_mma(_spec(n, cin, cout, k, hw), fmt, 264)
            assert p.m_pad % p.bm == 0 and p.smem_bytes() <= SMEM_LIMIT and p.wm % 16 == 0 and p.wn % 16 == 0


@pytest.mark.parametrize("fmt", ["fp16", "tf32"])
@pytest.mark.parametrize("tile", TILES)
def test_load_slots_cover_each_tile_element_once(fmt, tile):
    bm, bn, wm_, wn_ = tile
    p = plan_conv_mma(_spec(64, 256, 256, 3, 56), fmt, 1)
    import attrs
    p = attrs.evolve(p, bm=bm, bn=bn, warps_m=wm_, warps_n=wn_)
    a = np.zeros((bm, p.tk), int)
    bt = np.zeros((bn, p.tk), int)
    for tid in range(p.threads):
        m, k = p.a_slot(tid)
        a[m:m + 4, k:k + p.a_terms] += 1
        j, k = p.b_slot(tid)
        bt[j, k:k + p.b_terms] += 1
    assert (a == 1).all() and (bt == 1).all()
    if fmt == "fp16":       # float16 runs pack two terms per 32-bit word
        assert p.a_terms % 2 == 0 and p.b_terms % 2 == 0


# --- fragments: the kernel's shared addressing replayed in numpy ------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "tf32"])
def test_fragment_words_hold_the_isa_fragments(fmt):
    """A stage filled the way the kernel stores it (``sa[m][k]``, ``sb[q][k]``, ROW_WORDS words a row, two
    halves a word for fp16) read back through a_word / b_word gives the PTX ISA's fragments, and the mma
    of every warp tile then equals A @ B."""
    p = plan_conv_mma(_spec(32, 256, 256, 3, 14), fmt, 264)
    f = FRAGMENTS[fmt]
    rng = np.random.default_rng(0)
    A = rng.standard_normal((p.bm, p.tk))
    B = rng.standard_normal((p.tk, p.bn))
    per = f.per_reg
    # word w of row r holds terms per * (w % ROW_WORDS) .. + per - 1: a table of which (row, term) each slot holds
    words_a = {}
    for m in range(p.bm):
        for k in range(p.tk):
            words_a.setdefault(m * ROW_WORDS + k // per, []).append((m, k))
    words_b = {}
    for q in range(p.bn):
        for k in range(p.tk):
            words_b.setdefault(q * ROW_WORDS + k // per, []).append((q, k))
    for wmi in range(p.warps_m):
        for wni in range(p.warps_n):
            C = np.zeros((p.wm, p.wn))
            for ks in range(0, p.tk, f.k):
                for r0, c0 in warp_tiles(p):
                    frag_c = np.zeros((16, 8))
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        row, col = wmi * p.wm + r0, wni * p.wn + c0
                        av = [words_a[a_word(p, row, g, t, ks, q)] for q in range(4)]
                        bv = [words_b[b_word(p, col, g, t, ks, q)] for q in range(2)]
                        for q, (dr, dc) in enumerate(f.a):     # the ISA's A fragment: (g + dr, per * t + dc ..)
                            assert av[q] == [(row + g + dr, ks + per * t + dc + e) for e in range(per)]
                        for q, dk in enumerate(f.b):
                            assert bv[q] == [(col + g, ks + per * t + dk + e) for e in range(per)]
                    for i in range(16):
                        for j in range(8):
                            frag_c[i, j] = A[wmi * p.wm + r0 + i, ks:ks + f.k] @ B[ks:ks + f.k, wni * p.wn + c0 + j]
                    C[r0:r0 + 16, c0:c0 + 8] += frag_c
            want = A[wmi * p.wm:(wmi + 1) * p.wm] @ B[:, wni * p.wn:(wni + 1) * p.wn]
            np.testing.assert_allclose(C, want, rtol=1e-12, atol=1e-12)


def test_ldmatrix_addresses_deliver_the_fragments():
    """ldmatrix.x4 (PTX ISA): lane 8 j + r gives the address of row r of matrix j; lane (g, t) receives in
    register j the word t of row g of matrix j. With the kernel's addresses that is exactly the A fragment
    (registers 0..3) and the B fragments of two 8-column tiles (a_word / b_word, checked against the ISA
    above)."""
    p = plan_conv_mma(_spec(32, 256, 256, 3, 14), "fp16", 264)
    for ks in (0, 16):
        for row in (0, 16, 48):
            addr = [ldmatrix_a_word(row, *lane_digits(lane), ks) for lane in range(32)]
            for lane in range(32):
                g, t = divmod(lane, 4)
                for j in range(4):
                    assert addr[8 * j + g] + t == a_word(p, row, g, t, ks, j)
                    assert addr[8 * j + g] % 4 == 0          # 16-byte aligned rows
        for col in (0, 16):
            addr = [ldmatrix_b_word(col, *lane_digits(lane), ks) for lane in range(32)]
            for lane in range(32):
                g, t = divmod(lane, 4)
                for j in range(4):
                    tile, reg = divmod(j, 2)
                    assert addr[8 * j + g] + t == b_word(p, col + 8 * tile, g, t, ks, reg)


def test_fragment_loads_are_bank_conflict_free():
    p = plan_conv_mma(_spec(32, 256, 256, 3, 14), "fp16", 264)
    for ks in (0, 16):
        for q in range(4):
            banks = {a_word(p, 0, g, t, ks, q) % 32 for g in range(8) for t in range(4)}
            assert len(banks) == 32
        # ldmatrix: each 8-lane phase reads 8 rows of 16 bytes: 32 distinct banks
        for j in range(4):
            rows = [ldmatrix_a_word(0, *lane_digits(8 * j + r), ks) for r in range(8)]
            assert len({(w + i) % 32 for w in rows for i in range(4)}) == 32


# --- the cp.async pointwise kernel ----------------------------------------------------------------------------

def test_async_plans_take_pointwise_float16_convolutions():
    """1 x 1, stride 1, unpadded, float16: the widest copy that divides the positions and keeps the input's
    offset aligned, and as many stages as fit; everything else keeps the register-staged kernel."""
    zeros = (0, 0)
    for hw, w, off, vec in ((56, 56, 0, 8), (14, 14, 0, 4), (7, 10, 0, 2), (7, 7, 0, 0), (28, 28, 8, 4),
                            (28, 28, 2, 0)):
        p = plan_conv_mma(_spec(32, 256, 512, 1, hw, w=w, pads=zeros, x_offset=off), "fp16", 264)
        assert p.vec == vec, (hw, w, off, p.vec)
        if vec:
            assert 2 <= p.stages <= 4 and p.smem_bytes() <= SMEM_LIMIT
            assert p.a_pieces * p.threads * 8 == p.bm * p.tk and p.b_pieces * p.threads * vec == p.bn * p.tk
    for other in (_spec(32, 256, 512, 1, 56, pads=zeros, dt="float"),            # TF32: register staging
                  _spec(32, 256, 512, 3, 56, pads=(1, 1)),                       # 3 x 3
                  _spec(32, 256, 512, 1, 56, pads=zeros, stride=2),              # stride 2
                  _spec(32, 256, 512, 1, 56, pads=(1, 1))):                      # padded
        fmt = "tf32" if other.x.dtype.name == "FLOAT" else "fp16"
        assert plan_conv_mma(other, fmt, 264).vec == 0
    assert plan_conv_mma(_spec(32, 256, 512, 1, 56, pads=zeros), "fp16", 264, async_copy=False).vec == 0
    assert plan_conv_mma(_spec(32, 256, 512, 1, 56, pads=zeros), "fp16", 264, ldmatrix=False).vec == 0


def test_tap_major_order_where_channels_fill_whole_chunks():
    """Several taps and a multiple of TK input channels: the reduction runs tap by tap (one bounds test per
    thread and chunk); otherwise, and for pointwise convolutions, the panels' order."""
    for fmt in ("fp16", "tf32"):
        dt = "float16" if fmt == "fp16" else "float"
        tm = dict(tap_major=True)
        assert plan_conv_mma(_spec(32, 64, 64, 3, 56, dt=dt, pads=(1, 1)), fmt, 264, **tm).tap_major
        assert plan_conv_mma(_spec(32, 512, 512, 3, 14, dt=dt, pads=(1, 1), stride=2), fmt, 264, **tm).tap_major
        assert not plan_conv_mma(_spec(32, 3, 64, 7, 224, dt=dt, pads=(3, 3), stride=2), fmt, 264, **tm).tap_major
        assert not plan_conv_mma(_spec(32, 40, 64, 3, 56, dt=dt, pads=(1, 1)), fmt, 264, **tm).tap_major
        assert not plan_conv_mma(_spec(32, 64, 64, 1, 56, dt=dt, pads=(0, 0)), fmt, 264, **tm).tap_major
        assert not plan_conv_mma(_spec(32, 64, 64, 3, 56, dt=dt, pads=(1, 1)), fmt, 264).tap_major   # default


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("vec", [8, 4, 2])
def test_async_copies_cover_each_tile_element_once(tile, vec):
    """Thread ``tid``'s copies (the emitter's mapping: a fixed 16-byte column of the A rows, a fixed
    ``vec``-half column of the B rows, rows stepped by threads / columns) fill each stage element once."""
    import attrs
    bm, bn, wm_, wn_ = tile
    p = attrs.evolve(plan_conv_mma(_spec(32, 256, 256, 1, 56, pads=(0, 0)), "fp16", 1),
                     bm=bm, bn=bn, warps_m=wm_, warps_n=wn_, vec=vec)
    a = np.zeros((p.tk, bm), int)
    bt = np.zeros((p.tk, bn), int)
    for tid in range(p.threads):
        row, seg = divmod(tid, bm // 8)
        for j in range(p.a_pieces):
            a[row + j * (p.threads // (bm // 8)), 8 * seg:8 * seg + 8] += 1
        row, seg = divmod(tid, bn // vec)
        for j in range(p.b_pieces):
            bt[row + j * (p.threads // (bn // vec)), vec * seg:vec * seg + vec] += 1
    assert (a == 1).all() and (bt == 1).all()


def test_async_ldmatrix_trans_delivers_the_fragments():
    """ldmatrix.x4.trans (PTX ISA): lane 8 j + r gives the address of stored row r of matrix j; lane (g, t)
    receives in register j the halves at column g of stored rows 2t and 2t + 1. With ``sa[k][m]`` and
    ``sb[k][q]`` (padded rows) and the kernel's addresses that is the ISA's A fragment (rows g + dr, terms
    2t + dc ..) and the B fragments (terms 2t + dk .., column g) of two 8-column tiles; and the products of
    every warp tile summed over the chunk equal A @ B."""
    p = plan_conv_mma(_spec(32, 256, 256, 1, 56, pads=(0, 0)), "fp16", 264)
    assert p.vec == 8
    f = FRAGMENTS["fp16"]
    ra, rb = p.bm + ASYNC_PAD, p.bn + ASYNC_PAD
    rng = np.random.default_rng(1)
    A = rng.standard_normal((p.bm, p.tk))
    B = rng.standard_normal((p.tk, p.bn))
    sa = np.full(p.tk * ra, np.nan)
    sb = np.full(p.tk * rb, np.nan)
    for k in range(p.tk):
        sa[k * ra:k * ra + p.bm] = A[:, k]
        sb[k * rb:k * rb + p.bn] = B[k]

    def trans(mem, addr, row_len):      # what lane (g, t) gets in register j
        return {(g, t, j): [mem[addr[8 * j + 2 * t + e] + g] for e in range(2)]
                for g in range(8) for t in range(4) for j in range(4)}
    for wmi in range(p.warps_m):
        for wni in range(p.warps_n):
            C = np.zeros((p.wm, p.wn))
            for ks in range(0, p.tk, f.k):
                for r0, c0 in warp_tiles(p):
                    row, col = wmi * p.wm + r0, wni * p.wn + c0
                    fa = trans(sa, [async_a_half(p, row, *lane_digits(ln), ks) for ln in range(32)], ra)
                    base = col - (c0 % 16)
                    fb = trans(sb, [async_b_half(p, base, *lane_digits(ln), ks) for ln in range(32)], rb)
                    tile = (c0 % 16) // 8
                    for (g, t, j), v in fa.items():
                        dr, dc = f.a[j]
                        assert v == [A[row + g + dr, ks + 2 * t + dc + e] for e in range(2)]
                    for (g, t, j), v in fb.items():
                        if j // 2 == tile:
                            dk = f.b[j % 2]
                            assert v == [B[ks + 2 * t + dk + e, col + g] for e in range(2)]
                    C[r0:r0 + 16, c0:c0 + 8] += A[row:row + 16, ks:ks + 16] @ B[ks:ks + 16, col:col + 8]
            want = A[wmi * p.wm:(wmi + 1) * p.wm] @ B[:, wni * p.wn:(wni + 1) * p.wn]
            np.testing.assert_allclose(C, want, rtol=1e-12, atol=1e-12)
    for ln in range(32):        # every row address 16-byte aligned
        assert async_a_half(p, 16, *lane_digits(ln), 16) % 8 == 0 and async_b_half(p, 32, *lane_digits(ln), 16) % 8 == 0


def test_async_fragment_loads_are_bank_conflict_free():
    """Each 8-lane phase of an ldmatrix reads 8 rows of 16 bytes: with rows padded by 16 bytes they fall in 32
    distinct banks (unpadded 256-byte rows would all start in bank 0)."""
    for tile in TILES:
        import attrs
        p = attrs.evolve(plan_conv_mma(_spec(32, 256, 256, 1, 56, pads=(0, 0)), "fp16", 1),
                         bm=tile[0], bn=tile[1], warps_m=tile[2], warps_n=tile[3])
        for ks in (0, 16):
            for j in range(4):
                for fn, at in ((async_a_half, 16), (async_b_half, 8)):
                    halves = [fn(p, at, *lane_digits(8 * j + r), ks) for r in range(8)]
                    assert len({(h // 2 + i) % 32 for h in halves for i in range(4)}) == 32


@pytest.mark.parametrize("tile", TILES)
def test_staged_output_tile_written_and_read_once_without_bank_conflicts(tile):
    """The float16 epilogue's shared tile (rows of BN + 8 halves): lane (g, t) of each warp stores its
    accumulator pairs (rows g, g + 8 of each 16 x 8 tile, columns 2t, 2t + 1) as one word; thread tid then
    reads column tid % BN of rows tid // BN, + T / BN, ...: every element written once and read once, and
    a warp's word stores fall in 32 distinct banks."""
    import attrs
    bm, bn, wm_, wn_ = tile
    p = attrs.evolve(plan_conv_mma(_spec(32, 256, 256, 3, 56), "fp16", 1), bm=bm, bn=bn, warps_m=wm_, warps_n=wn_)
    row = bn + ASYNC_PAD
    written = np.zeros((bm, bn), int)
    read = np.zeros((bm, bn), int)
    for warp in range(p.threads // 32):
        wmi, wni = divmod(warp, p.warps_n)
        for r0, c0 in warp_tiles(p):
            for dr in (0, 8):
                banks = set()
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    r, c = wmi * p.wm + r0 + dr + g, wni * p.wn + c0 + 2 * t
                    written[r, c:c + 2] += 1
                    banks.add((r * row + c) // 2 % 32)
                assert len(banks) == 32
    for tid in range(p.threads):
        for i in range(bm // (p.threads // bn)):
            read[tid // bn + i * (p.threads // bn), tid % bn] += 1
    assert (written == 1).all() and (read == 1).all()
    assert bm * row * 2 <= p.smem_bytes()


# --- selection, PTX, ptxas --------------------------------------------------------------------------------

def _kernels(model, half=False, **kw):
    r = build_ptx(gpu_schedule(_graph(model, half)), "sm_90", fma=True, **kw)
    return [k.kind for k in r.kernels], r


def test_formats_follow_the_precision():
    m = conv_relu_model((2, 32, 14, 14), (64, 32, 3, 3))
    kinds, r = _kernels(m)
    assert not any("mma" in k for k in kinds) and "mma.sync" not in r.ptx        # strict float32
    kinds, r = _kernels(m, allow_tf32=True)
    assert any(k.endswith("_mma_tf32") for k in kinds)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in r.ptx and "cvt.rna.tf32.f32" in r.ptx
    kinds, r = _kernels(m, half=True)
    assert any(k.endswith("_mma_fp16") for k in kinds)
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in r.ptx and "m16n8k16.row.col.f32.f16.f16.f32" in r.ptx
    # no tensor cores without fma contraction or before sm_80
    g = gpu_schedule(_graph(m, True))
    assert "mma.sync" not in build_ptx(g, "sm_90", fma=False).ptx
    assert "mma.sync" not in build_ptx(g, "sm_75", fma=True).ptx
    # grouped, dilated and 1-D convolutions keep conv.py's kernels (not checked on a GPU with these)
    for other in (conv_relu_model((2, 128, 14, 14), (128, 64, 3, 3), group=2),
                  conv_relu_model((2, 64, 14, 14), (64, 64, 3, 3), pads=(2, 2, 2, 2), dilations=(2, 2)),
                  conv_relu_model((2, 64, 30), (64, 64, 3), pads=(1, 1), strides=(1,))):
        kinds, _ = _kernels(other, allow_tf32=True)
        assert not any("_mma_" in k for k in kinds), kinds
    # the earlier per-image kernels stay available (conv_mma_batch=False), fp16 only
    kinds, _ = _kernels(m, half=True, tuning=PtxTuning(conv_mma_batch=False))
    assert "conv_mma" in kinds or "conv_splitk_mma" in kinds
    kinds, _ = _kernels(m, allow_tf32=True, tuning=PtxTuning(conv_mma_batch=False))
    assert not any("mma" in k for k in kinds)


@needs_ptxas
@pytest.mark.parametrize("half", [True, False])
def test_ptx_assembles_and_stages_are_vectorised(half):
    m = conv_relu_model((8, 64, 28, 28), (128, 64, 3, 3))
    for tb, opts in ((1, False), (100, False), (264, False), (1, True), (100, True)):  # 128x128, 64x128/64x64, split-K
        kinds, r = _kernels(m, half=half, allow_tf32=not half, tuning=PtxTuning(
            target_blocks=tb, conv_mma_staged_out=opts, conv_mma_tap_major=opts))
        (k,) = [d for d in r.kernels if "_mma_" in d.kind]
        entry = re.search(rf"\.entry {k.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
        assert "st.shared.v4.b32" in entry and "bar.sync" in entry
        # one per chunk (two stages), one per tile; float16: two more around the output tile in shared memory
        assert entry.count("bar.sync") <= (4 if half else 2)
        assemble(r.ptx, "sm_90")
    r80 = build_ptx(gpu_schedule(_graph(m, half)), "sm_80", fma=True, allow_tf32=not half)
    assert "mma.sync" in r80.ptx
    assemble(r80.ptx, "sm_80")


# --- memory safety ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [
    dict(x_shape=(4, 16, 14, 14), w_shape=(64, 16, 3, 3)),                       # padded, ragged K (144)
    dict(x_shape=(2, 64, 7, 7), w_shape=(128, 64, 1, 1), pads=(0, 0, 0, 0)),      # unpadded 1x1
    dict(x_shape=(1, 256, 7, 7), w_shape=(256, 256, 3, 3)),                      # split-K partials + sum kernel
    dict(x_shape=(2, 3, 30, 30), w_shape=(64, 3, 7, 7), pads=(3, 3, 3, 3), strides=(2, 2)),
])
@pytest.mark.parametrize("tap_major", [False, True])
def test_conv_mma_pattern_proved_and_refuted_when_widened(shapes, tap_major):
    s = gpu_schedule(Pipeline.from_onnx(conv_relu_model(**shapes)).optimize().graph)
    km = PtxKernelModule("t", target_machine(), scratch_offset=s.arena_bytes, allow_tf32=True)
    km.plan_scratch(s.stages)
    st, = [st for st in s.stages if conv_node(st) is not None]
    plan = plan_conv_mma(conv_node(st).attr, "tf32", km.conv_target_blocks, tap_major=tap_major)

    class Pats(bounds_patterns.GpuPatterns):    # (the schedule's reduction is contracted to fma only in build_ptx)
        def conv_plan(self, st_, node):
            return plan if conv_node(st_) is node else None
    for widen, expect in ((0, True), (1, False)):
        accs = [a for a in stage_accesses(st, Pats(km, widen)) if a.kind.startswith("family")]
        assert {"x"} <= {a.buf.name for a in accs} and len(accs) >= 3
        prover = BoundsProver()
        verdicts = [prover.check(a, s.ranges) is None for a in accs]
        assert verdicts == [expect] * len(accs), (widen, [a.buf.name for a in accs], verdicts)
    res = build_ptx(s, "sm_90", fma=True, allow_tf32=True)
    assert res.memory_safety.guarded == [] and any("_mma_tf32" in d.kind for d in res.kernels)


@pytest.mark.parametrize("shapes", [
    dict(x_shape=(4, 64, 28, 28), w_shape=(128, 64, 1, 1), pads=(0, 0, 0, 0)),    # 16-byte window copies
    dict(x_shape=(3, 40, 14, 14), w_shape=(120, 40, 1, 1), pads=(0, 0, 0, 0)),    # 8-byte, ragged K and M
    dict(x_shape=(1, 256, 7, 10), w_shape=(256, 256, 1, 1), pads=(0, 0, 0, 0)),   # 4-byte, split-K
])
def test_async_pattern_proved_and_refuted_when_widened(shapes):
    import attrs
    from cuvil.targets.ptx.codegen import widen_half_reductions
    s = gpu_schedule(_graph(conv_relu_model(**shapes), True))
    stages = [attrs.evolve(st, expr=widen_half_reductions(st.expr)) for st in s.stages]   # as build_ptx does
    km = PtxKernelModule("t", target_machine(), scratch_offset=s.arena_bytes)
    km.plan_scratch(stages)
    st, = [st for st in stages if conv_node(st) is not None]
    plan = plan_conv_mma(conv_node(st).attr, "fp16", km.conv_target_blocks)
    assert plan.vec in (2, 4, 8)

    class Pats(bounds_patterns.GpuPatterns):
        def conv_plan(self, st_, node):
            return plan if conv_node(st_) is node else None
    for widen, expect in ((0, True), (1, False)):
        accs = [a for a in stage_accesses(st, Pats(km, widen)) if a.kind.startswith("family")]
        assert {"x_f16"} <= {a.buf.name for a in accs} and len(accs) >= 3
        prover = BoundsProver()
        verdicts = [prover.check(a, s.ranges) is None for a in accs]
        assert verdicts == [expect] * len(accs), (widen, [a.buf.name for a in accs], verdicts)


@needs_ptxas
def test_async_ptx_copies_every_operand_and_assembles():
    m = conv_relu_model((8, 64, 28, 28), (128, 64, 1, 1), pads=(0, 0, 0, 0))
    for tb in (1, 264):
        kinds, r = _kernels(m, half=True, tuning=PtxTuning(target_blocks=tb))
        (k,) = [d for d in r.kernels if "_mma_" in d.kind]
        entry = re.search(rf"\.entry {k.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
        assert "cp.async.cg.shared.global" in entry and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in entry
        assert "ld.global" not in entry.replace("ld.global.nc", "")      # every operand arrives by cp.async
        assert r.memory_safety.guarded == []
        assemble(r.ptx, "sm_90")
        assemble(build_ptx(gpu_schedule(_graph(m, True)), "sm_80", fma=True,
                           tuning=PtxTuning(target_blocks=tb)).ptx, "sm_80")
    kinds, r = _kernels(m, half=True, tuning=PtxTuning(conv_mma_async=False))
    assert "cp.async" not in r.ptx and "_mma_fp16" in " ".join(kinds)


# --- on a GPU -------------------------------------------------------------------------------------------------

GEOMETRIES = [  # x shape, w shape, pads, strides
    ((4, 32, 14, 14), (64, 32, 3, 3), (1, 1, 1, 1), (1, 1)),
    ((3, 20, 9, 9), (64, 20, 3, 3), (1, 1, 1, 1), (2, 2)),           # ragged K (180), odd batch, stride 2
    ((2, 64, 7, 7), (128, 64, 1, 1), (0, 0, 0, 0), (1, 1)),
    ((2, 3, 30, 30), (64, 3, 7, 7), (3, 3, 3, 3), (2, 2)),            # the stem's shape
    ((8, 64, 28, 28), (128, 64, 3, 3), (1, 1, 1, 1), (1, 1)),
    ((5, 256, 7, 7), (256, 256, 3, 3), (1, 1, 1, 1), (1, 1)),         # long K
    # pointwise: the cp.async kernel (fp16) with 16-, 8- and 4-byte window copies
    ((4, 64, 28, 28), (256, 64, 1, 1), (0, 0, 0, 0), (1, 1)),
    ((3, 40, 14, 14), (120, 40, 1, 1), (0, 0, 0, 0), (1, 1)),         # ragged K (40) and M (120), odd batch
    ((2, 96, 7, 10), (64, 96, 1, 1), (0, 0, 0, 0), (1, 1)),           # 3 chunks, fewer than the stages + 1
    ((5, 512, 14, 14), (128, 512, 1, 1), (0, 0, 0, 0), (1, 1)),       # 16 chunks; split-K at the default
]


@needs_gpu
@pytest.mark.parametrize("mode", ["fp16", "tf32"])
def test_gpu_conv_mma_matches_onnxruntime(tmp_path, mode):
    import onnxruntime as ort
    import cuvil
    from cuvil.targets.ptx.bundle import compile_bundle
    rng = np.random.default_rng(0)
    tol = 2e-2 if mode == "fp16" else 3e-3
    for i, (xs, ws, pads, strides) in enumerate(GEOMETRIES):
        model = conv_relu_model(xs, ws, pads=pads, strides=strides)
        x = rng.standard_normal(xs).astype(np.float32)
        model.ir_version = min(model.ir_version, 10)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {"x": x})[0]
        # the largest tiles; split-K where the grid is small (default); the options not yet on by default
        for tb, opts in ((1, False), (264, False), (1, True), (264, True)):
            path = str(tmp_path / f"c{i}_{tb}_{opts}.cuvil")
            tuning = PtxTuning(target_blocks=tb, conv_mma_staged_out=opts, conv_mma_tap_major=opts)
            man = compile_bundle(Pipeline.from_onnx(model).optimize().graph, path, enable_fp16=mode == "fp16",
                                 allow_tf32=mode == "tf32", tuning=tuning)
            assert any(f"_mma_{mode}" in k for k in man["tensor_core_kernels"]), man["tensor_core_kernels"]
            m = cuvil.load(path)
            (y,) = m.run(x)
            err = np.abs(y - want).max() / np.abs(want).max()
            assert err < tol, (mode, xs, ws, tb, opts, err)


# --- split-K combined by the last slice (PtxTuning.conv_mma_fused_splitk) --------------------------------------

SPLIT_GEOMETRIES = [  # split-K at the default target: long K on small grids
    ((1, 256, 7, 7), (256, 256, 3, 3), (1, 1, 1, 1), (1, 1)),
    ((1, 512, 14, 14), (256, 512, 1, 1), (0, 0, 0, 0), (2, 2)),
    ((1, 100, 7, 7), (128, 100, 3, 3), (1, 1, 1, 1), (1, 1)),        # ragged K (900)
]


@needs_ptxas
@pytest.mark.parametrize("half", [True, False])
def test_fused_split_convolutions_need_no_sum_kernel_and_assemble(half):
    for xs, ws, pads, strides in SPLIT_GEOMETRIES:
        g = gpu_schedule(_graph(conv_relu_model(xs, ws, pads=pads, strides=strides), half))
        r = build_ptx(g, "sm_90", fma=True, allow_tf32=not half, tuning=PtxTuning(conv_mma_fused_splitk=True))
        plain = build_ptx(g, "sm_90", fma=True, allow_tf32=not half)
        kinds, kinds0 = [k.kind for k in r.kernels], [k.kind for k in plain.kernels]
        assert "conv_sum" in kinds0 and "conv_sum" not in kinds, (xs, kinds, kinds0)
        (k,) = [d for d in r.kernels if d.kind.startswith("conv_splitk_mma")]
        assert r.counter_bytes > 0 == plain.counter_bytes
        entry = re.search(rf"\.entry {k.name}\(.*?\n\}}\n", r.ptx, re.S).group(0)
        assert "atom.global.add.u32" in entry and "ld.global.cg.f32" in entry
        _, info = assemble(r.ptx, "sm_90")
        assert info[k.name].spill_stores == 0, info[k.name]


@needs_gpu
@pytest.mark.parametrize("mode", ["fp16", "tf32"])
def test_gpu_fused_split_convolutions_equal_the_sum_kernel(tmp_path, mode):
    import cuvil
    from cuvil.targets.ptx.bundle import compile_bundle
    rng = np.random.default_rng(2)
    for i, (xs, ws, pads, strides) in enumerate(SPLIT_GEOMETRIES):
        model = conv_relu_model(xs, ws, pads=pads, strides=strides)
        x = rng.standard_normal(xs).astype(np.float32)
        outs, count = {}, {}
        for fused in (False, True):
            path = str(tmp_path / f"c{i}_{fused}.cuvil")
            man = compile_bundle(Pipeline.from_onnx(model).optimize().graph, path, enable_fp16=mode == "fp16",
                                 allow_tf32=mode == "tf32", tuning=PtxTuning(conv_mma_fused_splitk=fused))
            assert f"conv_splitk_mma_{mode}" in man["tensor_core_kernels"], man["tensor_core_kernels"]
            count[fused] = man["kernels"]
            m = cuvil.load(path)
            outs[fused] = [m.run(x)[0] for _ in range(3)]
        assert count[True] == count[False] - 1        # no conv_sum kernel
        for y in outs[True]:
            assert np.array_equal(y, outs[False][0]), (mode, xs, float(np.abs(y - outs[False][0]).max()))
