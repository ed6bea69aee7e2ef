"""PTX code generation (no GPU needed): every light model's schedule lowers to one NVPTX module that ptxas
assembles for sm_90 (registers per thread reported), a small CNN also for sm_80, and the structure of a
simple elementwise kernel (thread-index reads, grid-stride loop, no calls to undefined functions)."""
import re
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuvil import Pipeline
from cuvil.errors import CuvilError, UnsupportedOpError
from cuvil.ir.dtype import DType
from cuvil.targets.ptx import KernelDesc, assemble, find_libdevice, find_ptxas, generate_ptx
from cuvil.targets.ptx.codegen import GRID_CAP
from cuvil.targets.ptx.ptxas import parse_verbose
from cuvil.targets.ptx.codegen import gpu_schedule
from cuvil.kernels.schedule import Schedule, Stage, schedule
from cuvil.kernels.texpr import Buf, E, binop, call, cmp, const, load, reduce, select, var
from cuvil.testing import LIGHT_MODELS, light_model, small_cnn
from cuvil.testing.slow import slow_tests_run

PTXAS = find_ptxas()
LIBDEVICE = find_libdevice()
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not found (no CUDA toolkit): PTX cannot be assembled here")
needs_libdevice = pytest.mark.skipif(LIBDEVICE is None, reason="libdevice.10.bc not found (no CUDA toolkit): "
                                     "exp/log/pow/... cannot be linked")

F32 = DType.FLOAT


def entries(ptx):
    """kernel name -> its PTX text."""
    out = {}
    for m in re.finditer(r"\.visible \.entry (\w+)\((.*?)\n\}\n", ptx, re.S):
        out[m.group(1)] = m.group(0)
    return out


# --- the nine light models ------------------------------------------------------------------------------

def _build(name):
    s = gpu_schedule(Pipeline.from_onnx(light_model(name)).optimize().graph)
    ptx, descs = generate_ptx(s, "sm_90")
    return ptx, descs


#: The light models whose test is in the extended suite: about 100 s of the module's 170 s of CPU (one profile on a
#: 2-core Intel Xeon, 2026-12-03; AlexNet alone 43 s); the gate assembles the other four, whose kernels are the
#: same kinds (direct and Winograd convolutions, pools, concatenations, LRN, Gemm, Softmax).
PTX_SLOW = ("bvlc_alexnet", "densenet121", "inception_v2", "vgg19", "zfnet512")
PTX_CASES = [pytest.param(n, marks=pytest.mark.slow(reason="about 100 s of CPU for the five; resnet50, squeezenet, "
                                                           "shufflenet and inception_v1 assemble the same kernel kinds"))
             if n in PTX_SLOW else n for n in LIGHT_MODELS]


@pytest.fixture(scope="module")
def light_ptx(request):
    """name -> (ptx, kernel descs, future of ptxas's result). The front end of the next model runs while
    ptxas assembles the current one (ptxas is a separate process), which keeps the module fast."""
    pool = ThreadPoolExecutor(max_workers=1)
    built = {}
    order = [n for n in LIGHT_MODELS if n not in PTX_SLOW or slow_tests_run(request.config)]

    def ensure(name):
        if name not in built:
            try:
                ptx, descs = _build(name)
                built[name] = (ptx, descs, pool.submit(assemble, ptx, "sm_90", PTXAS))
            except Exception as e:  # reported by that model's own test
                built[name] = e
        return built[name]

    def get(name):
        got = ensure(name)
        k = order.index(name) if name in order else len(order)
        if k + 1 < len(order):
            ensure(order[k + 1])
        built.pop(name)
        if isinstance(got, Exception):
            raise got
        return got

    yield get
    pool.shutdown(wait=True)


