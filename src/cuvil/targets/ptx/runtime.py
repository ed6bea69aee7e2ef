"""Running a GPU bundle (``NAME.cuvil/``) through the CUDA driver API of ``cuda-python``
(``cuda.bindings.driver``, imported only when a model is loaded).

    m = load_bundle("build/resnet50.cuvil")      # module, weights uploaded once, one session (arena, stream)
    (y,) = m.run(x)                              # numpy in, numpy out (H2D, one graph replay, D2H)
    m.run({"data": x})["probs"]                  # a dict in, a dict out
    m.run_device([x_ptr], [y_ptr])               # device pointers (ints): no copies
    m = load_bundle(path, sessions=4)            # run / run_device from 4 threads at once, on 4 streams

:class:`GpuModel` is the GPU side of the one model interface (:mod:`cuvil.targets.model_api`): the call
forms, the metadata and the input checks are the x86 model's. :func:`bundle_signature` reads them from the
bundle alone, without a driver, so they are checked (and tested) on machines without a GPU.

One model holds the modules (the bundle's cubin when it was built for this GPU's architecture, else its PTX,
compiled by the driver) and the weights, uploaded once; and one or more sessions
(:mod:`cuvil.targets.ptx.session`; ``sessions=N``, ``m.session()``), each with its own stream, device arena of
``plan["arena_bytes"]``, staging for numpy inputs and outputs, graphs, and per bucket the device
buffer-pointer table ``[arena, weights, inputs..., outputs...]`` that every kernel reads. Kernels read the
table at run time, so pointing a session at other input/output buffers is one 8-byte-per-entry copy, never a
re-capture. Calls on different sessions run at once (from several host threads, on several streams).

Graphs: the first run of a shape bucket on a session captures all launches of one inference into a CUDA graph, in
order on its stream, or (``streams=N``; 1 by default until timed on a GPU) laid over N streams by the plan's dependencies so that kernels
that share no bytes run at once (:mod:`cuvil.targets.ptx.launch_deps`: BERT's Q, K and V products), into a CUDA graph, instantiates it and keeps it in a bounded LRU cache (:mod:`cuvil.targets.ptx.graph_cache`)
keyed by the bucket. A static bundle has one bucket; a profile bundle (:mod:`cuvil.targets.ptx.profile_bundle`)
one per bucket point, all loaded at load time, a call between buckets running the next one up, padded where
the graph allows it (:mod:`cuvil.targets.ptx.buckets`). Later runs replay with one ``cuGraphLaunch``.
``mode="eager"`` launches the kernels one by one instead. Every failing driver call raises
:class:`CudaError` with the call and the CUDA error name; :func:`inject_fault` (or ``CUVIL_GPU_FAULT``)
makes the next matching call fail, for the fail-safe's tests (:mod:`cuvil.targets.ptx.failsafe`).
"""
from __future__ import annotations

import json
import os
import queue
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ... import audit
from ...errors import CuvilError, ShapeError
from ...ir.dtype import DType
from ...supply_chain.digests import directory_files, file_digests, root_digest, sha256_file
from ..model_api import Model, Signature, SymbolProfile, fixed_symbols, tensor_spec
from . import buckets as bk
from .bundle import SIGNATURE_FILE, bundle_file, bundle_has, read_bundle
from .graph_cache import GraphCache
from .launch_deps import DEFAULT_STREAMS, MAX_STREAMS
from .session import MODES, GpuSession

class NoGpuError(CuvilError):
    """No usable CUDA driver or GPU on this machine (or cuda-python is not installed)."""


class CudaError(CuvilError):
    """A CUDA driver call failed; ``.call`` and ``.name`` (e.g. ``CUDA_ERROR_INVALID_VALUE``) say which and why."""

    def __init__(self, call: str, name: str, detail: str = ""):
        self.call, self.name = call, name
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))


# --- the driver ------------------------------------------------------------------------------------------

_DRIVER = None
_DRIVER_LOCK = threading.Lock()


# --- fault injection (tests) -----------------------------------------------------------------------------

#: The env variable that makes driver calls fail, for the fail-safe's tests on a real GPU:
#: ``CUVIL_GPU_FAULT=cuMemAlloc=CUDA_ERROR_OUT_OF_MEMORY`` (``;`` between several): the next call whose name
#: starts with ``cuMemAlloc`` fails with that CUresult's name instead of running. ``cuInit=...`` makes the
#: GPU missing (:class:`NoGpuError`). Read when a model is loaded; :func:`inject_fault` does it in-process.
FAULT_ENV = "CUVIL_GPU_FAULT"
_FAULTS: List[list] = []          # [call prefix, CUresult name, remaining count]
_FAULTS_LOCK = threading.Lock()


