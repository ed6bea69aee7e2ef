"""A session of a loaded GPU bundle (issue 22, part 4): what one inference in flight needs for itself, so that
several run at once, each on its own stream, from several host threads.

    m = cuvil.load("build/resnet50.cuvil", sessions=4)   # run() from 4 threads: 4 inferences in flight
    s = m.session()                                       # or a session of one's own (one per thread)
    (y,) = s.run(x)                                       # numpy in/out
    (xin,) = s.pinned_inputs(); xin[...] = x; s.run(xin)   # page-locked input: DMA, no host copy
    s.run_device([x_ptr], [y_ptr], stream=my_stream, sync=False)

What a :class:`~cuvil.targets.ptx.runtime.GpuModel` shares between its sessions: the modules (every bucket's
kernels, loaded once) and the weights (uploaded once, read-only). What each session has of its own: a
non-blocking stream, an arena (every intermediate tensor, split-K partials and tile counters included: the
kernels write nowhere else), device staging for numpy inputs and outputs, page-locked host staging for the
inputs (``cuMemHostAlloc``; :meth:`GpuSession.pinned_inputs` hands it out to be filled in place, so that the
copy to the device is one DMA and no host copy; ``pinned=False``: none), per bucket a buffer-pointer table
and the launch arguments that name it, a bounded graph cache (graphs name their session's table, so they are
never shared), and a lock: calls on one session are serialised, calls on different sessions run concurrently.

Ordering: a numpy call ends with a synchronisation of the session's stream. ``run_device(..., sync=False)``
records an event on the stream it ran on; the session's next call, on any other stream, first makes that stream
wait for it (``cuStreamWaitEvent``), so a session's arena and table are never in use by two calls at once.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...errors import CuvilError, ShapeError
from ..model_api import Model
from . import buckets as bk
from .graph_cache import GraphCache
from .launch_deps import launch_layout

MODES = ("graph", "eager")


def _same(a, b) -> bool:
    """Whether two stream handles name one stream (cuda-python's handles compare by value)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a handle type without equality
        return a is b


class _Lane:
    """A session's state for one bucket: its buffer-pointer table on the device, the host copy, the pointers
    the device copy holds now, and the launch arguments ``(table, n)`` of each kernel."""

    __slots__ = ("variant", "table", "table_host", "table_set", "launches", "layout")

    def __init__(self, variant, table: int, streams: int = 1):
        self.variant, self.table = variant, table
        self.table_host = np.zeros(int(variant.plan["buffers"]["count"]), dtype=np.uint64)
        self.table_set: Optional[tuple] = None
        self.launches: list = []
        # kernel arguments (bufs, n): a pointer array per launch, built once; the driver copies them at launch
        for k, fn in variant.kernels:
            vals = np.array([table, int(k["n"])], dtype=np.uint64)
            ptrs = np.array([vals.ctypes.data, vals.ctypes.data + 8], dtype=np.uint64)
            self.launches.append((k, fn, vals, ptrs))
        # (stream, waits, waited) per launch for graph capture over several streams (launch_deps.launch_layout)
        self.layout = launch_layout(variant.plan["kernels"], [k for k, _ in variant.kernels], streams)


class GpuSession(Model):
    """One inference in flight of a :class:`~cuvil.targets.ptx.runtime.GpuModel` (see the module docstring):
    ``run`` (the one model interface), ``run_device``, ``pinned_inputs``, ``stream``, ``synchronize``,
    ``capture``, ``stats``, ``close``. Made by the model (``sessions=N`` at load for its pool,
    ``model.session()`` for one's own); closed with it."""

    run_options = ("mode",)

    def __init__(self, model, index: int, pinned: bool):
        self.model, self.index, self.pinned = model, index, bool(pinned)
        self.signature, self.path = model.signature, model.path
        self._d = model._d
        self._lock = threading.RLock()
        self._allocs: List[int] = []
        self._host: List[int] = []
        self._stream = self._graphs = self._done = None
        self._unsynced = None           # the stream of a run_device(sync=False) not yet waited for
        self._aux, self._events = [], []
        self._closed = False
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- setup ---------------------------------------------------------------------------------------

    def _setup(self) -> None:
        m, drv = self.model, self._d
        m._activate()
        self._stream = m._call("cuStreamCreate", drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        flags = getattr(drv.CUevent_flags, "CU_EVENT_DISABLE_TIMING", drv.CUevent_flags.CU_EVENT_DEFAULT).value
        self._done = m._call("cuEventCreate", drv.cuEventCreate(flags))
        self.arena = m._alloc_to(self._allocs, max(m.arena_bytes, 1), "arena")
        self._in_stage = [m._alloc_to(self._allocs, max(n, 1), f"input {d['name']}")
                          for n, d in zip(m._in_bytes, m.plan["inputs"])]
        self._out_stage = [m._alloc_to(self._allocs, max(n, 1), f"output {d['name']}")
                           for n, d in zip(m._out_bytes, m.plan["outputs"])]
        self._staged = tuple(self._in_stage + self._out_stage)
        self._in_host: Optional[List[int]] = None
        if self.pinned:
            self._in_host = [self._host_alloc(max(n, 1), f"input {d['name']}")
                             for n, d in zip(m._in_bytes, m.plan["inputs"])]
        self._lanes = [_Lane(v, m._alloc_to(self._allocs, 8 * int(v.plan["buffers"]["count"]), "buffer table"),
                             m.streams) for v in m._variants]
        # (graph capture over several streams, GpuModel's streams: self._aux the extra streams, self._events one
        # event per launch another stream waits for, then the fork and join events; made before the first such
        # capture by _branch_resources)
        self.device_bytes = (max(m.arena_bytes, 1) + sum(max(n, 1) for n in m._in_bytes + m._out_bytes)
                             + sum(8 * len(ln.table_host) for ln in self._lanes))
        self.host_bytes = sum(max(n, 1) for n in m._in_bytes) if self.pinned else 0
        self._graphs = GraphCache(m.max_graphs, self._destroy_graph)

    def _host_alloc(self, nbytes: int, what: str) -> int:
        m, drv = self.model, self._d
        p = int(m._call(f"cuMemHostAlloc({what}, {nbytes} B)", drv.cuMemHostAlloc(nbytes, 0)))
        self._host.append(p)
        return p

    # -- plumbing ------------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error()
        self.model._ensure_open()

    def _activate(self) -> None:
        self._ensure_open()
        self.model._activate()

    def _call(self, what: str, res):
        return self.model._call(what, res)

    def _stream_of(self, stream):
        if stream is None:
            return self._stream
        return self._d.CUstream(stream) if isinstance(stream, int) else stream

    def _order(self, stream) -> None:
        """Make ``stream`` wait for this session's last unsynchronised call where that ran on another stream."""
        if self._unsynced is not None and not _same(stream, self._unsynced):
            self._call("cuStreamWaitEvent", self._d.cuStreamWaitEvent(stream, self._done, 0))
            self._unsynced = None

    def _set_table(self, lane: _Lane, ptrs: tuple, stream) -> None:
        if ptrs == lane.table_set:
            return
        t = lane.table_host
        t[0], t[1] = self.arena, lane.variant.weights
        t[2:] = ptrs
        # from pageable memory: the call returns once the 8-byte entries are staged, so t may change after
        self._call("cuMemcpyHtoDAsync(buffer table)",
                   self._d.cuMemcpyHtoDAsync(lane.table, t.ctypes.data, t.nbytes, stream))
        lane.table_set = ptrs

    def _zero(self, lane: _Lane, stream) -> None:
        """Zero the plan's ``zero`` ranges of the arena (split-K tile counters) at the start of a run, so a
        run stopped midway can never leave a count behind (the kernels also reset their own)."""
        for off, nbytes in lane.variant.plan.get("zero") or ():
            self._call("cuMemsetD32Async(counters)",
                       self._d.cuMemsetD32Async(int(self.arena) + int(off), 0, int(nbytes) // 4, stream))

    def _launch(self, k: dict, fn, ptrs, stream) -> None:
        """One kernel of the plan on ``stream`` (a failure, or an injected fault, raised naming it)."""
        drv = self._d
        g, b = k["grid"], k["block"]
        res = drv.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], 0, stream, ptrs.ctypes.data, 0)
        if res[0] != drv.CUresult.CUDA_SUCCESS or self.model._faults_armed():
            self._call(f"cuLaunchKernel({k['name']}, stage {k['stage']})", res)

    def _launch_all(self, lane: _Lane, stream, events=None) -> None:
        drv = self._d
        self._zero(lane, stream)
        for j, (k, fn, _vals, ptrs) in enumerate(lane.launches):
            if events is not None:
                self._call("cuEventRecord", drv.cuEventRecord(events[j][0], stream))
            self._launch(k, fn, ptrs, stream)
            if events is not None:
                self._call("cuEventRecord", drv.cuEventRecord(events[j][1], stream))

    def _branch_resources(self, lane: _Lane) -> None:
        """The extra streams and events the lane's capture over several streams needs, made before the capture
        begins (kept by the session for its later captures)."""
        drv = self._d
        where, _waits, waited = lane.layout
        flags = getattr(drv.CUevent_flags, "CU_EVENT_DISABLE_TIMING", drv.CUevent_flags.CU_EVENT_DEFAULT).value
        while len(self._aux) < max(where, default=0):
            self._aux.append(self._call("cuStreamCreate",
                                        drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value)))
        while len(self._events) < len(waited) + 2:
            self._events.append(self._call("cuEventCreate", drv.cuEventCreate(flags)))

    def _launch_branches(self, lane: _Lane, stream) -> None:
        """Capture-time launches over several streams (the plan's dependencies, :mod:`~cuvil.targets.ptx.launch_deps`):
        each launch on its stream after the events of its dependencies on other streams; the extra streams fork
        from ``stream`` after the run's memsets and join it at the end, so the captured graph's edges are exactly
        the dependencies (and each stream's order) and its replay runs independent kernels at once."""
        drv = self._d
        where, waits, waited = lane.layout
        event = {j: self._events[k] for k, j in enumerate(waited)}     # (made by _branch_resources)
        fork, join = self._events[len(waited)], self._events[len(waited) + 1]
        streams = [stream] + self._aux[:max(where, default=0)]
        self._zero(lane, stream)
        self._call("cuEventRecord", drv.cuEventRecord(fork, stream))
        for s in streams[1:]:
            self._call("cuStreamWaitEvent", drv.cuStreamWaitEvent(s, fork, 0))
        for j, (k, fn, _vals, ptrs) in enumerate(lane.launches):
            s = streams[where[j]]
            for d in waits[j]:
                self._call("cuStreamWaitEvent", drv.cuStreamWaitEvent(s, event[d], 0))
            self._launch(k, fn, ptrs, s)
            if j in event:
                self._call("cuEventRecord", drv.cuEventRecord(event[j], s))
        for s in streams[1:]:
            self._call("cuEventRecord", drv.cuEventRecord(join, s))
            self._call("cuStreamWaitEvent", drv.cuStreamWaitEvent(stream, join, 0))

    def _capture(self, lane: _Lane, stream):
        drv = self._d
        v = lane.variant
        t0 = time.perf_counter()
        # one eager pass first: every kernel is loaded (lazy module loading) and checked before capture
        self._launch_all(lane, stream)
        self._call("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        free0 = self._call("cuMemGetInfo", drv.cuMemGetInfo())[0]
        if lane.layout is not None:
            self._branch_resources(lane)
        self._call("cuStreamBeginCapture",
                   drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            if lane.layout is not None:
                self._launch_branches(lane, stream)
            else:
                self._launch_all(lane, stream)
        except BaseException:
            res = drv.cuStreamEndCapture(stream)
            if res[0] == drv.CUresult.CUDA_SUCCESS and res[1] is not None:
                drv.cuGraphDestroy(res[1])
            raise
        graph = self._call("cuStreamEndCapture", drv.cuStreamEndCapture(stream))
        try:
            got = self._call("cuGraphGetNodes", drv.cuGraphGetNodes(graph))   # (nodes, count) or nodes
            n_nodes = int(got[-1]) if isinstance(got, tuple) else len(got or ())
            want = len(lane.launches) + len(v.plan.get("zero") or ())
            if n_nodes != want:
                raise CuvilError(f"captured graph has {n_nodes} nodes, expected {want} (kernel launches and memsets)")
            exe = self._call("cuGraphInstantiate", drv.cuGraphInstantiate(graph, 0))
        except BaseException:
            drv.cuGraphDestroy(graph)
            raise
        free1 = self._call("cuMemGetInfo", drv.cuMemGetInfo())[0]
        entry = (graph, exe)
        self._graphs.put(v.index, entry, max(int(free0) - int(free1), 0), seconds=time.perf_counter() - t0,
                         nodes=n_nodes)
        return entry

    def _destroy_graph(self, entry) -> None:
        graph, exe = entry
        self._d.cuGraphExecDestroy(exe)
        self._d.cuGraphDestroy(graph)

    def _execute(self, lane: _Lane, stream, mode: Optional[str]) -> None:
        mode = mode or self.model.mode
        if mode not in MODES:
            raise CuvilError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "eager":
            self._launch_all(lane, stream)
            return
        # Pointers never change a graph: the kernels read them from the lane's table at run time (one small
        # copy, _set_table), so a graph is captured once per bucket and session and never updated.
        entry = self._graphs.get(lane.variant.index)
        if entry is None:
            entry = self._capture(lane, stream)
        self._call("cuGraphLaunch", self._d.cuGraphLaunch(entry[1], stream))

    # -- running -------------------------------------------------------------------------------------

    def _run_arrays(self, xs: List[np.ndarray], mode: Optional[str] = None) -> List[np.ndarray]:
        """One inference on checked inputs: H2D from the caller's arrays (page-locked where they are the
        session's staging, :meth:`pinned_inputs`; else the driver stages pageable memory itself, which measured
        faster than a host copy into the staging first), the bucket's graph replay (or its kernels one by one),
        D2H into new arrays. A call between buckets runs the next bucket up on its rows plus zero rows and
        returns its own rows."""
        xs = [np.ascontiguousarray(a) for a in xs]
        drv = self._d
        v, bindings = self.model._variant_for(xs)
        lane = self._lanes[v.index]
        with self._lock:
            self._activate()
            s = self._stream
            self._order(s)
            for a, p, buf in zip(xs, self._in_stage, v.in_bufs):
                if a.nbytes:        # DMA straight from page-locked memory when a is the staging (pinned_inputs)
                    self._call(f"cuMemcpyHtoDAsync(input {buf.name})",
                               drv.cuMemcpyHtoDAsync(p, a.ctypes.data, a.nbytes, s))
                if a.nbytes < buf.nbytes:      # padding rows: zeros, computed and dropped
                    self._call(f"cuMemsetD8Async(input {buf.name} padding)",
                               drv.cuMemsetD8Async(p + a.nbytes, 0, buf.nbytes - a.nbytes, s))
            self._set_table(lane, self._staged, s)
            self._execute(lane, s, mode)
            outs = []
            for p, buf, dims in zip(self._out_stage, v.out_bufs, self.model._out_dims):
                shape = tuple(bindings.get(d, n) if isinstance(d, str) else n for d, n in zip(dims, buf.shape))
                y = np.empty(shape, dtype=buf.dtype)
                if y.nbytes:
                    self._call(f"cuMemcpyDtoHAsync(output {buf.name})", drv.cuMemcpyDtoHAsync(y.ctypes.data, p, y.nbytes, s))
                outs.append(y)
            self._call("cuStreamSynchronize", drv.cuStreamSynchronize(s))
        return outs

    def run_device(self, in_ptrs: Sequence[int], out_ptrs: Sequence[int], *, stream=None, sync: bool = True,
                   mode: Optional[str] = None, symbols: Optional[Dict[str, int]] = None) -> None:
        """:meth:`GpuModel.run_device <cuvil.targets.ptx.runtime.GpuModel.run_device>` on this session."""
        v = self.model._device_variant(in_ptrs, out_ptrs, symbols)
        lane = self._lanes[v.index]
        ptrs = tuple(int(p) for p in list(in_ptrs) + list(out_ptrs))
        with self._lock:
            self._activate()
            s = self._stream_of(stream)
            self._order(s)
            self._set_table(lane, ptrs, s)
            self._execute(lane, s, mode)
            if sync:
                self._call("cuStreamSynchronize", self._d.cuStreamSynchronize(s))
            else:
                self._call("cuEventRecord", self._d.cuEventRecord(self._done, s))
                self._unsynced = s

    def pinned_inputs(self, symbols: Optional[Dict[str, int]] = None) -> List[np.ndarray]:
        """The session's page-locked input staging as numpy arrays of the shapes of the bucket of ``symbols``
        (default: the largest), to fill in place: ``run`` given these very arrays copies nothing on the host.
        They are overwritten by the next ``run`` of this session with other arrays."""
        if self._in_host is None:
            raise CuvilError(f"{self.signature.artifact}: this session has no page-locked staging (loaded with "
                             f"pinned=False)", hint="load the bundle with pinned=True (the default)")
        v = self.model._variants[-1]
        if symbols is not None and self.model._buckets:
            v = self.model._by_point[bk.point_key(bk.choose_point(self.model._buckets, {}, symbols,
                                                                  self.signature.artifact))]
        out = []
        for h, buf in zip(self._in_host, v.in_bufs):
            raw = (ctypes.c_uint8 * max(buf.nbytes, 1)).from_address(h)
            out.append(np.frombuffer(raw, dtype=np.uint8)[:buf.nbytes].view(buf.dtype).reshape(buf.shape))
        return out

    def capture(self, variants) -> List[str]:
        with self._lock:
            self._activate()
            self._order(self._stream)
            done = []
            for v in variants:
                if v.index not in self._graphs.keys():
                    lane = self._lanes[v.index]
                    self._set_table(lane, self._staged, self._stream)
                    self._capture(lane, self._stream)
                done.append(v.label)
            self._call("cuStreamSynchronize", self._d.cuStreamSynchronize(self._stream))
        return done

    def synchronize(self) -> None:
        with self._lock:
            self._activate()
            self._call("cuStreamSynchronize", self._d.cuStreamSynchronize(self._stream))
            if self._unsynced is not None:
                self._call("cuEventSynchronize", self._d.cuEventSynchronize(self._done))
                self._unsynced = None

    @property
    def stream(self):
        """The session's CUstream."""
        return self._stream

    def graph_stats(self) -> dict:
        with self._lock:
            return self._graphs.stats()

    def per_bucket(self) -> Dict[str, dict]:
        with self._lock:
            return self._graphs.per_bucket(lambda k: self.model._variants[k].label)

    def stats(self) -> dict:
        """This session's graph cache: graphs alive, captures, hits, misses, evictions, per bucket."""
        st = self.graph_stats()
        return {"session": self.index, "graphs_alive": st["graphs"], "max_graphs": st["max_graphs"],
                "captures": st["captures"], "hits": st["hits"], "misses": st["misses"],
                "evictions": st["evictions"], "buckets": self.per_bucket(), "pinned": self.pinned}

    def profile_lane(self, repeats: int) -> Tuple[list, list]:
        """(launches, per-launch times in ms) of the largest bucket, CUDA events around each kernel."""
        drv = self._d
        lane = self._lanes[-1]
        with self._lock:
            self._activate()
            s = self._stream
            self._order(s)
            self._set_table(lane, self._staged, s)
            flags = drv.CUevent_flags.CU_EVENT_DEFAULT.value
            events = [(self._call("cuEventCreate", drv.cuEventCreate(flags)),
                       self._call("cuEventCreate", drv.cuEventCreate(flags))) for _ in lane.launches]
            try:
                times = [[] for _ in lane.launches]
                for _ in range(max(1, repeats)):
                    self._launch_all(lane, s, events)
                    self._call("cuStreamSynchronize", drv.cuStreamSynchronize(s))
                    for j, (a, b) in enumerate(events):
                        times[j].append(float(self._call("cuEventElapsedTime", drv.cuEventElapsedTime(a, b))))
            finally:
                for a, b in events:
                    drv.cuEventDestroy(a)
                    drv.cuEventDestroy(b)
        return lane.launches, times

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the session's work, frees its graphs, memory, event and stream (the model's modules and
        weights stay until the model is closed)."""
        lock = getattr(self, "_lock", None)
        if lock is None or getattr(self, "_closed", True):
            return
        with lock:
            if self._closed:
                return
            drv = self._d
            drv.cuCtxSetCurrent(self.model._ctx)
            if self._stream is not None:
                drv.cuStreamSynchronize(self._stream)
            if self._unsynced is not None and self._done is not None:
                drv.cuEventSynchronize(self._done)
            if self._graphs is not None:
                self._graphs.clear()
            for p in self._allocs:
                drv.cuMemFree(p)
            self._allocs = []
            for p in self._host:
                drv.cuMemFreeHost(p)
            self._host = []
            if self._done is not None:
                drv.cuEventDestroy(self._done)
            for e in self._events:
                drv.cuEventDestroy(e)
            for st in self._aux:
                drv.cuStreamDestroy(st)
            self._events, self._aux = [], []
            if self._stream is not None:
                drv.cuStreamDestroy(self._stream)
            self._closed = True

    def __repr__(self) -> str:
        return f"<cuvil.GpuSession {self.index} of {self.signature.artifact}>"


__all__ = ["GpuSession", "MODES"]