@needs_ptxas
@needs_libdevice
@pytest.mark.parametrize("name", PTX_CASES)
def test_light_model_assembles_for_sm90(name, light_ptx):
    ptx, descs, fut = light_ptx(name)
    _, info = fut.result()
    assert ".target sm_90" in ptx and ".address_size 64" in ptx
    assert ".extern" not in ptx, "a call to a function the module does not define"
    assert sorted(entries(ptx)) == sorted(d.name for d in descs)
    assert all(d.n_elements > 0 and d.grid >= 1 for d in descs)
    missing = [d.name for d in descs if d.name not in info or info[d.name].registers is None]
    assert not missing, f"ptxas reported no register count for {missing}"
    regs = [info[d.name].registers for d in descs]
    spills = sum(info[d.name].spill_stores for d in descs)
    print(f"\n{name}: {len(descs)} kernels, registers/thread max {max(regs)} mean {statistics.mean(regs):.1f}, "
          f"spill stores {spills} bytes")
    assert max(regs) <= 255


# --- a small CNN, sm_80 and sm_90 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_sched():
    return schedule(Pipeline.from_onnx(small_cnn()).optimize().graph)


@needs_ptxas
@needs_libdevice
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_small_model_assembles(arch, small_sched):
    ptx, descs = generate_ptx(small_sched, arch)
    assert f".target {arch}" in ptx
    assert ".extern" not in ptx, "a call to a function the module does not define"
    _, info = assemble(ptx, arch)
    assert set(info) == {d.name for d in descs}
    assert all(info[d.name].registers for d in descs)
    assert [d.n_elements for d in descs][-1] == 2 * 8 * 10 * 10


@needs_libdevice
def test_fma_contraction_is_explicit(small_sched):
    """Off by default: the conv's multiply-adds round separately (mul.rn + add.rn, which ptxas keeps
    apart); fma=True fuses them."""
    conv = next(k for k, st in enumerate(small_sched.stages) if "reduce" in repr(st.expr) and "sum" in repr(st.expr)
                and "exp" not in repr(st.expr))
    off, descs = generate_ptx(small_sched, "sm_90")
    on, _ = generate_ptx(small_sched, "sm_90", fma=True)
    k_off, k_on = entries(off)[descs[conv].name], entries(on)[descs[conv].name]
    assert "fma.rn.f32" not in k_off and "mul.rn.f32" in k_off and "add.rn.f32" in k_off
    assert "fma.rn.f32" in k_on


# --- a simple elementwise kernel, golden-style ------------------------------------------------------------

def _sched(stages, inputs, outputs):
    """A hand-made schedule; buffers read through base 1 are weights, so the weights section holds the largest
    (the bundle's memory-safety proof checks every read against the section it lies in)."""
    weights = {id(b): b for s in stages for b in _bufs(s.expr) if b.storage.base == 1}
    for s in stages:
        s.reads = []
    return Schedule(stages, inputs, outputs, [], 0, max([b.nbytes for b in weights.values()], default=0), {})


def _bufs(e):
    seen, todo = [], [e]
    while todo:
        x = todo.pop()
        if isinstance(x.attr, Buf):
            seen.append(x.attr)
        todo.extend(a for a in x.args if isinstance(a, E))
    return seen


def elementwise_sched(fn_name=None):
    """y[i, j] = max(x[i, j] + 1, 0) (or fn(x) when fn_name is given) over a 4x50 float tensor."""
    x = Buf("x", F32, (4, 50), base=2)
    y = Buf("y", F32, (4, 50), base=3)
    i, j = var("i"), var("j")
    v = binop("add", load(x, [i, j]), const(1.0, F32))
    v = call(fn_name, v) if fn_name else select(cmp("gt", v, const(0.0, F32)), v, const(0.0, F32))
    return _sched([Stage("relu", y, [i, j], v)], [x], [y])


def _copy_sched(shape, reduce_window=False):
    """y = x + 1 over ``shape`` (or a 2-wide max over the last dim: a reduction)."""
    x = Buf("x", F32, shape, base=2)
    y = Buf("y", F32, shape, base=3)
    vs = [var(f"i{k}") for k in range(len(shape))]
    if reduce_window:
        v = reduce("max", [2], lambda t: load(x, vs[:-1] + [E("clamp", (binop("add", vs[-1], t),), vs[-1].dtype,
                                                                    (0, shape[-1] - 1))]))
    else:
        v = binop("add", load(x, list(vs)), const(1.0, F32))
    return _sched([Stage("y", y, vs, v)], [x], [y])


