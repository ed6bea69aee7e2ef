"""Running a GPU bundle (``NAME.cuvil/``) through the CUDA driver API of ``cuda-python``
(``cuda.bindings.driver``, imported only when a model is loaded).

    m = load_bundle("build/resnet50.cuvil")      # module, one arena, weights uploaded once
    (y,) = m.run(x)                              # numpy in, numpy out (H2D, one graph replay, D2H)
    m.run({"data": x})["probs"]                  # a dict in, a dict out
    m.run_device([x_ptr], [y_ptr])               # device pointers (ints): no copies

:class:`GpuModel` is the GPU side of the one model interface (:mod:`cuvil.targets.model_api`): the call
forms, the metadata and the input checks are the x86 model's. :func:`bundle_signature` reads them from the
bundle alone, without a driver, so they are checked (and tested) on machines without a GPU.

One model holds: the module (the bundle's cubin when it was built for this GPU's architecture, else its PTX,
compiled by the driver), one stream, one device arena of ``plan["arena_bytes"]``, the weights, staging
buffers for numpy inputs and outputs, and the device buffer-pointer table ``[arena, weights, inputs...,
outputs...]`` that every kernel reads. Kernels read the table at run time, so pointing the model at other
input/output buffers is one 8-byte-per-entry copy, never a re-capture.

Graphs: the first run with given input shapes captures all launches of one inference, in order, on the
stream into a CUDA graph, instantiates it and keeps it in a bounded LRU cache keyed by the input shapes (a
"shape bucket"; shapes are static today, so there is one). Later runs replay it with one ``cuGraphLaunch``.
``mode="eager"`` launches the kernels one by one instead. Every failing driver call raises
:class:`CudaError` with the call and the CUDA error name.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Hashable, List, Mapping, Optional, Sequence

import numpy as np

from ... import audit
from ...errors import CuvilError, ShapeError
from ...ir.dtype import DType
from ...supply_chain.digests import directory_files, file_digests, root_digest, sha256_file
from ..model_api import Model, Signature, SymbolProfile, fixed_symbols, tensor_spec
from .bundle import SIGNATURE_FILE, bundle_file, bundle_has, read_bundle

MODES = ("graph", "eager")


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


def driver():
    """``cuda.bindings.driver`` after a successful ``cuInit``; :class:`NoGpuError` otherwise."""
    global _DRIVER
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


# --- the graph cache -------------------------------------------------------------------------------------

class GraphCache:
    """At most ``max_graphs`` captured graphs, least recently used evicted first (``destroy`` is called on
    each evicted entry). Counts captures, hits and evictions; ``bytes`` is what the entries reported."""

    def __init__(self, max_graphs: int, destroy: Callable[[object], None]):
        if int(max_graphs) < 1:
            raise CuvilError(f"max_graphs must be at least 1, got {max_graphs}")
        self.max_graphs = int(max_graphs)
        self._destroy = destroy
        self._entries: "collections.OrderedDict[Hashable, tuple]" = collections.OrderedDict()
        self.captures = self.hits = self.evictions = 0

    def get(self, key: Hashable):
        got = self._entries.get(key)
        if got is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return got[0]

    def put(self, key: Hashable, value, nbytes: int = 0) -> None:
        if key in self._entries:
            self._destroy(self._entries.pop(key)[0])
        self._entries[key] = (value, int(nbytes))
        self.captures += 1
        while len(self._entries) > self.max_graphs:
            _, (old, _) = self._entries.popitem(last=False)
            self.evictions += 1
            self._destroy(old)

    def clear(self) -> None:
        while self._entries:
            _, (v, _) = self._entries.popitem(last=False)
            self._destroy(v)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        return list(self._entries)

    def stats(self) -> dict:
        return {"graphs": len(self._entries), "max_graphs": self.max_graphs,
                "bytes": sum(n for _, n in self._entries.values()), "captures": self.captures,
                "hits": self.hits, "evictions": self.evictions, "buckets": [_listify(k) for k in self._entries]}


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (tuple, list)) else x


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
    bundle's shapes are static: every symbol was fixed at compile time (the manifest's ``specialized``), so
    each has min = opt = max, and a dim that does not fit names the compile that would."""
    if plan is None or manifest is None:
        plan, manifest = read_bundle(path)
    fixed = fixed_symbols(manifest)
    triple = (manifest.get("target") or {}).get("triple", "") if isinstance(manifest.get("target"), dict) else ""
    return Signature(artifact=os.path.basename(os.path.abspath(path)),
                     inputs=tuple(tensor_spec(d["name"], d["dtype_code"], d["shape"]) for d in plan["inputs"]),
                     outputs=tuple(tensor_spec(d["name"], d["dtype_code"], d["shape"]) for d in plan["outputs"]),
                     symbols={k: SymbolProfile(v, v, v) for k, v in fixed.items()}, fixed=fixed, target=triple)