def inject_fault(call: str, error: str, times: int = 1) -> None:
    """Make the next ``times`` driver calls whose name starts with ``call`` fail with CUresult ``error``
    (``"CUDA_ERROR_OUT_OF_MEMORY"``, ``"CUDA_ERROR_ILLEGAL_ADDRESS"``; ``call="cuInit"``: no GPU). A testing
    hook of the fail-safe (:class:`cuvil.targets.ptx.failsafe.FailSafeModel`)."""
    if not call or not str(error).startswith("CUDA_ERROR_"):
        raise CuvilError(f"inject_fault({call!r}, {error!r}): expected a driver call name and a CUresult name",
                         hint="inject_fault('cuGraphLaunch', 'CUDA_ERROR_ILLEGAL_ADDRESS')")
    with _FAULTS_LOCK:
        _FAULTS.append([str(call), str(error), int(times)])


def clear_faults() -> None:
    with _FAULTS_LOCK:
        _FAULTS.clear()


def _faults_from_env() -> None:
    spec = os.environ.pop(FAULT_ENV, "")
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        call, _, err = part.partition("=")
        inject_fault(call.strip(), err.strip())


def _injected(what: str) -> Optional[str]:
    if not _FAULTS:
        return None
    with _FAULTS_LOCK:
        for f in _FAULTS:
            if what.startswith(f[0]):
                f[2] -= 1
                if f[2] <= 0:
                    _FAULTS.remove(f)
                return f[1]
    return None


def driver():
    """``cuda.bindings.driver`` after a successful ``cuInit``; :class:`NoGpuError` otherwise."""
    global _DRIVER
    _faults_from_env()
    err = _injected("cuInit")
    if err is not None:
        raise NoGpuError(f"no CUDA driver/GPU: cuInit failed: {err} (injected)")
    with _DRIVER_LOCK:
        if _DRIVER is not None:
            return _DRIVER
        try:
            from cuda.bindings import driver as drv
        except ImportError:
            try:  # cuda-python 12.3 - 12.5
                from cuda import cuda as drv  # type: ignore
            except ImportError:
                raise NoGpuError("no CUDA driver/GPU: cuda-python is not installed "
                                 "(pip install 'cuvil[gpu]', i.e. cuda-python>=12.3)") from None
        try:
            res = drv.cuInit(0)
        except Exception as e:  # noqa: BLE001 - the bindings raise their own types when libcuda is absent
            raise NoGpuError(f"no CUDA driver/GPU: cannot load the CUDA driver library ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else e})") from None
        if res[0] != drv.CUresult.CUDA_SUCCESS:
            raise NoGpuError(f"no CUDA driver/GPU: cuInit failed: {_error_name(drv, res[0])}")
        n = _call(drv, "cuDeviceGetCount", drv.cuDeviceGetCount())
        if n < 1:
            raise NoGpuError("no CUDA driver/GPU: the driver sees no device")
        _DRIVER = drv
        return drv


def _error_name(drv, err) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - fall back to the enum's own name
        pass
    return getattr(err, "name", str(err))