@pytest.mark.parametrize("shape, reduce_window, vec", [
    ((12, 1024, 64), False, 4),       # a KV cache's size: 4 consecutive elements a thread
    ((12, 1024, 66), False, 1),       # the last dim not a multiple of 4
    ((4, 50), False, 1),              # under element_vec_min
    ((12, 1024, 64), True, 1),        # a window reduction keeps a thread per output
])
def test_large_element_stages_take_several_elements_a_thread(shape, reduce_window, vec):
    """PtxTuning.element_vec: a large copy-like stage computes ``vec`` consecutive elements per thread (one
    unflattening, the loads issued before the stores); the launch counts threads."""
    from cuvil.targets.ptx.tuning import PtxTuning
    total = 1
    for d in shape:
        total *= d
    ptx, (d,) = generate_ptx(_copy_sched(shape, reduce_window), "sm_90", tuning=PtxTuning(element_vec=4))
    assert d.n_elements == total // vec
    k = entries(ptx)[d.name]
    if not reduce_window:
        loads, stores = len(re.findall(r"ld\.global\.nc\.(?:b|f)32", k)), len(re.findall(r"st\.global\.(?:b|f)32", k))
        assert (loads, stores) == (vec, vec)
        if vec > 1:     # every load before the first store
            assert k.rindex("ld.global.nc.b32") < k.index("st.global")
    _, (one,) = generate_ptx(_copy_sched(shape, reduce_window), "sm_90", tuning=PtxTuning(element_vec=1))
    assert one.n_elements == total     # one element a thread
    _, (default,) = generate_ptx(_copy_sched(shape, reduce_window), "sm_90")    # the default since session 22: 4
    assert default.n_elements == d.n_elements
    if PTXAS:
        assemble(ptx, "sm_90")


def test_elementwise_kernel_structure():
    ptx, descs = generate_ptx(elementwise_sched(), "sm_90", prefix="golden")
    assert descs == [KernelDesc("golden_k0", 200, 256, "relu")]
    assert descs[0].grid == 1
    k = entries(ptx)["golden_k0"]
    # signature (ptr bufs, i64 n)
    assert re.search(r"\.visible \.entry golden_k0\(\s*\.param \.u64 (\.ptr \.align \d+ )?golden_k0_param_0,\s*"
                     r"\.param \.u64 golden_k0_param_1\s*\)", k), k
    # global index = ctaid.x * ntid.x + tid.x; grid stride = nctaid.x * ntid.x
    for sreg in ("%tid.x", "%ctaid.x", "%ntid.x", "%nctaid.x"):
        assert re.search(rf"mov\.u32\s+%r\d+, {re.escape(sreg)};", k), sreg
    assert re.search(r"setp\.\w+\.s64", k), "bound check against n"
    assert re.search(r"ld\.global\.nc\.b32", k), "the input is read through the read-only cache"
    assert re.search(r"st\.global\.b32", k)
    assert "add.rn.f32" in k
    assert "call" not in k and ".extern" not in ptx and ".func" not in ptx


@needs_libdevice
def test_libdevice_math_is_linked_and_inlined():
    ptx, descs = generate_ptx(elementwise_sched("exp"), "sm_90")
    k = entries(ptx)[descs[0].name]
    assert "ex2.approx" in k, "__nv_expf's core"
    assert ".extern" not in ptx and "__nv_" not in ptx and "__nvvm_reflect" not in ptx
    assert "call" not in k


@needs_libdevice
def test_opt0_resolves_libdevice_reflection():
    """At -O0 the pipeline still runs NVVMReflect, so no __nvvm_reflect call is left undefined."""
    ptx, _ = generate_ptx(elementwise_sched("tanh"), "sm_80", opt=0)
    assert "__nvvm_reflect" not in ptx and ".extern" not in ptx
    if PTXAS:
        assemble(ptx, "sm_80")


