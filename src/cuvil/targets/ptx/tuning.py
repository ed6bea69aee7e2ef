"""The PTX code generator's kernel-shape settings that benchmarks vary (``bench/gpu/conv_variants.py``,
``bench/gpu/split_reduction.py``): one immutable object passed to :func:`~cuvil.targets.ptx.codegen.build_ptx`
and :func:`~cuvil.targets.ptx.codegen.gpu_schedule`, never module state. The defaults are the shipped
choices, each measured on an H200 (``bench/gpu/RESULTS.md``)."""
from __future__ import annotations

import attrs
from typing import Optional, Tuple


def _positive_pair(v) -> None:
    if len(v) != 2 or not all(x > 0 for x in v):
        raise ValueError(f"mma_async_costs must be two positive numbers (a round, the sum kernel), not {v!r}")


@attrs.frozen
class PtxTuning:
    """Kernel-shape settings of the PTX backend (defaults: the shipped, measured ones)."""
    # convolutions as implicit-GEMM kernels (ptx/conv.py; the GPU lowering packs their weights); off: plain
    # reductions
    conv_enabled: bool = True
    # blocks a convolution should launch (2 per SM of an H200): split-K below that
    target_blocks: int = 264
    # inferences in flight the grids are sized for (PtxOptions.concurrency, concurrent_tuning): tensor-core
    # products plan their K slices for (SMs // concurrency) SMs
    concurrency: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # the next chunk's global loads are issued before this chunk's FMAs (off: after the barrier)
    pipeline: bool = True
    # float16 convolutions with 64-channel panels on sm_80+: tensor cores (mma.sync.m16n8k16)
    mma: bool = True
    # ... and with these, float16 (and TF32 with allow_tf32) convolutions take the whole-batch tensor-core
    # kernels of ptx/conv_mma.py (large tiles over N x positions, two shared stages); off: conv.py's per-image
    # 64 x 64 mma tiles (float16 only)
    conv_mma_batch: bool = True
    # conv_mma.py's float16 fragments through ldmatrix.x4 (off: 32-bit shared loads; ResNet-50 fp16 b32 on an
    # H200: 5.70 ms without, 5.56 with)
    ldmatrix: bool = True
    # conv_mma.py kernels: ask ptxas for registers that let this many blocks share an SM (1: no cap)
    conv_mma_min_blocks: int = 1
    # conv_mma.py: float16 pointwise (1 x 1, stride 1, unpadded) convolutions copy their tiles with cp.async
    # into 2-4 shared stages and read fragments by ldmatrix.trans (off: the register-staged kernel)
    conv_mma_async: bool = True
    # conv_mma.py: float16 outputs of an unsplit reduction go through shared memory to an epilogue of one
    # column per thread (coalesced; off: each thread runs the epilogue on its own mma fragments). On since its
    # H200 run (tests/test_gpu_conv_mma.py passed with it; ResNet-50 fp16 b32 4.79 -> 4.17 ms alone, 3.55 ms with
    # tap_major below; bench/gpu/RESULTS.md 2026-12-03)
    conv_mma_staged_out: bool = True
    # conv_mma.py: convolutions with several taps and a multiple of 32 (16 tf32) input channels reduce tap by
    # tap (one bounds test per chunk, window terms a plane apart; off: the panels' channel-major order). A
    # different summation order (deterministic); on since the same H200 run (b1 0.577 -> 0.530 ms alone)
    conv_mma_tap_major: bool = True
    # split-K tensor-core convolutions: the last slice of each output tile to finish (an atomic count per tile)
    # adds the S partials in slice order and runs the epilogue, instead of a conv_sum kernel per convolution (the
    # same bits). Off: timed in session 26 on an H100 (bench/gpu/RESULTS.md), ResNet-50 fp16 b1 0.511 -> 0.948 ms
    # (CUDA graph p50; the split kernels' time 0.42 -> 1.00 ms against the 0.23 ms of the 43 conv_sum kernels it
    # saves), b32 3.510 -> 3.518 ms
    conv_mma_fused_splitk: bool = False
    # float32 MatMul / Gemm products the tensor cores do not take (strict fp32) run on the register-tiled SIMT
    # kernel of ptx/matmul_simt.py (off: the lane-split / tiled / element kernels below, as before)
    simt_matmul: bool = True
    # (BM, BN, ks): force that tile and K-group count on every SIMT product where it fits (an A/B of the cost
    # model, bench/gpu/simt_matmul.py); empty: the cost model chooses
    simt_force: tuple = ()
    # reduction terms per shared-memory chunk of the SIMT products (16 or 32)
    simt_tk: int = attrs.field(default=16, validator=attrs.validators.in_((16, 32)))
    # shared-memory tiled kernels for large reduction stages (PtxKernelModule.add_tiled_stage)
    tile_enabled: bool = True
    # stages with at least this many outputs are tiled: on an H200 the tiled kernels beat channel coarsening
    # only on ResNet-50's largest stages (401,408 and 802,816 outputs: 0.012-0.037 vs 0.017-0.043 ms); on 3x3
    # convolutions of 100,352-200,704 outputs their per-load index arithmetic made them up to 2.6x slower
    tile_min_outputs: int = 401408
    # most output channels per thread in a channel-coarsened kernel (1: never coarsen)
    coarsen: int = 4
    # A stage with one top-level float sum whose outputs are too few to fill the GPU gets several threads
    # ("lanes", a power of two up to a warp) per output element, each summing part of the reduction
    # (PtxKernelModule.add_split_stage): with one thread per element such stages launch less than a wave and
    # each thread sums thousands of terms serially. At most this many output elements: on an H200, ResNet-50's
    # stages of 25,088 and 50,176 outputs ran up to 3x faster split (the final Gemm 13x), those of 100,352 and
    # 200,704 outputs no faster (0: never split)
    warp_max_outputs: int = 1 << 16
    # threads to aim for: about 3/4 of an H200's resident threads (132 SMs x 2048) when the reduction is one
    # index (1x1 convolutions, Gemm: lanes read consecutive weights), half that with kernel taps (3x3
    # convolutions: lanes read weights 9 floats apart and input planes apart, so fewer lanes did better)
    split_target_threads: int = 192 * 1024
    # lanes are added only while each keeps this many terms
    split_min_terms_per_lane: int = 32
    # how lane l of L takes its terms: "outer": the outermost reduction index (input channel) l, l + L, ...,
    # the inner loops (kernel taps) whole and nested, as one thread would; "strided" (kept to reproduce the
    # comparison): the flattened terms l, l + L, ..., which unflattens every term with integer divisions that
    # cost more than they save on 3x3 convolutions (a third form, one contiguous run of terms per lane, was
    # slower still and is gone)
    split_mode: str = attrs.field(default="outer", validator=attrs.validators.in_(("outer", "strided")))
    # row reductions and the element stage that reads them (LayerNorm's mean / variance / normalise, Softmax's
    # max / sum / divide) as one kernel, a block per row (ptx/row_chain.py); off: a kernel per stage, as before.
    # On since session 15's H200 run (bench/gpu/RESULTS.md): its first run had found LayerNorm wrong with fma
    # contraction (the fma reduction's accumulator started at +inf), fixed and tested there
    row_chains: bool = True
    # tensor-core MatMul / Gemm (ptx/matmul_mma.py plan_matmul): the blocks the tile choice aims for (the tile
    # shrinks from 64 x 64 until the grid has this many), and the most K groups of four warps per block (1, 2,
    # 4 or 8: 8 is a 1,024-thread block, float16 / bfloat16 32 x 32 tiles only, by shared memory)
    mma_min_blocks: int = 264
    mma_max_ks: int = attrs.field(default=4, validator=attrs.validators.in_((1, 2, 4, 8)))
    # tensor-core products: four-warp groups to keep resident per SM (0: the plan above, mma_min_blocks /
    # mma_max_ks). Else the K groups per block and the K slices come from a latency model (plan_slices: waves x
    # rounds), ptxas is asked for registers that let sm_groups / ks blocks share an SM, and a product whose
    # tiles are too few splits K across blocks (fp32 partial sums after the arena, added in slice order by a
    # second kernel: deterministic). 4 since session 16's H200 run (bench/gpu/RESULTS.md): BERT-base B=1 S=128
    # fp16 1.227 -> 1.089 ms with mma_vec, TF32 1.616 -> 1.559; 8 and 16 were slower (1.165, 1.376 ms)
    mma_sm_groups: int = attrs.field(default=4, validator=attrs.validators.in_(tuple(range(17))))
    # ... every product that plans its slices (mma_sm_groups > 0) takes this many K slices where its chunks allow
    # it (they divide the chunks and leave each K group two; else the estimate's choice), 0: the estimate's. A
    # calibration knob: bench/gpu/split_sweep.py times each product shape at several counts
    mma_splits: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # ... the estimate's costs for the products through cp.async stages (mma_async), in global-load latencies:
    # (a round, a split product's sum kernel); the register-staged kernels count (1, 1). Session 38 (an H100,
    # bench/gpu/split_sweep.py and whole BERT-base; matmul_mma.plan_slices says why): a split costs 8 rounds, so
    # BERT-base's products at S = 128 and longer run mostly unsplit. (1.0, 1.0): the plans before session 38
    mma_async_costs: Tuple[float, float] = attrs.field(
        default=(1.0, 8.0), converter=lambda v: tuple(float(x) for x in v),
        validator=lambda _i, _a, v: _positive_pair(v))
    # ... a product whose output tiles already fill every group slot of the GPU (tiles >= SMs x mma_sm_groups) may
    # still be split where the estimate says so (True, the default: the plans so far). False: such grids are not
    # split. Written in session 39 after an H200 run where, at B = 8, S = 128, BERT-base's FFN product (768 tiles)
    # ran split in two and its sum kernel moved 25 MB a layer (49 + 21 us); B = 1 builds the same PTX either way.
    # The rule is not yet timed on a GPU (no device for the rest of that session), so this stays True, the rule
    # opt-in, until it is (tensor_cores.py variant "fp16_nosplitfilled", bench/gpu/RESULTS.md session 39)
    mma_split_filled: bool = True
    # tensor-core products: float16 operands that are one plain, aligned load take it as 16-, 8- or 4-byte vectors
    # along their contiguous index (matmul_mma.vec_width; off: one 2-byte load per element). On since the same
    # run: BERT-base fp16 1.455 -> 1.227 ms (ptxas: the products' registers 128 -> 55-61)
    mma_vec: bool = True
    # (gpu_schedule) a MatMul operand that is a value times a constant scalar (attention's Q * s, Kt * s) is
    # multiplied in the product's loads instead of stored by a kernel of its own (schedule's scaled_operands)
    scaled_operands: bool = True
    # one-row products y[n] = sum_k x[k] W[k, n] with W's n contiguous (the decode step's weight GEMVs, the LM
    # head) take ptx/gemv.py's kernel: threads along n, 16-byte weight loads, k split over a block's threads and
    # added in a fixed order (off: the lane-split kernels, whose warp loads read 16-32 rows a few bytes each).
    # On since the session-16 H200 run (GPU tests 209 passed; GPT-2 124M decode step per token, past 128 / 1023:
    # fp32 1.174 -> 0.706 / 1.316 -> 0.809 ms, fp16 1.490 -> 0.963 / 1.883 -> 1.399; bench/gpu/gpt2_decode.py)
    gemv: bool = True
    # ... the blocks its column tiles aim for (a block's column threads shrink from 8 to 2 until the grid has this
    # many)
    gemv_min_blocks: int = 264
    # attention as the exports spell it (MatMul / Softmax / MatMul) becomes one FusedAttention (the proved rules of
    # rules/attention.rule, as on x86) computed by ptx/attention.py's kernel: a block per query row (or per split
    # of its keys, below), keys in chunks of the block's threads with an online softmax, Q, K, V and the mask read
    # in place (off: element kernels, products and softmax row kernels). None (the default): on for every build
    # since session 20's H200 run (bench/gpu/RESULTS.md; GPT-2 124M decode step per token in one process, fused
    # with split keys / unfused: float32 0.573 / 0.704 ms at past 128 and 0.667 / 0.802 at past 1023). Until
    # then (one block per query row: 12 blocks for a decode step) it was on for float16 builds only. True / False
    # force it either way.
    fused_attention: Optional[bool] = None
    # ... its keys split over blocks (flash-decoding) until the grid has ``target_blocks`` blocks, each split
    # holding at least this many keys; a second kernel merges a row's partial softmaxes in split order (0: a
    # block per query row, keys walked by that one block)
    attention_split_keys: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    # ... the last of a row's blocks to finish merges its partials (an atomic count per row in the arena, zeroed
    # before each run and reset by that block) instead of a second kernel launched after them (off: the merge
    # kernel, one launch more per attention). Written in session 20 (assembled by ptxas, proved in bounds), first
    # run on an H200 in session 22: the GPU tests pass with it (tests/test_gpu_attention.py
    # test_kernel_variants_match_numpy) and the float16 GPT-2 decode step went 0.610 -> 0.580 ms at past 128,
    # 0.723 -> 0.681 at past 1,023 (bench/gpu/RESULTS.md, "Session 22"); False: the merge kernel
    attention_fused_merge: bool = True
    # ... a block copies each chunk of keys to shared memory, consecutive threads reading consecutive columns of
    # a key row, before each thread scores its key from there (off, or where the chunk would take more than
    # attention.STAGE_BYTES: each thread reads its own key's row, a warp's loads 32 rows apart). On since session
    # 22's GPU run, as ``attention_fused_merge`` (variants *_stage1: 0.723 -> 0.636 ms at past 1,023 in float16)
    attention_stage_keys: bool = True
    # float16 attention with more than attention.MAX_ROWS query rows (BERT's 128 a head, a prefill) is fused too
    # (the same rules) and computed by ptx/attention_mma.py's flash kernel: 16 query rows a warp, scores and
    # P.V on tensor cores (mma.sync m16n8k16, ldmatrix), an online softmax in registers, K and V chunks copied by
    # cp.async into two shared stages (off: such attention stays the tensor-core products, the softmax row kernel
    # and their copies). On since session 39's H200 run (bench/gpu/flash_run.sh; GPU tests passed there): BERT-base
    # fp16 B = 1 at S = 32 / 128 / 384 0.732 -> 0.665, 1.006 -> 0.935, 1.740 -> 1.479 ms, B = 8 S = 128 2.875 -> 2.566
    attention_mma: bool = True
    # ... and, where the exports merge the heads next (Transpose [0, 2, 1, 3], Reshape to [B, S, H * D]), the
    # attention kernels store each output row where the merge puts it ([B, S, H, D], AttentionRows.out_heads_inner,
    # as x86's kernel does): the merge is then a view and the output projection reads the kernel's output in place,
    # instead of an element kernel copying it (BERT-base S = 128: 7.8 us a layer on an H200, session 39). Off until
    # run on a GPU: written in session 40 (memory safety proved, the same index arithmetic as x86's), when no device
    # could be had; bench/gpu/streams_run.sh times it (variant fp16_heads) and runs the GPU tests
    attention_heads_merged: bool = False
    # plain element stages (copies such as a KV cache's concatenation, elementwise ops) with at least
    # ``element_vec_min`` elements and a last dim that ``element_vec`` divides: a thread computes that many
    # consecutive elements, its loads issued together (one element per thread leaves too few bytes in flight to
    # stream a 3 MB copy; 1: one element per thread). 4 since session 22's GPU run, as ``attention_fused_merge``
    # (variants *_vec4: 0.723 -> 0.667 ms at past 1,023 in float16; the three together 0.604)
    element_vec: int = attrs.field(default=4, validator=attrs.validators.in_((1, 2, 4, 8)))
    element_vec_min: int = 65536
    # (gpu_schedule) a reshape of a value that is not stored (a decode step's head splits of the QKV product's
    # Split, the merge of attention's transposed output) is read through index arithmetic by its readers instead
    # of stored by an element kernel of its own (schedule's inline_views; off: one small kernel per view)
    inline_views: bool = True
    # tensor-core products whose two operands are float16 matrices with 16-byte aligned rows along their
    # contiguous index (matmul_mma.async_ok): the A / B tiles are copied by cp.async.cg (16 bytes, zero-filled
    # past the matrix or K) into this many shared stages per K group, one chunk per stage in flight ahead of
    # the products, and the fragments read by ldmatrix.x4 (.trans where the operand is not k-contiguous).
    # 0: the register-staged kernel above; else 2, 3 or 4 stages. 3 since session 17's H200 run (bench/gpu/RESULTS.md;
    # tests/test_gpu_matmul_async.py passed there): BERT-base B=1 S=128 fp16 1.117 -> 1.049 / 0.981 / 0.967 ms with
    # 2 / 3 / 4 stages, in one process (4: within 1.5% of 3, for a third more shared memory)
    mma_async: int = attrs.field(default=3, validator=attrs.validators.in_((0, 2, 3, 4)))
    # tensor-core products split across blocks (split-K): the last slice of each output tile to finish (an atomic
    # count per tile, zeroed before each run) adds the S partial sums in slice order and runs the epilogue, instead
    # of a second kernel (matmul_sum) doing it: the same sums in the same order, bit for bit, one kernel less per
    # product. Off: timed in session 26 on an H100 (bench/gpu/RESULTS.md), BERT-base B=1 S=128 fp16 1.078 ->
    # 1.204 ms (CUDA graph p50; the split products' kernels 0.81 -> 1.11 ms against the 0.39 ms of the 72 sum
    # kernels they replace: the last slice of a tile waits on the others' partials), TF32 1.514 -> 1.558 ms
    mma_fused_splitk: bool = False

    def resolved(self, enable_fp16: bool) -> "PtxTuning":
        """These settings with the automatic choices made for a build (``fused_attention`` None: on, float32 and
        float16 builds alike; ``enable_fp16`` is kept for the callers that pass it)."""
        if self.fused_attention is None:
            return attrs.evolve(self, fused_attention=True)
        return self