def _call(drv, what: str, res):
    """The values of a cuda-python result tuple ``(CUresult, values...)``, or :class:`CudaError`."""
    err = res[0]
    if _FAULTS:
        inj = _injected(what)
        if inj is not None:
            raise CudaError(what, inj, "injected")
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(what, _error_name(drv, err))
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def device_info(ordinal: int = 0) -> dict:
    """Name, compute capability, memory and driver version of a GPU."""
    drv = driver()
    dev = _call(drv, "cuDeviceGet", drv.cuDeviceGet(ordinal))
    attr = drv.CUdevice_attribute
    cc = tuple(_call(drv, "cuDeviceGetAttribute", drv.cuDeviceGetAttribute(a, dev))
               for a in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    name = _call(drv, "cuDeviceGetName", drv.cuDeviceGetName(256, dev))
    name = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
    ver = _call(drv, "cuDriverGetVersion", drv.cuDriverGetVersion())
    sms = _call(drv, "cuDeviceGetAttribute",
                drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    total = _call(drv, "cuDeviceTotalMem", drv.cuDeviceTotalMem(dev))
    return {"name": name, "compute_capability": f"{cc[0]}.{cc[1]}", "arch": f"sm_{cc[0]}{cc[1]}",
            "multiprocessors": sms, "memory_bytes": int(total),
            "driver_cuda_version": f"{ver // 1000}.{ver % 1000 // 10}"}


# --- the model -------------------------------------------------------------------------------------------

class _Buffer:
    """Where an input or output lives on the device: its index in the buffer-pointer table and its bytes."""

    __slots__ = ("name", "dtype", "shape", "code", "buffer", "nbytes")

    def __init__(self, d: dict):
        self.name, self.code, self.buffer = d["name"], int(d["dtype_code"]), int(d["buffer"])
        self.shape = tuple(int(x) for x in d["shape"])
        self.dtype = DType(self.code).numpy
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"{self.name}: {np.dtype(self.dtype).name}{list(self.shape)}"


def bundle_signature(path: str, plan: Optional[dict] = None, manifest: Optional[dict] = None) -> Signature:
    """The inputs, outputs and symbols of bundle ``path`` (plan.json, manifest.json; no driver needed). A
    bundle's symbols without a profile were fixed at compile time (the manifest's ``specialized``: min = opt
    = max, and a dim that does not fit names the compile that would); a profile bundle's profiled symbols
    keep their range (its plan's ``profile``) and the inputs their symbolic dims."""
    if plan is None or manifest is None:
        plan, manifest = read_bundle(path)
    fixed = fixed_symbols(manifest)
    triple = (manifest.get("target") or {}).get("triple", "") if isinstance(manifest.get("target"), dict) else ""
    symbols = {k: SymbolProfile(v, v, v) for k, v in fixed.items()}
    for k, p in (plan.get("profile") or {}).items():
        symbols[k] = SymbolProfile(int(p["min"]), int(p["opt"]), int(p["max"]), int(p.get("multiple", 1)))
    return Signature(artifact=os.path.basename(os.path.abspath(path)),
                     inputs=tuple(tensor_spec(d["name"], d["dtype_code"], d.get("dims", d["shape"]))
                                  for d in plan["inputs"]),
                     outputs=tuple(tensor_spec(d["name"], d["dtype_code"], d.get("dims", d["shape"]))
                                   for d in plan["outputs"]),
                     symbols=symbols, fixed=fixed, target=triple)


class _Variant:
    """One bucket's kernels (a static bundle has one), shared by every session: its plan, module, functions,
    the kernels to launch, its weights and the shapes of its inputs and outputs."""

    def __init__(self, index: int, point: dict, plan: dict, where: str, weights_file: str):
        self.index, self.point, self.plan, self.where, self.weights_file = index, point, plan, where, weights_file
        self.in_bufs = [_Buffer(d) for d in plan["inputs"]]
        self.out_bufs = [_Buffer(d) for d in plan["outputs"]]
        self.module = self.module_source = None
        self.functions: list = []
        self.kernels: list = []          # (kernel, function) of each launch (kernels with work), in order
        self.registers: Dict[str, int] = {}
        self.weights = 0

    @property
    def label(self) -> str:
        return bk.point_text(self.point)


def _check_disjoint(what: str, ptrs: Sequence[int], bufs, n_in: int, names: Sequence[str]) -> None:
    """An output's bytes may overlap no input's and no other output's (as the x86 C ABI's CUVIL_ERR_OVERLAP):
    the kernels read the inputs while others write the outputs, several at once (the plan's dependencies know
    each buffer only by its slot)."""
    spans = [(int(p), int(p) + int(b.nbytes), k) for k, (p, b) in enumerate(zip(ptrs, bufs)) if b.nbytes]
    for lo, hi, k in spans:
        if k < n_in:
            continue
        for lo2, hi2, k2 in spans:
            if k2 != k and lo < hi2 and lo2 < hi:
                kind = "input" if k2 < n_in else "output"
                raise ShapeError(f"{what}: run_device's output {names[k]!r} ({hi - lo} B at {lo:#x}) overlaps "
                                 f"{kind} {names[k2]!r} ({hi2 - lo2} B at {lo2:#x}): an output needs memory of its "
                                 f"own, the kernels may read the inputs while others write the outputs",
                                 hint="give each output its own device buffer (copy it over the input after the "
                                      "call if an in-place update is wanted)")


class GpuModel(Model):
    """A loaded GPU bundle (:class:`cuvil.targets.model_api.Model`: ``run``, ``inputs``, ``outputs``,
    ``symbols``; ``run(..., mode="eager")`` for one call), ``run_device`` for device pointers,
    ``stats()`` / ``graph_stats()``, ``profile_kernels()``, ``capture()``, ``session()``.

    Sessions (:mod:`cuvil.targets.ptx.session`): the modules and the weights are loaded once; each session has
    its own stream, arena, staging (the inputs' also page-locked on the host unless ``pinned=False``), pointer
    tables and graph
    cache. ``sessions=N`` keeps a pool of N: ``run`` and ``run_device`` are safe to call from any number of
    host threads, each call taking a free session (N calls in flight at once, on N streams; more wait for
    one). ``session()`` makes one more, for a thread that keeps its own. ``max_graphs`` bounds each session's
    graph cache.

    A profile bundle (:mod:`cuvil.targets.ptx.profile_bundle`) loads every bucket's module up front; a session's
    arena is the largest bucket's: a call runs its bucket (padded where the manifest's ``profile`` says the
    symbol may be, :mod:`~cuvil.targets.ptx.buckets`) and nothing compiles at run time."""

    run_options = ("mode",)

    def __init__(self, path: str, *, device: int = 0, max_graphs: int = 4, mode: str = "graph",
                 prefer_cubin: bool = True, files: Optional[Mapping[str, bytes]] = None, sessions: int = 1,
                 pinned: bool = True, streams: int = DEFAULT_STREAMS):
        if mode not in MODES:
            raise CuvilError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
            raise CuvilError(f"sessions must be a positive integer, got {sessions!r}",
                             hint="sessions=4 lets four host threads each run an inference at once")
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise CuvilError(f"streams must be an integer from 1 to {MAX_STREAMS}, got {streams!r}",
                             hint="streams=4 lets a captured graph run independent kernels at once; streams=1 "
                                  "keeps the launch order")
        self.streams = streams
        self.path = os.path.abspath(os.fspath(path))
        self._files = files                                       # a verified load's bytes: the disk is not read
        self.plan, self.manifest = read_bundle(self.path, files)   # a bad bundle fails before the driver is touched
        self.mode = mode
        self.pinned = bool(pinned)
        self.signature = bundle_signature(self.path, self.plan, self.manifest)
        self.profile = self.plan.get("profile") or {}
        self._buckets = {n: [int(v) for v in p["buckets"]] for n, p in self.profile.items()}
        self._paddable = {n: bool(p.get("paddable")) for n, p in self.profile.items()}
        self._dims = [list(d.get("dims", d["shape"])) for d in self.plan["inputs"]]
        self._out_dims = [list(d.get("dims", d["shape"])) for d in self.plan["outputs"]]
        if self.plan.get("buckets"):
            self._variants = [_Variant(i, dict(e["point"]), json.loads(bundle_file(self.path, f"{e['dir']}/plan.json",
                                                                                   files)), e["dir"] + "/",
                                       e.get("weights", "weights.bin"))
                              for i, e in enumerate(self.plan["buckets"])]
        else:
            self._variants = [_Variant(0, {}, self.plan, "", "weights.bin")]
        self._by_point = {bk.point_key(v.point): v for v in self._variants}
        self.module_loads = 0
        self._lock = threading.RLock()
        self._closed = True
        self._allocs: List[int] = []
        self._sessions: List[GpuSession] = []      # the pool's
        self._own: List[GpuSession] = []           # made by session()
        self._pool: "queue.LifoQueue[GpuSession]" = queue.LifoQueue()
        self.max_graphs = GraphCache(max_graphs, lambda e: None).max_graphs    # checked before the driver is touched
        self._d = drv = driver()
        dev = self._call("cuDeviceGet", drv.cuDeviceGet(device))
        self._dev = dev
        # the primary context: the one the runtime API (PyTorch, CuPy) shares, so device pointers interoperate
        self._ctx = self._call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
        self._closed = False
        try:
            self._setup(device, sessions, prefer_cubin)
        except BaseException:
            self.close()           # what was allocated before the failure is freed, the context released
            raise

    def _setup(self, device: int, sessions: int, prefer_cubin: bool) -> None:
        drv = self._d
        self._activate()
        self.device = device_info(device)
        # shared by the sessions: the weights once (a bucket whose constants differ has its own file), modules
        self.arena_bytes = max(int(v.plan["arena_bytes"]) for v in self._variants)
        uploaded: Dict[str, int] = {}
        self.weights_bytes = 0
        for v in self._variants:
            if v.weights_file not in uploaded:
                uploaded[v.weights_file] = self._upload_weights(v.weights_file, int(v.plan["weights_bytes"]))
                self.weights_bytes += max(int(v.plan["weights_bytes"]), 1)
            v.weights = uploaded[v.weights_file]
        self.weights = self._variants[-1].weights
        self._in_bytes = [max(v.in_bufs[i].nbytes for v in self._variants) for i in range(len(self.plan["inputs"]))]
        self._out_bytes = [max(v.out_bufs[i].nbytes for v in self._variants)
                           for i in range(len(self.plan["outputs"]))]
        for v in self._variants:
            self._load_variant(v, prefer_cubin)
        # a static bundle's one variant, under the names its callers use
        v0 = self._variants[-1]
        self._in_bufs, self._out_bufs = v0.in_bufs, v0.out_bufs
        self.module_source = v0.module_source
        self.registers = v0.registers if len(self._variants) == 1 else {
            f"{v.where}{k}": r for v in self._variants for k, r in v.registers.items()}
        for i in range(sessions):
            self._sessions.append(GpuSession(self, i, self.pinned))
            self._pool.put(self._sessions[-1])
        self._main = self._sessions[0]

    # -- sessions ------------------------------------------------------------------------------------

    def session(self, pinned: Optional[bool] = None) -> GpuSession:
        """A new session of this model for the caller alone (its own stream, arena, staging and graphs; the
        modules and weights shared): a :class:`~cuvil.targets.ptx.session.GpuSession`, closed with the model
        (or by its own ``close()``). Runs concurrently with the model's other sessions."""
        with self._lock:
            self._activate()
            s = GpuSession(self, len(self._sessions) + len(self._own), self.pinned if pinned is None else pinned)
            self._own.append(s)
            return s

    @property
    def sessions(self) -> List[GpuSession]:
        """The pool's sessions (``sessions=N`` at load), then those ``session()`` made."""
        return list(self._sessions) + list(self._own)

    def _acquire(self) -> GpuSession:
        self._ensure_open()
        s = self._pool.get()
        if self._closed:
            self._pool.put(s)
            raise self.closed_error()
        return s

    # shared state the sessions read
    @staticmethod
    def _faults_armed() -> bool:
        return bool(_FAULTS)

    # the first session's buffers, under the names a one-session model's callers use
    @property
    def arena(self) -> int:
        return self._main.arena

    @property
    def _stream(self):
        return self._main._stream

    @property
    def _in_stage(self) -> List[int]:
        return self._main._in_stage

    @property
    def _out_stage(self) -> List[int]:
        return self._main._out_stage

    @property
    def _table(self) -> int:
        return self._main._lanes[-1].table

    @property
    def _launches(self) -> list:
        return self._variants[-1].kernels

    @property
    def device_bytes(self) -> int:
        """The model's device memory: the weights, the modules' buffer tables and each session's arena and
        staging."""
        return self.weights_bytes + sum(s.device_bytes for s in self.sessions)

    # -- driver plumbing ----------------------------------------------------------------------------

    def _call(self, what: str, res):
        return _call(self._d, what, res)

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error()

    def _activate(self):
        self._ensure_open()
        self._call("cuCtxSetCurrent", self._d.cuCtxSetCurrent(self._ctx))

    def _alloc_to(self, owner: List[int], nbytes: int, what: str) -> int:
        call = f"cuMemAlloc({what}, {nbytes} B)"
        err = _injected(call) if _FAULTS else None
        if err is not None:        # before the call: an injected failure leaks nothing
            raise CudaError(call, err, "injected")
        p = int(self._call(call, self._d.cuMemAlloc(nbytes)))
        owner.append(p)
        return p

    def _alloc(self, nbytes: int, what: str) -> int:
        return self._alloc_to(self._allocs, nbytes, what)

    def _upload_weights(self, name: str, nbytes: int) -> int:
        p = self._alloc(max(nbytes, 1), "weights")
        if nbytes:
            blob = np.frombuffer(bundle_file(self.path, name, self._files), dtype=np.uint8)
            if blob.nbytes != nbytes:
                raise CuvilError(f"{self.path}: {name} has {blob.nbytes} bytes, the plan says {nbytes}")
            self._call("cuMemcpyHtoD(weights)", self._d.cuMemcpyHtoD(p, blob.ctypes.data, blob.nbytes))
        return p

    def _load_variant(self, v: _Variant, prefer_cubin: bool) -> None:
        drv = self._d
        man = (json.loads(bundle_file(self.path, f"{v.where}manifest.json", self._files))
               if v.where else self.manifest)
        self._load_module(v, man, prefer_cubin)
        kernels = v.plan["kernels"]
        v.functions = [self._call(f"cuModuleGetFunction({k['name']})",
                                  drv.cuModuleGetFunction(v.module, k["name"].encode())) for k in kernels]
        regs = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        v.registers = {k["name"]: int(self._call(f"cuFuncGetAttribute({k['name']})", drv.cuFuncGetAttribute(regs, fn)))
                       for k, fn in zip(kernels, v.functions)}
        v.kernels = [(k, fn) for k, fn in zip(kernels, v.functions) if int(k["n"]) > 0]

    def _load_module(self, v: _Variant, manifest: dict, prefer_cubin: bool):
        drv = self._d
        self.module_loads += 1
        cubin = (manifest.get("ptxas") or {}).get("cubin")
        if prefer_cubin and cubin and v.plan.get("arch") == self.device["arch"]:
            present = bundle_has(self.path, v.where + cubin, self._files)
            if present:
                image = np.frombuffer(bundle_file(self.path, v.where + cubin, self._files), dtype=np.uint8)
                res = drv.cuModuleLoadData(image.ctypes.data)
                if res[0] == drv.CUresult.CUDA_SUCCESS:
                    v.module, v.module_source = res[1], v.where + cubin
                    return
                # an older driver can refuse a newer toolkit's cubin: the PTX still loads through the JIT
        image = np.frombuffer(bundle_file(self.path, v.where + "kernels.ptx", self._files) + b"\0", dtype=np.uint8)
        v.module = self._call(f"cuModuleLoadData({v.where}kernels.ptx)", drv.cuModuleLoadData(image.ctypes.data))
        v.module_source = v.where + "kernels.ptx"

    # -- buckets -------------------------------------------------------------------------------------

    def _variant_for(self, xs: Sequence[np.ndarray]) -> Tuple[_Variant, Dict[str, int]]:
        """The bucket of a call with inputs ``xs`` (checked by the signature) and its symbol values."""
        if not self._buckets:
            return self._variants[0], {}
        bindings: Dict[str, int] = {}
        for a, dims in zip(xs, self._dims):
            for got, d in zip(a.shape, dims):
                if isinstance(d, str):
                    bindings.setdefault(d, int(got))
        point = bk.choose_point(self._buckets, self._paddable, bindings, self.signature.artifact)
        return self._by_point[bk.point_key(point)], bindings

    def _device_variant(self, in_ptrs: Sequence[int], out_ptrs: Sequence[int],
                        symbols: Optional[Mapping[str, int]]) -> _Variant:
        """The bucket of a ``run_device`` call, its pointers checked."""
        if len(in_ptrs) != len(self._in_bufs) or len(out_ptrs) != len(self._out_bufs):
            raise ShapeError(f"{os.path.basename(self.path)}: run_device takes {len(self._in_bufs)} input and "
                             f"{len(self._out_bufs)} output pointers, got {len(in_ptrs)} and {len(out_ptrs)}")
        v = self._variants[-1]
        if self._buckets:
            missing = [n for n in self._buckets if n not in (symbols or {})]
            if missing:
                raise ShapeError(f"{os.path.basename(self.path)}: run_device on a profile bundle needs the values "
                                 f"of {', '.join(missing)}", hint="run_device(ins, outs, symbols={"
                                 + ", ".join(f"{n!r}: {b[-1]}" for n, b in self._buckets.items()) + "})")
            point = bk.choose_point(self._buckets, {}, symbols, self.signature.artifact)
            v = self._by_point[bk.point_key(point)]
        ptrs = [int(p) for p in list(in_ptrs) + list(out_ptrs)]
        if any(p == 0 for p, buf in zip(ptrs, v.in_bufs + v.out_bufs) if buf.nbytes):
            raise ShapeError(f"{os.path.basename(self.path)}: run_device got a null device pointer")
        _check_disjoint(os.path.basename(self.path), ptrs, v.in_bufs + v.out_bufs, len(in_ptrs),
                        [d["name"] for d in self.plan["inputs"] + self.plan["outputs"]])
        return v

    def capture(self, points: Optional[Sequence[Mapping[str, int]]] = None) -> List[str]:
        """Capture the graphs of ``points`` (bucket points, ``[{"N": 8}]``; default: the first ``max_graphs``
        buckets) ahead of time in every pool session, so that no call pays a capture; returns the buckets
        captured."""
        self._ensure_open()
        vs = ([self._by_point[bk.point_key(bk.choose_point(self._buckets, self._paddable, p,
                                                            self.signature.artifact))] for p in points]
              if points is not None else self._variants[:self.max_graphs])
        done: List[str] = []
        for s in self._sessions:
            done = s.capture(vs)
        return done

    # -- running ------------------------------------------------------------------------------------

    def _run_arrays(self, xs: List[np.ndarray], mode: Optional[str] = None) -> List[np.ndarray]:
        """One inference on checked inputs (``Model.run``) on a free session of the pool: H2D, the captured
        graph's replay (or, with ``mode="eager"``, the kernels one by one), D2H. A call between buckets runs
        the next bucket up on its rows plus zero rows, and returns its own rows."""
        s = self._acquire()
        try:
            return s._run_arrays(xs, mode)
        finally:
            self._pool.put(s)

    def run_device(self, in_ptrs: Sequence[int], out_ptrs: Sequence[int], *, stream=None, sync: bool = True,
                   mode: Optional[str] = None, symbols: Optional[Mapping[str, int]] = None) -> None:
        """One inference on device memory the caller owns: ``in_ptrs``/``out_ptrs`` are device pointers (ints)
        to contiguous tensors of the plan's shapes and dtypes, in this model's context (the device's primary
        context). Runs on ``stream`` (a CUstream or its int handle; default: the session's stream) after the
        work already queued there, on a free session of the pool; ``sync=False`` returns without waiting (the
        session's next call waits for it). A profile bundle takes the symbol values in ``symbols``
        (``{"N": 8}``); each must be a bucket (the caller's buffers have its shapes: no padding into memory
        the model does not own)."""
        self._device_variant(in_ptrs, out_ptrs, symbols)
        s = self._acquire()
        try:
            s.run_device(in_ptrs, out_ptrs, stream=stream, sync=sync, mode=mode, symbols=symbols)
        finally:
            self._pool.put(s)

    def pinned_inputs(self, symbols: Optional[Mapping[str, int]] = None) -> List[np.ndarray]:
        """The first session's page-locked input staging (:meth:`GpuSession.pinned_inputs
        <cuvil.targets.ptx.session.GpuSession.pinned_inputs>`); with one session, ``run`` given these arrays
        copies nothing on the host."""
        return self._main.pinned_inputs(symbols)

    def synchronize(self) -> None:
        for s in self.sessions:
            s.synchronize()

    @property
    def stream(self):
        """The first session's CUstream."""
        return self._main.stream

    # -- reports -------------------------------------------------------------------------------------

    def graph_stats(self) -> dict:
        """Captured graphs, over the sessions: count, bound (per session), device bytes they took (free-memory
        delta at instantiation, 0 when the driver found room in memory it already held), captures, hits,
        misses, evictions, bucket keys."""
        per = [s.graph_stats() for s in self.sessions]
        st = {k: sum(p[k] for p in per) for k in ("graphs", "bytes", "captures", "hits", "misses", "evictions")}
        st["max_graphs"] = self.max_graphs
        st["sessions"] = len(per)
        keys = sorted({k for s in self.sessions for k in s._graphs.keys()})
        st["buckets"] = [[list(b.shape) for b in self._variants[k].in_bufs] for k in keys]
        st["kernels_per_graph"] = len(self._launches)
        return st

    def stats(self) -> dict:
        """What the model did: per bucket (``"N=8"``; ``"static"`` for a bundle without a profile) its
        kernels, graph captures, capture time (ms, total and last), graph nodes and the device memory the
        instantiation took (free-memory delta), hits, misses, evictions and whether its graph is alive (in
        any session), summed over the sessions; the graphs alive, the bound (per session) and the sessions;
        the device's graph-allocation memory in use (``graph_mem_used_bytes``) and the model's own device
        bytes; the modules loaded (all at load time: nothing compiles at run time)."""
        sessions = self.sessions
        pers = [s.per_bucket() for s in sessions]
        gst = self.graph_stats()
        buckets = {}
        for v in self._variants:
            b = {"captures": 0, "capture_ms": 0.0, "last_capture_ms": 0.0, "nodes": 0, "graph_bytes": 0,
                 "hits": 0, "misses": 0, "evictions": 0, "alive": False}
            for per in pers:
                got = per.get(v.label)
                if got is None:
                    continue
                for key in ("captures", "capture_ms", "hits", "misses", "evictions", "graph_bytes"):
                    b[key] += got[key]
                if got["captures"]:
                    b["last_capture_ms"], b["nodes"] = got["last_capture_ms"], got["nodes"]
                b["alive"] = b["alive"] or got["alive"]
            buckets[v.label] = {"point": dict(v.point), "kernels": len(v.kernels), **b}
        return {"buckets": buckets, "graphs_alive": gst["graphs"], "max_graphs": self.max_graphs,
                "sessions": len(sessions), "pinned": self.pinned,
                "graph_mem_used_bytes": self._graph_mem_used(), "device_bytes": self.device_bytes,
                "captures": gst["captures"], "hits": gst["hits"], "misses": gst["misses"],
                "evictions": gst["evictions"], "module_loads": self.module_loads,
                "profile": {n: list(b) for n, b in self._buckets.items()}, "paddable": dict(self._paddable)}

    def _graph_mem_used(self) -> Optional[int]:
        """The device's graph-allocation memory in use (``cuDeviceGetGraphMemAttribute``, USED_MEM_CURRENT):
        what graphs' own allocation nodes hold; None where the driver does not say. Cuvil's graphs have none
        (the arenas, weights and staging are the model's sessions', shared by every bucket: ``device_bytes``)."""
        drv = self._d
        try:
            attr = drv.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT
            res = drv.cuDeviceGetGraphMemAttribute(self._dev, attr)
        except Exception:  # noqa: BLE001 - older bindings or drivers: not reported
            return None
        return int(res[1]) if res[0] == drv.CUresult.CUDA_SUCCESS else None

    def profile_kernels(self, repeats: int = 10) -> List[dict]:
        """Each kernel timed with CUDA events around its launch in eager mode, on the staged inputs of the
        first session's last ``run`` (or zeros); the median over ``repeats`` runs, in plan order (the largest
        bucket's)."""
        s = self._acquire()
        try:
            launches, times = s.profile_lane(repeats)
        finally:
            self._pool.put(s)
        return [{"name": k["name"], "stage": k["stage"], "n": int(k["n"]), "grid": k["grid"][0],
                 "block": k["block"][0], "ms": float(np.median(t))} for (k, _, _, _), t in zip(launches, times)]

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for and frees every session (graphs, arenas, staging, streams), then the weights and modules;
        releases the primary context."""
        lock = getattr(self, "_lock", None)
        if lock is None or getattr(self, "_closed", True):
            return
        with lock:
            if self._closed:
                return
            drv = self._d
            drv.cuCtxSetCurrent(self._ctx)
            for s in list(getattr(self, "_sessions", ())) + list(getattr(self, "_own", ())):
                s.close()
            for p in self._allocs:
                drv.cuMemFree(p)
            self._allocs = []
            for v in getattr(self, "_variants", ()):
                if v.module is not None:
                    drv.cuModuleUnload(v.module)
                    v.module = None
            drv.cuDevicePrimaryCtxRelease(self._dev)
            self._closed = True

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        fmt = lambda ds: ", ".join(map(str, ds))  # noqa: E731
        more = f", {len(self._variants)} buckets" if self._buckets else ""
        more += f", {len(self.sessions)} sessions" if len(self.sessions) > 1 else ""
        return (f"<cuvil.GpuModel {os.path.basename(self.path)} on {self.device['name']} ({fmt(self.inputs)}) -> "
                f"({fmt(self.outputs)}), {len(self._launches)} kernels{more}>")


def load_bundle(path, *, device: int = 0, max_graphs: int = 4, mode: str = "graph",
                prefer_cubin: bool = True, files: Optional[Mapping[str, bytes]] = None, sessions: int = 1,
                pinned: bool = True, streams: int = None) -> GpuModel:
    """Load a bundle directory onto GPU ``device``. :class:`NoGpuError` where there is no CUDA driver or GPU.
    ``files``: the bundle's files as already read and verified (``{name: bytes}``, :mod:`cuvil.signing`),
    loaded instead of the directory's. ``sessions``: how many inferences may be in flight at once, from as
    many host threads (:class:`GpuModel`); ``pinned``: each session keeps page-locked input staging that
    ``pinned_inputs()`` hands out to be filled in place (a DMA, no host copy); ``streams``: the streams a
    captured graph lays the kernels over by the plan's dependencies (default
    :data:`~cuvil.targets.ptx.launch_deps.DEFAULT_STREAMS`; 1: the launch order, one stream)."""
    def digest():
        if files is not None:
            return root_digest(file_digests(files))
        names = directory_files(path, exclude=(SIGNATURE_FILE,))
        return root_digest({n: sha256_file(os.path.join(path, n)) for n in names})

    try:
        m = GpuModel(path, device=device, max_graphs=max_graphs, mode=mode, prefer_cubin=prefer_cubin, files=files,
                     sessions=sessions, pinned=pinned, streams=DEFAULT_STREAMS if streams is None else streams)
    except CuvilError as e:
        audit.record("load", artifact=path, digest=digest, outcome="error", reason=e.message)
        raise
    audit.record("load", artifact=path, digest=digest, verified=files is not None)
    return m