def test_native_math_needs_no_libdevice():
    ptx, descs = generate_ptx(elementwise_sched("sqrt"), "sm_90", libdevice="/nonexistent/libdevice.bc")
    k = entries(ptx)[descs[0].name]
    assert "sqrt.rn.f32" in k, "correctly rounded sqrt"


def test_unsupported_function_names_the_op():
    with pytest.raises(UnsupportedOpError, match="bessel_j0"):
        generate_ptx(elementwise_sched("bessel_j0"), "sm_90")


def _rowsum(rows, terms):
    x = Buf("x", F32, (rows, terms), base=2)
    y = Buf("y", F32, (rows,), base=3)
    i = var("i")
    e = reduce("sum", [terms], lambda kk: load(x, [i, kk]))
    return generate_ptx(_sched([Stage("rowsum", y, [i], e)], [x], [y]), "sm_90")


def test_reduction_of_a_large_stage_is_an_in_thread_loop():
    """y[i] = sum_k x[i, k], 100,000 rows of 1000 terms: enough threads already, a loop inside each thread,
    no local memory, no shuffles."""
    ptx, descs = _rowsum(100_000, 1000)
    k = entries(ptx)[descs[0].name]
    assert descs[0].n_elements == 100_000 and descs[0].lanes == 1
    assert ".local" not in k and "bra" in k and "shfl" not in k
    if PTXAS:
        _, info = assemble(ptx, "sm_90")
        assert info[descs[0].name].stack_frame == 0


def test_reduction_of_a_small_stage_is_split_across_lanes():
    """3 rows of 1000 terms: 16 lanes per row (each keeps >= 32 terms), each sums every 16th term, a
    butterfly of shfl.sync.bfly (4 steps) combines them; the launch counts threads."""
    ptx, descs = _rowsum(3, 1000)
    k = entries(ptx)[descs[0].name]
    assert descs[0].lanes == 16 and descs[0].n_elements == 3 * 16
    assert k.count("shfl.sync.bfly") == 4 and ".local" not in k
    if PTXAS:
        _, info = assemble(ptx, "sm_90")
        assert info[descs[0].name].stack_frame == 0


def test_split_lanes_policy():
    from cuvil.targets.ptx.kernel_shapes import split_lanes
    assert split_lanes(1000, 2048, 2048) == 32          # a final Gemm: a warp per output
    assert split_lanes(25088, 2048, 2048) == 8          # 1x1 conv over 2048 channels on 7x7
    assert split_lanes(25088, 4608, 512) == 4           # 3x3 conv over 512 channels on 7x7: fewer lanes
    assert split_lanes(50176, 2304, 256) == 2
    assert split_lanes(3, 1000, 4) == 4                 # never more lanes than input channels
    assert split_lanes(3, 40, 40) == 1                  # too few terms to share



def test_tuning_is_an_argument_not_module_state():
    """The kernel shapes benchmarks vary come in a PtxTuning per build (no module switch): one process builds
    the same 3x3 convolution coarsened (the default), not coarsened, and coarsened again."""
    from cuvil.targets.ptx.kernel_shapes import split_lanes
    from cuvil.targets.ptx.tuning import PtxTuning
    assert split_lanes(1000, 2048, 2048, PtxTuning(split_target_threads=4000)) == 4
    assert split_lanes(1000, 2048, 2048) == 32
    with pytest.raises(ValueError):
        PtxTuning(split_mode="chunked")
    x = Buf("x", F32, (1, 8, 58, 58), base=2)
    w = Buf("w", F32, (64, 8, 3, 3), base=1)
    y = Buf("y", F32, (1, 64, 56, 56), base=3)
    n, c, h, ww = (var(s) for s in "nchw")
    e = reduce("sum", [8, 3, 3], lambda ci, kh, kw: binop("mul", load(x, [n, ci, h + kh, ww + kw]),
                                                           load(w, [c, ci, kh, kw])))
    sched = _sched([Stage("conv", y, [n, c, h, ww], e)], [x], [y])
    tunings = (PtxTuning(), PtxTuning(coarsen=1), PtxTuning())
    kinds = [generate_ptx(sched, "sm_90", tuning=t)[1][0].kind for t in tunings]
    assert kinds == ["coarse", "element", "coarse"]