DEFAULT_TUNING = PtxTuning()

#: the most inferences in flight a bundle's grids may be sized for (PtxOptions.concurrency)
MAX_CONCURRENCY = 64


def product_sms(sms: int, tuning: PtxTuning) -> int:
    """SMs a tensor-core product's split-K plan fills: the GPU's ``sms``, shared by ``tuning.concurrency`` calls."""
    return max(1, sms // tuning.concurrency)


def concurrent_tuning(tuning: PtxTuning, concurrency: int) -> PtxTuning:
    """``tuning`` for a bundle meant to run ``concurrency`` inferences at once: what its kernels' grids aim for
    divided by it (a convolution's or attention's split blocks, a GEMV's column blocks, a lane-split reduction's
    threads, and, through ``concurrency``, the SMs a tensor-core product plans its K slices for; its tile choice,
    ``mma_min_blocks``, is kept: a smaller target there picked larger tiles and then more slices), so that that
    many calls in flight share the GPU instead of each splitting its reductions to fill it alone.
    Measured on an H100 at batch 1 (bench/gpu/RESULTS.md, session 27), calls per second of 4 threads on 4
    sessions against the default grids': ResNet-50 float16 1.09x built for 4, 1.19x for 8 (one call alone 1.06x /
    1.23x slower); BERT-base float16 1.08x / 1.16x (one call alone 5% / 3% faster: fewer split-K sum kernels)."""
    if concurrency == 1:
        return tuning
    return attrs.evolve(tuning, concurrency=concurrency,
                        target_blocks=max(1, tuning.target_blocks // concurrency),
                        gemv_min_blocks=max(1, tuning.gemv_min_blocks // concurrency),
                        split_target_threads=max(32, tuning.split_target_threads // concurrency))
