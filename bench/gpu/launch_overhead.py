"""Launch overhead through cuda-python: 1,024 launches of a tiny kernel issued one by one on a stream
against one replay of a CUDA graph holding the same 1,024 launches.

    python3 bench/gpu/launch_overhead.py [--launches 1024] [--repeats 30] [--json out.json]

The kernel (hand-written PTX, one thread) increments a counter in device memory, so the final count
proves every launch ran, in both modes. Times per repeat: host wall time from the first call to the end
of cuStreamSynchronize, and GPU time between two events recorded on the stream around the work; the
median (and p90) over the repeats. The stream mode also reports how long issuing the launches took on the
host (before synchronising). Uses the same driver wrapper as Cuvil's runtime.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))

from cuvil.targets.ptx.runtime import _call, device_info, driver  # noqa: E402

PTX = """
.version 7.8
.target {arch}
.address_size 64

.visible .entry tick(.param .u64 counter)
{{
    .reg .b64 %rd<3>;
    .reg .b32 %r<3>;
    ld.param.u64 %rd1, [counter];
    cvta.to.global.u64 %rd2, %rd1;
    ld.global.u32 %r1, [%rd2];
    add.s32 %r2, %r1, 1;
    st.global.u32 [%rd2], %r2;
    ret;
}}
"""


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    drv = driver()
    info = device_info(0)
    dev = _call(drv, "cuDeviceGet", drv.cuDeviceGet(0))
    ctx = _call(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
    image = np.frombuffer(PTX.format(arch=info["arch"]).encode() + b"\0", dtype=np.uint8)
    mod = _call(drv, "cuModuleLoadData", drv.cuModuleLoadData(image.ctypes.data))
    fn = _call(drv, "cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"tick"))
    stream = _call(drv, "cuStreamCreate", drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    counter = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(4)))
    _call(drv, "cuMemsetD32", drv.cuMemsetD32(counter, 0, 1))
    vals = np.array([counter], dtype=np.uint64)
    params = np.array([vals.ctypes.data], dtype=np.uint64)
    ev0 = _call(drv, "cuEventCreate", drv.cuEventCreate(0))
    ev1 = _call(drv, "cuEventCreate", drv.cuEventCreate(0))
    n = args.launches

    def launch_all():
        for _ in range(n):
            r = drv.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params.ctypes.data, 0)
            if r[0] != drv.CUresult.CUDA_SUCCESS:
                _call(drv, "cuLaunchKernel", r)

    def count():
        out = np.zeros(1, dtype=np.uint32)
        _call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(out.ctypes.data, counter, 4))
        return int(out[0])

    # the graph: the same launches captured once
    t = time.perf_counter()
    _call(drv, "cuStreamBeginCapture",
          drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    launch_all()
    graph = _call(drv, "cuStreamEndCapture", drv.cuStreamEndCapture(stream))
    t_capture = time.perf_counter() - t
    t = time.perf_counter()
    exe = _call(drv, "cuGraphInstantiate", drv.cuGraphInstantiate(graph, 0))
    t_inst = time.perf_counter() - t

    res = {"stream": {"wall": [], "issue": [], "gpu": []}, "graph": {"wall": [], "issue": [], "gpu": []}}
    expected = 0
    for rep in range(args.repeats + 2):   # two warm-up repeats, not recorded
        for mode in ("stream", "graph"):
            _call(drv, "cuStreamSynchronize", drv.cuStreamSynchronize(stream))
            t0 = time.perf_counter()
            _call(drv, "cuEventRecord", drv.cuEventRecord(ev0, stream))
            if mode == "stream":
                launch_all()
            else:
                _call(drv, "cuGraphLaunch", drv.cuGraphLaunch(exe, stream))
            _call(drv, "cuEventRecord", drv.cuEventRecord(ev1, stream))
            t1 = time.perf_counter()
            _call(drv, "cuStreamSynchronize", drv.cuStreamSynchronize(stream))
            t2 = time.perf_counter()
            expected += n
            if rep >= 2:
                res[mode]["wall"].append(1e6 * (t2 - t0))
                res[mode]["issue"].append(1e6 * (t1 - t0))
                res[mode]["gpu"].append(1e3 * float(_call(drv, "cuEventElapsedTime", drv.cuEventElapsedTime(ev0, ev1))))
    got = count()
    ok = got == expected
    summary = {m: {f"{k}_us_p50": statistics.median(v) for k, v in d.items()} for m, d in res.items()}
    for m, d in res.items():
        summary[m].update({f"{k}_us_p90": pct(v, 90) for k, v in d.items()})
    out = {"device": info, "launches": n, "repeats": args.repeats, "counter_ok": ok, "counter": got,
           "expected": expected, "capture_ms": 1e3 * t_capture, "instantiate_ms": 1e3 * t_inst, "summary": summary}
    print(f"device: {info['name']} ({info['arch']}, driver CUDA {info['driver_cuda_version']})")
    print(f"{n} launches of a 1-thread kernel, median (p90) over {args.repeats} repeats; counter "
          f"{'ok' if ok else 'WRONG'} ({got} of {expected})")
    print(f"{'mode':8} {'host wall us':>18} {'per launch us':>14} {'GPU (events) us':>18} {'issue us':>16}")
    for m in ("stream", "graph"):
        s = summary[m]
        print(f"{m:8} {s['wall_us_p50']:10.1f} ({s['wall_us_p90']:6.1f}) {s['wall_us_p50'] / n:14.3f} "
              f"{s['gpu_us_p50']:10.1f} ({s['gpu_us_p90']:6.1f}) {s['issue_us_p50']:9.1f} ({s['issue_us_p90']:5.1f})")
    print(f"graph: capture {out['capture_ms']:.2f} ms, instantiate {out['instantiate_ms']:.2f} ms (once); "
          f"replay is {summary['stream']['wall_us_p50'] / summary['graph']['wall_us_p50']:.1f}x faster than the stream (host wall)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    drv.cuGraphExecDestroy(exe)
    drv.cuGraphDestroy(graph)
    drv.cuMemFree(counter)
    drv.cuModuleUnload(mod)
    drv.cuStreamDestroy(stream)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