class GpuModel(Model):
    """A loaded GPU bundle (:class:`cuvil.targets.model_api.Model`: ``run``, ``inputs``, ``outputs``,
    ``symbols``; ``run(..., mode="eager")`` for one call), ``run_device`` for device pointers,
    ``graph_stats()``, ``profile_kernels()``. Calls are serialised by a lock; one inference is in flight at a
    time."""

    run_options = ("mode",)

    def __init__(self, path: str, *, device: int = 0, max_graphs: int = 4, mode: str = "graph",
                 prefer_cubin: bool = True, files: Optional[Mapping[str, bytes]] = None):
        if mode not in MODES:
            raise CuvilError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.path = os.path.abspath(os.fspath(path))
        self._files = files                                       # a verified load's bytes: the disk is not read
        self.plan, self.manifest = read_bundle(self.path, files)   # a bad bundle fails before the driver is touched
        self.mode = mode
        self.signature = bundle_signature(self.path, self.plan, self.manifest)
        self._in_bufs = [_Buffer(d) for d in self.plan["inputs"]]
        self._out_bufs = [_Buffer(d) for d in self.plan["outputs"]]
        self._lock = threading.RLock()
        self._closed = True
        self._allocs: List[int] = []
        self._d = drv = driver()
        dev = self._call("cuDeviceGet", drv.cuDeviceGet(device))
        self._dev = dev
        # the primary context: the one the runtime API (PyTorch, CuPy) shares, so device pointers interoperate
        self._ctx = self._call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
        self._closed = False
        self._activate()
        self.device = device_info(device)
        self._stream = self._call("cuStreamCreate", drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        self._load_module(prefer_cubin)
        kernels = self.plan["kernels"]
        self._functions = [self._call(f"cuModuleGetFunction({k['name']})",
                                      drv.cuModuleGetFunction(self._module, k["name"].encode())) for k in kernels]
        regs = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        self.registers = {k["name"]: int(self._call(f"cuFuncGetAttribute({k['name']})", drv.cuFuncGetAttribute(regs, fn)))
                          for k, fn in zip(kernels, self._functions)}

        # device memory: arena, weights, staging for numpy inputs/outputs, the pointer table
        self.arena = self._alloc(max(int(self.plan["arena_bytes"]), 1), "arena")
        self.weights = self._alloc(max(int(self.plan["weights_bytes"]), 1), "weights")
        if int(self.plan["weights_bytes"]):
            blob = np.frombuffer(bundle_file(self.path, "weights.bin", self._files), dtype=np.uint8)
            if blob.nbytes != int(self.plan["weights_bytes"]):
                raise CuvilError(f"{self.path}: weights.bin has {blob.nbytes} bytes, the plan says "
                                 f"{self.plan['weights_bytes']}")
            self._call("cuMemcpyHtoD(weights)", drv.cuMemcpyHtoD(self.weights, blob.ctypes.data, blob.nbytes))
        self._in_stage = [self._alloc(max(s.nbytes, 1), f"input {s.name}") for s in self._in_bufs]
        self._out_stage = [self._alloc(max(s.nbytes, 1), f"output {s.name}") for s in self._out_bufs]
        n_bufs = int(self.plan["buffers"]["count"])
        self._table = self._alloc(8 * n_bufs, "buffer table")
        self._table_host = np.zeros(n_bufs, dtype=np.uint64)
        self._table_set: Optional[tuple] = None
        self._staged = tuple(self._in_stage + self._out_stage)
        self.device_bytes = (max(int(self.plan["arena_bytes"]), 1) + max(int(self.plan["weights_bytes"]), 1)
                             + sum(max(s.nbytes, 1) for s in self._in_bufs + self._out_bufs) + 8 * n_bufs)

        # kernel arguments (bufs, n): a pointer array per launch, built once; the driver copies them at launch
        self._launches = []
        for k, fn in zip(kernels, self._functions):
            if int(k["n"]) <= 0:
                continue
            vals = np.array([self._table, int(k["n"])], dtype=np.uint64)
            ptrs = np.array([vals.ctypes.data, vals.ctypes.data + 8], dtype=np.uint64)
            self._launches.append((k, fn, vals, ptrs))
        self._graphs = GraphCache(max_graphs, self._destroy_graph)
        self._call("cuStreamSynchronize", drv.cuStreamSynchronize(self._stream))

    # -- driver plumbing ----------------------------------------------------------------------------

    def _call(self, what: str, res):
        return _call(self._d, what, res)

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error()

    def _activate(self):
        self._ensure_open()
        self._call("cuCtxSetCurrent", self._d.cuCtxSetCurrent(self._ctx))

    def _alloc(self, nbytes: int, what: str) -> int:
        p = int(self._call(f"cuMemAlloc({what}, {nbytes} B)", self._d.cuMemAlloc(nbytes)))
        self._allocs.append(p)
        return p

    def _load_module(self, prefer_cubin: bool):
        drv = self._d
        self.module_source = None
        cubin = (self.manifest.get("ptxas") or {}).get("cubin")
        if prefer_cubin and cubin and self.plan.get("arch") == self.device["arch"]:
            present = bundle_has(self.path, cubin, self._files)
            if present:
                image = np.frombuffer(bundle_file(self.path, cubin, self._files), dtype=np.uint8)
                res = drv.cuModuleLoadData(image.ctypes.data)
                if res[0] == drv.CUresult.CUDA_SUCCESS:
                    self._module, self.module_source = res[1], cubin
                    return
                # an older driver can refuse a newer toolkit's cubin: the PTX still loads through the JIT
        image = np.frombuffer(bundle_file(self.path, "kernels.ptx", self._files) + b"\0", dtype=np.uint8)
        self._module = self._call("cuModuleLoadData(kernels.ptx)", drv.cuModuleLoadData(image.ctypes.data))
        self.module_source = "kernels.ptx"

    def _set_table(self, ptrs: tuple, stream):
        if ptrs == self._table_set:
            return
        t = self._table_host
        t[0], t[1] = self.arena, self.weights
        t[2:] = ptrs
        # from pageable memory: the call returns once the 8-byte entries are staged, so t may change after
        self._call("cuMemcpyHtoDAsync(buffer table)",
                   self._d.cuMemcpyHtoDAsync(self._table, t.ctypes.data, t.nbytes, stream))
        self._table_set = ptrs

    def _zero(self, stream):
        """Zero the plan's ``zero`` ranges of the arena (split-K tile counters) at the start of a run, so a
        run stopped midway can never leave a count behind (the kernels also reset their own)."""
        for off, nbytes in self.plan.get("zero") or ():
            self._call("cuMemsetD32Async(counters)",
                       self._d.cuMemsetD32Async(int(self.arena) + int(off), 0, int(nbytes) // 4, stream))

    def _launch_all(self, stream, events=None):
        drv = self._d
        self._zero(stream)
        for j, (k, fn, _vals, ptrs) in enumerate(self._launches):
            if events is not None:
                self._call("cuEventRecord", drv.cuEventRecord(events[j][0], stream))
            g, b = k["grid"], k["block"]
            res = drv.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream, ptrs.ctypes.data, 0)
            if res[0] != drv.CUresult.CUDA_SUCCESS:
                raise CudaError(f"cuLaunchKernel({k['name']}, stage {k['stage']})", _error_name(drv, res[0]))
            if events is not None:
                self._call("cuEventRecord", drv.cuEventRecord(events[j][1], stream))

    def _capture(self, key, stream):
        drv = self._d
        # one eager pass first: every kernel is loaded (lazy module loading) and checked before capture
        self._launch_all(stream)
        self._call("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        free0 = self._call("cuMemGetInfo", drv.cuMemGetInfo())[0]
        self._call("cuStreamBeginCapture",
                   drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            self._launch_all(stream)
        except BaseException:
            res = drv.cuStreamEndCapture(stream)
            if res[0] == drv.CUresult.CUDA_SUCCESS and res[1] is not None:
                drv.cuGraphDestroy(res[1])
            raise
        graph = self._call("cuStreamEndCapture", drv.cuStreamEndCapture(stream))
        try:
            got = self._call("cuGraphGetNodes", drv.cuGraphGetNodes(graph))   # (nodes, count) or nodes
            n_nodes = int(got[-1]) if isinstance(got, tuple) else len(got or ())
            want = len(self._launches) + len(self.plan.get("zero") or ())
            if n_nodes != want:
                raise CuvilError(f"captured graph has {n_nodes} nodes, expected {want} (kernel launches and memsets)")
            exe = self._call("cuGraphInstantiate", drv.cuGraphInstantiate(graph, 0))
        except BaseException:
            drv.cuGraphDestroy(graph)
            raise
        free1 = self._call("cuMemGetInfo", drv.cuMemGetInfo())[0]
        entry = (graph, exe)
        self._graphs.put(key, entry, max(int(free0) - int(free1), 0))
        return entry

    def _destroy_graph(self, entry):
        graph, exe = entry
        self._d.cuGraphExecDestroy(exe)
        self._d.cuGraphDestroy(graph)

    def _execute(self, key, stream, mode: Optional[str]):
        mode = mode or self.mode
        if mode not in MODES:
            raise CuvilError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "eager":
            self._launch_all(stream)
            return
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, stream)
        self._call("cuGraphLaunch", self._d.cuGraphLaunch(entry[1], stream))

    # -- running ------------------------------------------------------------------------------------

    def _run_arrays(self, xs: List[np.ndarray], mode: Optional[str] = None) -> List[np.ndarray]:
        """One inference on checked inputs (``Model.run``): H2D, the captured graph's replay (or, with
        ``mode="eager"``, the kernels one by one), D2H."""
        xs = [np.ascontiguousarray(a) for a in xs]
        drv = self._d
        with self._lock:
            self._activate()
            s = self._stream
            for a, p, buf in zip(xs, self._in_stage, self._in_bufs):
                if a.nbytes:
                    self._call(f"cuMemcpyHtoDAsync(input {buf.name})",
                               drv.cuMemcpyHtoDAsync(p, a.ctypes.data, a.nbytes, s))
            self._set_table(self._staged, s)
            self._execute(tuple(a.shape for a in xs), s, mode)
            outs = []
            for p, buf in zip(self._out_stage, self._out_bufs):
                y = np.empty(buf.shape, dtype=buf.dtype)
                if y.nbytes:
                    self._call(f"cuMemcpyDtoHAsync(output {buf.name})",
                               drv.cuMemcpyDtoHAsync(y.ctypes.data, p, y.nbytes, s))
                outs.append(y)
            self._call("cuStreamSynchronize", drv.cuStreamSynchronize(s))
        return outs

    def run_device(self, in_ptrs: Sequence[int], out_ptrs: Sequence[int], *, stream=None, sync: bool = True,
                   mode: Optional[str] = None) -> None:
        """One inference on device memory the caller owns: ``in_ptrs``/``out_ptrs`` are device pointers (ints)
        to contiguous tensors of the plan's shapes and dtypes, in this model's context (the device's primary
        context). Runs on ``stream`` (a CUstream or its int handle; default: the model's stream) after the
        work already queued there; ``sync=False`` returns without waiting."""
        if len(in_ptrs) != len(self._in_bufs) or len(out_ptrs) != len(self._out_bufs):
            raise ShapeError(f"{os.path.basename(self.path)}: run_device takes {len(self._in_bufs)} input and "
                             f"{len(self._out_bufs)} output pointers, got {len(in_ptrs)} and {len(out_ptrs)}")
        ptrs = tuple(int(p) for p in list(in_ptrs) + list(out_ptrs))
        if any(p == 0 for p, buf in zip(ptrs, self._in_bufs + self._out_bufs) if buf.nbytes):
            raise ShapeError(f"{os.path.basename(self.path)}: run_device got a null device pointer")
        with self._lock:
            self._activate()
            s = self._stream if stream is None else (stream if not isinstance(stream, int) else self._d.CUstream(stream))
            self._set_table(ptrs, s)
            self._execute(tuple(buf.shape for buf in self._in_bufs), s, mode)
            if sync:
                self._call("cuStreamSynchronize", self._d.cuStreamSynchronize(s))

    def synchronize(self) -> None:
        with self._lock:
            self._activate()
            self._call("cuStreamSynchronize", self._d.cuStreamSynchronize(self._stream))

    @property
    def stream(self):
        """The model's CUstream."""
        return self._stream

    # -- reports -------------------------------------------------------------------------------------

    def graph_stats(self) -> dict:
        """Captured graphs: count, bound, device bytes they took (free-memory delta at instantiation, 0 when
        the driver found room in memory it already held), captures, hits, evictions, bucket keys."""
        with self._lock:
            st = self._graphs.stats()
        st["kernels_per_graph"] = len(self._launches)
        return st

    def profile_kernels(self, repeats: int = 10) -> List[dict]:
        """Each kernel timed with CUDA events around its launch in eager mode, on the staged inputs of the
        last ``run`` (or zeros); the median over ``repeats`` runs, in plan order."""
        drv = self._d
        with self._lock:
            self._activate()
            s = self._stream
            self._set_table(self._staged, s)
            flags = drv.CUevent_flags.CU_EVENT_DEFAULT.value
            events = [(self._call("cuEventCreate", drv.cuEventCreate(flags)),
                       self._call("cuEventCreate", drv.cuEventCreate(flags))) for _ in self._launches]
            try:
                times = [[] for _ in self._launches]
                for _ in range(max(1, repeats)):
                    self._launch_all(s, events)
                    self._call("cuStreamSynchronize", drv.cuStreamSynchronize(s))
                    for j, (a, b) in enumerate(events):
                        times[j].append(float(self._call("cuEventElapsedTime", drv.cuEventElapsedTime(a, b))))
            finally:
                for a, b in events:
                    drv.cuEventDestroy(a)
                    drv.cuEventDestroy(b)
        return [{"name": k["name"], "stage": k["stage"], "n": int(k["n"]), "grid": k["grid"][0],
                 "block": k["block"][0], "ms": float(np.median(t))} for (k, _, _, _), t in zip(self._launches, times)]

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Frees the graphs, device memory, stream and module; releases the primary context."""
        lock = getattr(self, "_lock", None)
        if lock is None or getattr(self, "_closed", True):
            return
        with lock:
            if self._closed:
                return
            drv = self._d
            drv.cuCtxSetCurrent(self._ctx)
            if getattr(self, "_stream", None) is not None:
                drv.cuStreamSynchronize(self._stream)
            if getattr(self, "_graphs", None) is not None:
                self._graphs.clear()
            for p in self._allocs:
                drv.cuMemFree(p)
            self._allocs = []
            if getattr(self, "_module", None) is not None:
                drv.cuModuleUnload(self._module)
            if getattr(self, "_stream", None) is not None:
                drv.cuStreamDestroy(self._stream)
            drv.cuDevicePrimaryCtxRelease(self._dev)
            self._closed = True

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        fmt = lambda ds: ", ".join(map(str, ds))  # noqa: E731
        return (f"<cuvil.GpuModel {os.path.basename(self.path)} on {self.device['name']} ({fmt(self.inputs)}) -> "
                f"({fmt(self.outputs)}), {len(self._launches)} kernels>")


def load_bundle(path, *, device: int = 0, max_graphs: int = 4, mode: str = "graph",
                prefer_cubin: bool = True, files: Optional[Mapping[str, bytes]] = None) -> GpuModel:
    """Load a bundle directory onto GPU ``device``. :class:`NoGpuError` where there is no CUDA driver or GPU.
    ``files``: the bundle's files as already read and verified (``{name: bytes}``, :mod:`cuvil.signing`),
    loaded instead of the directory's."""
    def digest():
        if files is not None:
            return root_digest(file_digests(files))
        names = directory_files(path, exclude=(SIGNATURE_FILE,))
        return root_digest({n: sha256_file(os.path.join(path, n)) for n in names})

    try:
        m = GpuModel(path, device=device, max_graphs=max_graphs, mode=mode, prefer_cubin=prefer_cubin, files=files)
    except CuvilError as e:
        audit.record("load", artifact=path, digest=digest, outcome="error", reason=e.message)
        raise
    audit.record("load", artifact=path, digest=digest, verified=files is not None)
    return m
