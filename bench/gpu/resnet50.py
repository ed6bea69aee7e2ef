"""ResNet-50, batch 1, float32 on one GPU: Cuvil (eager launches and CUDA-graph replay) beside PyTorch
(eager, a captured CUDA graph, ``torch.compile(mode="reduce-overhead")``), then where Cuvil's time goes.

    python3 bench/gpu/resnet50.py [--iters 200] [--no-compile] [--fp16] [--json out.json]

``--fp16``: also float16, Cuvil ``--enable-fp16`` on the light model with BatchNormalization scales in
(0.25, 0.75) (the default seeded weights overflow half) beside its float32 build, and PyTorch ``.half()``.

Cuvil runs onnx's light ResNet-50 (seeded random weights) compiled to a bundle; inputs and outputs stay on
the device (``run_device``), so a timed run is the launches plus ``cuStreamSynchronize``. PyTorch runs
torchvision's resnet50 (random weights, eval mode, ``inference_mode``), the same architecture, timed the
same way (call + ``torch.cuda.synchronize``). Every time is host wall clock per inference, p50 and p99 over
``--iters`` runs after warm-up. PyTorch is measured in strict float32 (TF32 off for convolutions and
matmuls, as Cuvil computes) and, for eager and graph, also with its defaults (cuDNN convolutions in TF32).

Then: Cuvil's output against onnxruntime's (CPU), each kernel timed with CUDA events in eager mode (top
10, with registers and occupancy), and the driver's occupancy for each kernel beside the formula's.
PyTorch is imported by this script only; Cuvil never imports it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)

from occupancy import occupancy  # noqa: E402

RESULTS: dict = {}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def timed(fn, iters: int, warmup: int = 5) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    return {"p50_ms": statistics.median(ts), "p90_ms": pct(ts, 90), "p99_ms": pct(ts, 99), "min_ms": min(ts),
            "iters": iters}


@contextlib.contextmanager
def primary_context(device: int = 0):
    """The device's primary CUDA context, current on this thread, released on exit: yields (driver, context)."""
    from cuvil.targets.ptx.runtime import _call, driver
    drv = driver()
    dev = _call(drv, "cuDeviceGet", drv.cuDeviceGet(device))
    ctx = _call(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    try:
        _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        yield drv, ctx
    finally:
        drv.cuDevicePrimaryCtxRelease(dev)


def save(path):
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def bench_cuvil(args):
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import _call, device_info, driver, load_bundle
    from cuvil.testing import light_model
    info = device_info(0)
    RESULTS["device"] = info
    print(f"device: {info['name']} ({info['arch']}, {info['multiprocessors']} SMs, driver CUDA "
          f"{info['driver_cuda_version']})", flush=True)
    model = light_model("resnet50")
    t0 = time.perf_counter()
    bundle = Pipeline.from_onnx(model).optimize().compile("nvptx64-nvidia-cuda", arch=info["arch"], cache=False)
    compile_s = time.perf_counter() - t0
    man = bundle.manifest
    print(f"cuvil: compiled {man['kernels']} kernels in {compile_s:.1f} s (ptxas: "
          f"{(man.get('ptxas') or {}).get('ptxas')})", flush=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    drv = driver()
    m = load_bundle(bundle.path)
    t0 = time.perf_counter()
    (y,) = m.run(x)
    first_s = time.perf_counter() - t0
    err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
    (y_eager,) = m.run(x, mode="eager")
    print(f"cuvil: module {m.module_source}; first run (eager pass + capture + replay) {1e3 * first_s:.1f} ms; "
          f"vs onnxruntime max rel. error {err:.2e}; graph == eager: {np.array_equal(y, y_eager)}", flush=True)
    RESULTS["cuvil"] = {"kernels": man["kernels"], "compile_s": compile_s, "rel_err_vs_ort": err,
                        "graph_equals_eager": bool(np.array_equal(y, y_eager)), "module": m.module_source,
                        "first_run_ms": 1e3 * first_s, "arena_bytes": man["arena_bytes"],
                        "weights_bytes": man["weights_bytes"], "device_bytes": m.device_bytes}
    # device-resident input and output: what a zero-copy caller sees
    d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
    d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes)))
    _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
    t0 = time.perf_counter()
    m.run_device([d_in], [d_out], mode="eager")
    one = time.perf_counter() - t0
    iters = max(20, min(args.iters, int(20.0 / max(one, 1e-4))))
    for mode in ("eager", "graph"):
        r = timed(lambda: m.run_device([d_in], [d_out], mode=mode), iters)
        RESULTS["cuvil"][mode] = r
        print(f"cuvil {mode:5}: p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms ({iters} runs)", flush=True)
    r = timed(lambda: m.run(x), max(10, iters // 2))
    RESULTS["cuvil"]["graph_numpy_io"] = r
    print(f"cuvil graph with numpy in/out (H2D + replay + D2H): p50 {r['p50_ms']:.3f} ms", flush=True)
    out = np.empty_like(y)
    _call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(out.ctypes.data, d_out, out.nbytes))
    RESULTS["cuvil"]["run_device_matches_run"] = bool(np.array_equal(out, y))
    RESULTS["cuvil"]["graph_stats"] = m.graph_stats()

    # where the time goes
    prof = m.profile_kernels(repeats=5)
    regs = {k: v["registers"] for k, v in ((man.get("ptxas") or {}).get("kernels") or {}).items()}
    occ_fn = getattr(drv, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    fns = dict(zip([k["name"] for k in m.plan["kernels"]], m._functions))
    total = sum(p["ms"] for p in prof)
    rows = []
    for p in prof:
        rg = m.registers.get(p["name"], regs.get(p["name"], 0))
        occ = occupancy(rg, p["block"])
        drv_blocks = int(_call(drv, "cuOccupancyMaxActiveBlocksPerMultiprocessor", occ_fn(fns[p["name"]], p["block"], 0)))
        rows.append({**p, "registers": rg, "ptxas_registers": regs.get(p["name"]), **occ, "driver_blocks_per_sm": drv_blocks,
                     "share": p["ms"] / total if total else 0.0})
    RESULTS["cuvil"]["kernels"] = rows
    RESULTS["cuvil"]["kernel_sum_ms"] = total
    mismatch = [r["name"] for r in rows if r["driver_blocks_per_sm"] != r["blocks_per_sm"]]
    RESULTS["cuvil"]["occupancy_formula_mismatches"] = mismatch
    top = sorted(rows, key=lambda r: -r["ms"])[:10]
    print(f"\ncuvil kernels (eager, CUDA events, median of 5): sum {total:.3f} ms over {len(rows)} kernels; "
          f"top 10 = {100 * sum(r['share'] for r in top):.0f}%", flush=True)
    print(f"  {'kernel':10} {'stage':14} {'n':>8} {'grid':>5} {'ms':>8} {'share':>6} {'regs':>4} {'occ':>5} {'drv blk/SM':>10}")
    for r in top:
        print(f"  {r['name']:10} {r['stage'][:14]:14} {r['n']:8d} {r['grid']:5d} {r['ms']:8.3f} {100 * r['share']:5.1f}% "
              f"{r['registers']:4d} {100 * r['occupancy']:4.0f}% {r['driver_blocks_per_sm']:10d}")
    print("  occupancy formula vs cuOccupancyMaxActiveBlocksPerMultiprocessor: "
          + ("agree on every kernel" if not mismatch else f"differ on {len(mismatch)} kernels: " + ", ".join(mismatch[:8])),
          flush=True)
    drv.cuMemFree(d_in)
    drv.cuMemFree(d_out)
    m.close()


def _torch_modes(net, x, label, args, compile_too=True):
    """PyTorch eager, a captured CUDA graph and (``compile_too``) torch.compile(mode="reduce-overhead") of
    ``net(x)``, into RESULTS["torch"][MODE_label]."""
    import torch
    import torch._dynamo

    def sync_call(f):
        def run():
            f()
            torch.cuda.synchronize()
        return run

    with torch.inference_mode():
        r = timed(sync_call(lambda: net(x)), args.iters, warmup=10)
    RESULTS["torch"][f"eager_{label}"] = r
    print(f"torch eager       ({label}): p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms", flush=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(s):
            for _ in range(3):
                net(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = net(x)
    r = timed(sync_call(g.replay), args.iters, warmup=10)
    RESULTS["torch"][f"cuda_graph_{label}"] = r
    print(f"torch CUDA graph  ({label}): p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms", flush=True)
    RESULTS["torch"][f"finite_{label}"] = bool(torch.isfinite(y).all())
    del g, y
    if not compile_too:
        return
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        cnet = torch.compile(net, mode="reduce-overhead")
        with torch.inference_mode():
            for _ in range(5):
                cnet(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            r = timed(sync_call(lambda: cnet(x)), args.iters, warmup=10)
        r["compile_s"] = compile_s
        RESULTS["torch"][f"compile_reduce_overhead_{label}"] = r
        print(f"torch.compile(mode='reduce-overhead') ({label}): p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms "
              f"(compile + warm-up {compile_s:.0f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - reported
        RESULTS["torch"][f"compile_reduce_overhead_{label}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"torch.compile failed: {type(e).__name__}: {e}"[:300], flush=True)


def bench_torch(args):
    try:
        import torch
        import torchvision
    except ImportError as e:
        RESULTS["torch"] = {"error": f"not available: {e}"}
        print(f"torch: not available ({e})")
        return
    dev = torch.device("cuda")
    RESULTS["torch"] = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    print(f"\ntorch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
          f"torchvision {torchvision.__version__}: resnet50, random weights, batch 1", flush=True)
    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None).eval().to(dev)
    x = torch.randn(1, 3, 224, 224, device=dev)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    _torch_modes(net, x, "fp32", args, not args.no_compile)
    torch.backends.cudnn.allow_tf32 = True     # PyTorch's defaults: TF32 convolutions, float32 matmuls
    _torch_modes(net, x, "default_tf32", args, not args.no_compile)
    if args.fp16:
        _torch_modes(net.half(), x.half(), "fp16", args, not args.no_compile)


FP16_BN_SCALE = (0.25, 0.75)   # light_model's BatchNormalization scales for the float16 comparison


def bench_cuvil_fp16(args):
    """Cuvil float16 (``enable_fp16``) beside float32 on ResNet-50 with BatchNormalization scales in
    FP16_BN_SCALE: with the default (0.5, 1.5) the seeded model's activations reach 2.4e5, past half's
    range, so its float16 output is inf. Drift of each against onnxruntime (float32, CPU) and each other."""
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import _call, device_info, driver, load_bundle
    from cuvil.testing import light_model
    arch = device_info(0)["arch"]
    model = light_model("resnet50", bn_scale=FP16_BN_SCALE)
    p = Pipeline.from_onnx(model).optimize()
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    out = RESULTS.setdefault("fp16", {"bn_scale": list(FP16_BN_SCALE), "ref_max_abs": float(np.abs(ref).max())})
    drv = driver()
    ys = {}
    for label, kw in (("fp32", {}), ("fp16", {"enable_fp16": True})):
        b = p.compile("nvptx64-nvidia-cuda", arch=arch, cache=False, **kw)
        m = load_bundle(b.path)
        (y,) = m.run(x)
        ys[label] = y
        d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
        d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes)))
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
        r = timed(lambda: m.run_device([d_in], [d_out], mode="graph"), args.iters)
        r.update({"normwise_vs_ort": float(np.abs(y - ref).max() / np.abs(ref).max()),
                  "top1_same_as_ort": bool(int(np.argmax(y)) == int(np.argmax(ref))),
                  "finite": bool(np.isfinite(y).all()), "kernel_sum_ms": sum(q["ms"] for q in m.profile_kernels(repeats=3)),
                  "float16_tensors": len(b.manifest.get("float16_tensors") or [])})
        out[f"cuvil_{label}"] = r
        print(f"cuvil {label} (bn scale {FP16_BN_SCALE}): graph p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms; "
              f"normwise vs onnxruntime {r['normwise_vs_ort']:.2e}, top-1 same {r['top1_same_as_ort']}, "
              f"kernel sum {r['kernel_sum_ms']:.3f} ms", flush=True)
        drv.cuMemFree(d_in)
        drv.cuMemFree(d_out)
        m.close()
    out["fp16_vs_fp32_normwise"] = float(np.abs(ys["fp16"] - ys["fp32"]).max() / np.abs(ys["fp32"]).max())
    print(f"cuvil fp16 vs fp32: normwise {out['fp16_vs_fp32_normwise']:.2e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--fp16", action="store_true", help="also float16: Cuvil --enable-fp16 and PyTorch .half()")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rc = 0
    parts = [bench_cuvil] + ([bench_cuvil_fp16] if args.fp16 else []) + ([] if args.no_torch else [bench_torch])
    for part in parts:
        try:
            part(args)
        except Exception:  # noqa: BLE001 - the other part still runs
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            rc = 1
        save(args.json)
    c, t = RESULTS.get("cuvil", {}), RESULTS.get("torch", {})
    print("\nResNet-50 batch 1 fp32, host wall ms per inference:")
    print(f"  {'engine':44} {'p50':>9} {'p99':>9}")
    for label, r in (("Cuvil eager (run_device)", c.get("eager")), ("Cuvil CUDA graph (run_device)", c.get("graph")),
                     ("Cuvil CUDA graph, numpy in/out", c.get("graph_numpy_io")),
                     ("PyTorch eager (fp32)", t.get("eager_fp32")), ("PyTorch CUDA graph (fp32)", t.get("cuda_graph_fp32")),
                     ("torch.compile reduce-overhead (fp32)", t.get("compile_reduce_overhead_fp32")),
                     ("PyTorch eager (default, TF32 convs)", t.get("eager_default_tf32")),
                     ("PyTorch CUDA graph (default, TF32 convs)", t.get("cuda_graph_default_tf32")),
                     ("torch.compile reduce-overhead (default, TF32)", t.get("compile_reduce_overhead_default_tf32")),
                     ("Cuvil fp32, CUDA graph (fp16 model weights)", RESULTS.get("fp16", {}).get("cuvil_fp32")),
                     ("Cuvil --enable-fp16, CUDA graph", RESULTS.get("fp16", {}).get("cuvil_fp16")),
                     ("PyTorch eager (fp16)", t.get("eager_fp16")), ("PyTorch CUDA graph (fp16)", t.get("cuda_graph_fp16")),
                     ("torch.compile reduce-overhead (fp16)", t.get("compile_reduce_overhead_fp16"))):
        if r and "p50_ms" in r:
            print(f"  {label:44} {r['p50_ms']:9.3f} {r['p99_ms']:9.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