def test_grid_is_capped():
    assert KernelDesc("k", 1000).grid == 4
    assert KernelDesc("k", 0).grid == 0
    assert KernelDesc("k", 10 ** 12).grid == GRID_CAP
    assert KernelDesc("k", 1000, block=128).grid == 8


def test_bad_arch_is_rejected():
    with pytest.raises(CuvilError, match="sm_"):
        generate_ptx(elementwise_sched(), "compute_90")


def test_parse_ptxas_verbose():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'cuvil_k1' for 'sm_90'
ptxas info    : Function properties for cuvil_k1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'cuvil_k0' for 'sm_90'
ptxas info    : Function properties for cuvil_k0
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, 16 bytes smem, 368 bytes cmem[0]
"""
    info = parse_verbose(text)
    assert info["cuvil_k1"].registers == 32 and info["cuvil_k1"].spill_stores == 4 and info["cuvil_k1"].stack_frame == 8
    assert info["cuvil_k0"].registers == 12 and info["cuvil_k0"].shared == 16


def test_channel_coarsening_policy_and_kernel():
    """A 3x3 convolution with 200,704 outputs: 2 output channels per thread (half as many threads), no
    spills; small stages are not coarsened."""
    from cuvil.targets.ptx.kernel_shapes import coarsen_factor, single_sum
    x = Buf("x", F32, (1, 8, 58, 58), base=2)
    w = Buf("w", F32, (64, 8, 3, 3), base=1)

    def conv(cout, hw):
        y = Buf("y", F32, (1, cout, hw, hw), base=3)
        n, c, h, ww = (var(s) for s in "nchw")
        e = reduce("sum", [8, 3, 3], lambda ci, kh, kw: binop("mul", load(x, [n, ci, h + kh, ww + kw]),
                                                               load(w, [c, ci, kh, kw])))
        return Stage("conv", y, [n, c, h, ww], e), y
    st, y = conv(64, 56)
    assert coarsen_factor(st, single_sum(st)) == 2
    small, _ = conv(64, 8)
    assert coarsen_factor(small, single_sum(small)) == 1
    ptx, descs = generate_ptx(_sched([st], [x], [y]), "sm_90")
    assert descs[0].n_elements == 64 * 56 * 56 // 2
    if PTXAS:
        _, info = assemble(ptx, "sm_90")
        assert info[descs[0].name].spill_stores == 0


def test_tiled_kernel_for_a_large_stage():
    """A 1x1 convolution over 64 channels with 64 x 3136 x 2 = 401,408 outputs: a shared-memory tiled kernel (two tiles in
    .shared memory, bar.sync between loading and using them), launched as whole blocks of the tile's threads;
    ptxas accepts it without spills."""
    from cuvil.targets.ptx.kernel_shapes import tile_factors, tile_shape, single_sum
    x = Buf("x", F32, (2, 64, 56, 56), base=2)
    w = Buf("w", F32, (64, 64), base=1)
    y = Buf("y", F32, (2, 64, 56, 56), base=3)
    n, c, h, ww = (var(s) for s in "nchw")
    e = reduce("sum", [64], lambda ci: binop("mul", load(x, [n, ci, h, ww]), load(w, [c, ci])))
    st = Stage("conv1x1", y, [n, c, h, ww], e)
    wf, xf = tile_factors(st, single_sum(st))
    assert wf.attr is w and xf.attr is x                   # the weight factor depends on the channel only
    ptx, descs = generate_ptx(_sched([st], [x], [y]), "sm_90")
    d = descs[0]
    assert d.kind == "tiled"
    tm, tp = tile_shape(64, 2 * 56 * 56)
    assert d.block == (tm // 4) * (tp // 4) and d.n_elements % d.block == 0
    k = entries(ptx)[d.name]
    assert "bar.sync" in k and ".shared" in ptx
    if PTXAS:
        _, info = assemble(ptx, "sm_90")
        assert info[d.name].spill_stores == 0
