"""PTX for scheduled stages: one LLVM module (triple ``nvptx64-nvidia-cuda``) with one kernel per stage,
lowered by llvmlite's NVPTX backend.

Each stage becomes ``ptx_kernel void <prefix>_k<i>(ptr bufs, i64 n)``: thread ``blockIdx.x * blockDim.x +
threadIdx.x`` computes output element ``i`` of the flattened output (row-major), then ``i`` advances by
``gridDim.x * blockDim.x`` (grid-stride loop) while ``i < n``; so any grid size is correct and the launcher
may cap it. The element's indices are unflattened from ``i``, the stage's expression is evaluated by the
x86 backend's expression emitter (reductions become loops inside the thread) and the value is stored.

Memory: ``bufs[b]`` are global-memory pointers (0 arena, 1 weights, then inputs and outputs). Every buffer
a stage reads and does not write is constant while the kernel runs, so its loads carry ``!invariant.load``
and NVPTX emits them as ``ld.global.nc`` (read-only data cache).

Math: sqrt, fabs, floor, ceil, roundeven, trunc, fma, min/max lower to PTX instructions (sqrt and division
correctly rounded; no flush-to-zero); exp, log, tanh, erf, pow, fmod, ... call NVIDIA's libdevice, which
is linked into the module, internalised, and everything unused is dropped before optimisation.

Floating point contraction (``a * b + c`` -> one ``fma``, one rounding) is off by default: the rewrite
rules' exactness arguments assume each operation rounds separately. Without it NVPTX emits ``add.rn`` /
``mul.rn``, which ptxas may not fuse either. ``fma=True`` marks every float add, sub and mul ``contract``.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

import attrs
import llvmlite.binding as llvm
import llvmlite.ir as ir

from ...errors import CuvilError, UnsupportedOpError
from ...ir.dtype import DType
from ..schedule import Schedule, Stage
from ..texpr import E, Buf
from ..x86.codegen import F16, F32, I1, I32, I64, PTR, KernelModule, _Emitter, ll, mem_type

TRIPLE = "nvptx64-nvidia-cuda"
BLOCK = 256
GRID_CAP = 65535          # blocks per launch at most; the grid-stride loop covers the rest
GLOBAL = 1                # NVPTX address space of global memory
GPTR = ir.PointerType(addrspace=GLOBAL)

# calls lowered to PTX instructions by the NVPTX backend
_NATIVE = {"sqrt": "sqrt", "fabs": "fabs", "floor": "floor", "ceil": "ceil", "roundeven": "roundeven",
           "trunc": "trunc", "fma": "fma", "copysign": "copysign", "fmin": "minnum", "fmax": "maxnum",
           "minnum": "minnum", "maxnum": "maxnum", "minimum": "minimum", "maximum": "maximum"}
# calls to libdevice (__nv_<name>f for float, __nv_<name> for double)
_LIBDEVICE = {"exp", "exp2", "exp10", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
              "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "pow",
              "fmod", "cbrt", "rsqrt", "hypot", "remainder", "lgamma", "tgamma"}
_FP_ARITH = {"fadd", "fsub", "fmul"}

_INITIALIZED = False


def _init():
    global _INITIALIZED
    if not _INITIALIZED:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _INITIALIZED = True


@attrs.define
class KernelDesc:
    """How to launch one kernel: ``grid = ceil(n_elements / block)`` blocks of ``block`` threads (1-D),
    capped at :data:`GRID_CAP` (the kernel's grid-stride loop does the rest); arguments ``(bufs, n)`` with
    ``n = n_elements``. A kernel with ``n_elements == 0`` need not be launched."""
    name: str
    n_elements: int
    block: int = BLOCK
    stage: str = ""        # the schedule stage it computes (for reports)

    @property
    def grid(self) -> int:
        return min(-(-self.n_elements // self.block), GRID_CAP)


# --- toolkit ------------------------------------------------------------------------------------------

def find_libdevice() -> Optional[str]:
    """libdevice.10.bc: $CUVIL_LIBDEVICE, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda, next to
    ptxas, or in the ``nvidia-cuda-nvcc`` wheel; None when absent."""
    env = os.environ.get("CUVIL_LIBDEVICE")
    if env:
        return env if os.path.isfile(env) else None
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    ptxas = shutil.which("ptxas")
    if ptxas:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(ptxas))))
    try:
        import nvidia.cuda_nvcc as _nv  # type: ignore
        roots.extend(getattr(_nv, "__path__", []))
    except Exception:
        pass
    for root in roots:
        if root:
            p = os.path.join(root, "nvvm", "libdevice", "libdevice.10.bc")
            if os.path.isfile(p):
                return p
    # a CUDA install whose ptxas is a wrapper script: /usr/local/cuda-*/
    for base in sorted(os.listdir("/usr/local")) if os.path.isdir("/usr/local") else []:
        p = os.path.join("/usr/local", base, "nvvm", "libdevice", "libdevice.10.bc")
        if base.startswith("cuda") and os.path.isfile(p):
            return p
    return None


_LIBDEVICE_BITCODE: Dict[str, bytes] = {}


def _libdevice_module(path: Optional[str], triple: str, layout: str):
    path = path or find_libdevice()
    if path is None or not os.path.isfile(path):
        raise CuvilError("libdevice.10.bc not found (needed for exp/log/tanh/erf/pow/... on the GPU): "
                         "install the CUDA toolkit or set CUVIL_LIBDEVICE")
    if path not in _LIBDEVICE_BITCODE:
        with open(path, "rb") as f:
            _LIBDEVICE_BITCODE[path] = f.read()
    mod = llvm.parse_bitcode(_LIBDEVICE_BITCODE[path])
    mod.triple, mod.data_layout = triple, layout
    return mod


def target_machine(arch: str = "sm_90", opt: int = 3):
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise CuvilError(f"GPU architecture {arch!r}: expected sm_<number>, e.g. sm_80 or sm_90")
    _init()
    target = llvm.Target.from_triple(TRIPLE)
    return target.create_target_machine(cpu=arch, features="", opt=min(max(opt, 0), 3))


# --- code generation ------------------------------------------------------------------------------------

def _overlaps(a: Buf, b: Buf) -> bool:
    ra, rb = a.storage, b.storage
    if ra.base != rb.base:
        return False
    return ra.offset < rb.offset + max(rb.nbytes, 1) and rb.offset < ra.offset + max(ra.nbytes, 1)


class _PtxEmitter(_Emitter):
    """The x86 expression emitter with global-memory addressing, read-only loads and GPU math."""

    def __init__(self, km: "PtxKernelModule", fn: ir.Function, b: ir.IRBuilder, bufs, out: Buf):
        super().__init__(km, fn, b, bufs)
        self.out = out

    def base(self, buf: Buf) -> ir.Value:
        if buf.base not in self.bases:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                slot = self.b.gep(self.bufs, [I64(buf.base)], source_etype=PTR, inbounds=True)
                p = self.b.load(slot, typ=PTR)
                p.set_metadata("invariant.load", self.km.empty_md)
                self.bases[buf.base] = self.b.addrspacecast(p, GPTR)
        return self.bases[buf.base]

    def _emit(self, e: E) -> ir.Value:
        op, dt = e.op, e.dtype
        if op == "load":
            buf = e.attr
            v = self.b.load(self.address(buf, [self.emit(a) for a in e.args]), typ=mem_type(dt))
            if not _overlaps(buf, self.out):
                v.set_metadata("invariant.load", self.km.empty_md)
            return self.b.trunc(v, I1) if dt == DType.BOOL else v
        if op == "fmod" and dt.is_float:
            return self.call("fmod", [self.emit(a) for a in e.args], dt)
        if op == "gload":
            raise UnsupportedOpError("gload", detail="guarded loads have no PTX lowering")
        try:
            return super()._emit(e)
        except UnsupportedOpError:
            raise
        except CuvilError as err:
            if "no emitter" in str(err):
                raise UnsupportedOpError(op, detail="no PTX lowering") from None
            raise

    def call(self, name: str, args, dt: DType):
        b = self.b
        if not dt.is_float:
            raise UnsupportedOpError(name, detail=f"{name} of {dt.name} has no PTX lowering")
        if dt == DType.FLOAT16:
            wide = [b.fpext(a, F32) for a in args]
            return b.fptrunc(self.call(name, wide, DType.FLOAT), F16)
        if dt not in (DType.FLOAT, DType.DOUBLE):
            raise UnsupportedOpError(name, detail=f"{name} of {dt.name} has no PTX lowering")
        t = ll(dt)
        if name in _NATIVE:
            f = self.km.declare(f"llvm.{_NATIVE[name]}.{'f32' if t == F32 else 'f64'}", t, [t] * len(args))
        elif name in _LIBDEVICE:
            f = self.km.declare(f"__nv_{name}{'f' if t == F32 else ''}", t, [t] * len(args))
            self.km.needs_libdevice = True
        else:
            raise UnsupportedOpError(name, detail="no PTX (NVPTX intrinsic or libdevice) lowering")
        return b.call(f, args)


class PtxKernelModule(KernelModule):
    def __init__(self, name: str, tm, *, fma: bool = False, block: int = BLOCK):
        super().__init__(name, tm, TRIPLE)
        self.fma = fma
        self.block = block
        self.kernels: List[str] = []
        self.needs_libdevice = False
        self.empty_md = self.module.add_metadata([])

    def sreg(self, b: ir.IRBuilder, name: str) -> ir.Value:
        f = self.declare(f"llvm.nvvm.read.ptx.sreg.{name}", I32, [])
        return b.zext(b.call(f, []), I64)

    def add_stage(self, st: Stage, sym: str) -> KernelDesc:
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, I64]), name=sym)
        fn.calling_convention = "ptx_kernel"     # LLVM >= 20 marks kernels by calling convention
        if llvm.llvm_version_info < (20,):         # older LLVM: the nvvm.annotations "kernel" entry
            self.module.add_named_metadata("nvvm.annotations", [fn, "kernel", I32(1)])
        fn.args[0].add_attribute("noalias")
        bufs, n = fn.args
        entry = fn.append_basic_block("entry")
        b = ir.IRBuilder(entry)
        em = _PtxEmitter(self, fn, b, bufs, st.buf)
        shape = [int(d) for d in st.buf.shape]
        total = 1
        for d in shape:
            total *= d

        ntid = self.sreg(b, "ntid.x")
        gid = b.add(b.mul(self.sreg(b, "ctaid.x"), ntid), self.sreg(b, "tid.x"))
        stride = b.mul(self.sreg(b, "nctaid.x"), ntid)

        # grid-stride loop: for (i = gid; i < n; i += stride)
        pre = b.block
        head = fn.append_basic_block("loop")
        body = fn.append_basic_block("body")
        done = fn.append_basic_block("done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(gid, pre)
        b.cbranch(b.icmp_signed("<", i, n), body, done)
        b.position_at_end(body)
        em.memo.append(dict(em.memo[-1]))
        idx: List[ir.Value] = [None] * len(shape)
        rest = i
        for d in reversed(range(len(shape))):
            if d == 0:
                idx[d] = rest
            else:
                idx[d] = b.urem(rest, I64(shape[d]))
                rest = b.udiv(rest, I64(shape[d]))
        em.store_element(st, idx)
        em.memo.pop()
        nxt = b.add(i, stride)
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)
        b.ret_void()
        _set_contraction(fn, self.fma)
        self.kernels.append(sym)
        return KernelDesc(sym, total, self.block, st.name)

    def compile_ptx(self, opt: int, libdevice: Optional[str] = None) -> str:
        try:
            mod = llvm.parse_assembly(str(self.module))
            mod.verify()
        except RuntimeError as e:
            raise CuvilError(f"generated NVPTX LLVM IR does not verify: {e}") from None
        if self.needs_libdevice:
            mod.link_in(_libdevice_module(libdevice, mod.triple, mod.data_layout))
            keep = set(self.kernels)
            for f in mod.functions:
                if not f.is_declaration and f.name not in keep:
                    f.linkage = llvm.Linkage.internal
            for g in mod.global_variables:
                if not g.is_declaration:
                    g.linkage = llvm.Linkage.internal
            pm = llvm.create_new_module_pass_manager()
            pm.add_global_dead_code_eliminate_pass()
            pb = llvm.create_pass_builder(self.tm, llvm.create_pipeline_tuning_options(speed_level=0))
            pm.run(mod, pb)
        # at -O0 too: the pipeline's start runs NVVMReflect, which resolves libdevice's __nvvm_reflect
        pto = llvm.create_pipeline_tuning_options(speed_level=min(max(opt, 0), 3))
        pto.loop_vectorization = False
        pto.slp_vectorization = False
        pb = llvm.create_pass_builder(self.tm, pto)
        pb.getModulePassManager().run(mod, pb)
        undefined = sorted(f.name for f in mod.functions
                           if f.is_declaration and not f.name.startswith("llvm.") and f.name.strip())
        if undefined:
            raise CuvilError(f"PTX module would call undefined functions: {', '.join(undefined)}")
        ptx = self.tm.emit_assembly(mod)
        if ".extern .func" in ptx:   # a libcall the backend introduced (e.g. for an operation PTX lacks)
            ext = sorted(set(re.findall(r"\.extern \.func[^(]*?(\w+)\s*\(", ptx)))
            raise CuvilError(f"PTX module calls undefined functions: {', '.join(ext) or '?'}")
        return ptx


def _set_contraction(fn: ir.Function, on: bool):
    """Mark every float add/sub/mul ``contract`` (fma allowed) or strip ``contract`` everywhere."""
    for blk in fn.blocks:
        for ins in blk.instructions:
            flags = getattr(ins, "flags", None)
            if flags is None or not isinstance(flags, list):
                continue
            if on and ins.opname in _FP_ARITH:
                if "contract" not in flags and "fast" not in flags:
                    flags.append("contract")
            elif not on:
                if "fast" in flags:   # fast implies contract: spell out the rest
                    flags.remove("fast")
                    flags.extend(x for x in ("nnan", "ninf", "nsz", "arcp", "afn", "reassoc") if x not in flags)
                while "contract" in flags:
                    flags.remove("contract")


def _sanitize(prefix: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]", "_", prefix) or "cuvil"
    return s if not s[0].isdigit() else "_" + s


def generate_ptx(sched: Schedule, arch: str = "sm_90", opt: int = 3, *, fma: bool = False,
                 prefix: str = "cuvil", block: int = BLOCK,
                 libdevice: Optional[str] = None) -> Tuple[str, List[KernelDesc]]:
    """PTX text for every stage of ``sched`` (one module, one kernel per stage, in schedule order) and how
    to launch each. ``fma`` allows contracting ``a * b + c`` into one fused multiply-add (off: every
    operation rounds separately, as the rewrite rules assume)."""
    if block <= 0 or block > 1024:
        raise CuvilError(f"block size {block}: expected 1..1024 threads")
    tm = target_machine(arch, opt)
    prefix = _sanitize(prefix)
    km = PtxKernelModule(prefix, tm, fma=fma, block=block)
    descs = [km.add_stage(st, f"{prefix}_k{k}") for k, st in enumerate(sched.stages)]
    return km.compile_ptx(opt, libdevice), descs
