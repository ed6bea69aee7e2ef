"""One GPU bundle for a whole batch profile (issue 22), beside torch.compile, in one process:

    python3 bench/gpu/profiles.py [--json out.json] [--iters 50] [--calls 10000] [--resnet-calls 300]
                                  [--max-graphs 4] [--budget 330] [--no-torch]

1. ResNet-50 (onnx's light model, seeded weights, batch made symbolic) compiled ONCE for N in [1, 64]
   (buckets 1 2 4 ... 64, each specialised ahead of time into the one bundle); checked against onnxruntime
   (CPU) at N = 3 (padded to the bucket 4) and N = 8; p50 per call at batch 1 / 8 / 32 / 64, with numpy
   in/out (``run``) and with device-resident buffers (``run_device``).
2. torchvision's resnet50 (random weights, eval, strict float32: TF32 off) under
   ``torch.compile(mode="reduce-overhead", dynamic=False)``: one compiled function called at batch 1 / 8 /
   32 / 64, so it re-records per batch (its first-call seconds are reported), then p50 per call, device-
   resident input, ``torch.cuda.synchronize`` after each call (as Cuvil's ``run_device``).
3. ``--resnet-calls`` calls of ResNet-50 at random batches in [1, 64] with ``max_graphs`` graphs at most:
   graphs alive after each call, captures, evictions, capture time and graph memory per bucket.
4. ``--calls`` (10,000) calls of a small CNN (profile N in [1, 64]) at random batches: zero compiles (the
   compile functions are counted) and zero module loads during the run, at most ``max_graphs`` graphs alive
   after every call, outputs checked against the reference interpreter on a sample.

Times are host wall clock per call, p50 over ``--iters`` runs after warm-up. ``--budget`` (seconds): steps
that would start after it are skipped and listed (the device call has a hard limit). PyTorch is imported by
this script only; Cuvil never imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet50 import timed as _timed  # noqa: E402

RESULTS: dict = {"skipped": []}
T0 = time.perf_counter()
BATCHES = (1, 8, 32, 64)


def timed(fn, iters: int, warmup: int = 3) -> dict:
    """resnet50.py's timer (p50/p90/p99/min ms of ``iters`` calls after ``warmup``)."""
    return _timed(fn, iters, warmup)


def resnet50_batched(bn_scale=(0.5, 1.5)):
    """The light ResNet-50 with dim 0 of its input and output named N (its final Reshape to [1, 2048] made
    [0, 2048]: keep dim 0). ``bn_scale``: :func:`cuvil.testing.light_model`'s; ``(0.25, 0.75)`` keeps the
    activations inside float16's range (with the default they reach 2.4e5: ``enable_fp16`` gives inf / NaN)."""
    import onnx
    from onnx import numpy_helper as nh
    from cuvil.testing import light_model
    m = onnx.ModelProto.FromString(light_model("resnet50", bn_scale=bn_scale).SerializeToString())
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "N"
    del m.graph.value_info[:]
    for i, t in enumerate(m.graph.initializer):
        if t.name == "OC2_DUMMY_1":
            m.graph.initializer[i].CopyFrom(nh.from_array(np.array([0, 2048], np.int64), t.name))
    return m


def small_cnn_batched():
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh
    rng = np.random.default_rng(0)
    W = nh.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "W")
    G = nh.from_array((rng.standard_normal((8 * 8 * 8, 10)) / 16).astype(np.float32), "G")
    nodes = [h.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
             h.make_node("Flatten", ["r"], ["f"], axis=1), h.make_node("MatMul", ["f", "G"], ["y"])]
    g = h.make_graph(nodes, "small", [h.make_tensor_value_info("x", T.FLOAT, ["N", 3, 8, 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 10])], [W, G])
    return onnx.helper.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def over_budget(args, step: str) -> bool:
    if time.perf_counter() - T0 > args.budget:
        RESULTS["skipped"].append(step)
        print(f"[skipped {step}: past the --budget of {args.budget} s]", flush=True)
        return True
    return False


def bench_cuvil(args):
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import _call, device_info, driver, load_bundle
    info = device_info(0)
    RESULTS["device"] = info
    print(f"device: {info['name']} ({info['arch']}, {info['multiprocessors']} SMs)", flush=True)
    model = resnet50_batched()
    t0 = time.perf_counter()
    p = Pipeline.from_onnx(model).optimize()
    b = p.compile("nvptx64-nvidia-cuda", arch=info["arch"], shape_profiles={"N": (1, 8, 64)}, cache=False)
    compile_s = time.perf_counter() - t0
    man = b.manifest
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(b.path) for f in fs)
    r = RESULTS["cuvil"] = {"compile_s": compile_s, "graph_buckets": man["graph_buckets"],
                            "paddable": man["profile"]["N"]["paddable"], "weights_shared": man["weights_shared"],
                            "kernels_total": man["kernels"], "bundle_bytes": size}
    print(f"cuvil: one bundle for N in [1, 64], buckets {man['graph_buckets']['N']}, compiled in {compile_s:.0f} s "
          f"({man['kernels']} kernels in all, weights shared: {man['weights_shared']}, padding: "
          f"{man['profile']['N']['paddable']}, {size / 2**20:.0f} MiB on disk)", flush=True)
    m = load_bundle(b.path, max_graphs=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    r["check"] = {}
    for n in (3, 8):
        x = np.random.default_rng(n).standard_normal((n, 3, 224, 224)).astype(np.float32)
        (y,) = m.run(x)
        ref = sess.run(None, {"gpu_0/data_0": x})[0]
        err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
        r["check"][str(n)] = err
        print(f"cuvil N={n}: max rel. error vs onnxruntime {err:.2e}", flush=True)
    drv = driver()
    r["numpy_io"], r["device"] = {}, {}
    for n in BATCHES:
        x = np.random.default_rng(n).standard_normal((n, 3, 224, 224)).astype(np.float32)
        it = max(10, args.iters // (1 + n // 16))
        r["numpy_io"][str(n)] = t = timed(lambda: m.run(x), it)
        d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
        d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(n * 1000 * 4)))
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
        r["device"][str(n)] = td = timed(lambda: m.run_device([d_in], [d_out], symbols={"N": n}), it)
        drv.cuMemFree(d_in)
        drv.cuMemFree(d_out)
        print(f"cuvil N={n}: run (numpy in/out) p50 {t['p50_ms']:.3f} ms, run_device p50 {td['p50_ms']:.3f} ms",
              flush=True)
    r["stats_after_timing"] = m.stats()
    m.close()
    return p, b


def bench_torch(args):
    try:
        import torch
        import torchvision
    except ImportError as e:
        RESULTS["torch"] = {"error": f"not available: {e}"}
        return
    RESULTS["torch"] = tr = {"torch": torch.__version__, "compile": {}}
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None).eval().cuda()
    cnet = torch.compile(net, mode="reduce-overhead", dynamic=False)
    for n in BATCHES:
        if over_budget(args, f"torch.compile batch {n}"):
            continue
        x = torch.randn(n, 3, 224, 224, device="cuda")
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(3):
                cnet(x)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0

            def call():
                cnet(x)
                torch.cuda.synchronize()
            t = timed(call, max(10, args.iters // (1 + n // 16)))
        t["first_calls_s"] = first
        tr["compile"][str(n)] = t
        print(f"torch.compile fp32 N={n}: p50 {t['p50_ms']:.3f} ms (first 3 calls, re-recording: {first:.1f} s)",
              flush=True)


def random_resnet(args, b):
    from cuvil.targets.ptx.runtime import load_bundle
    rng = np.random.default_rng(7)
    xs = {n: rng.standard_normal((n, 3, 224, 224)).astype(np.float32) for n in range(1, 65)}
    with load_bundle(b.path, max_graphs=args.max_graphs) as m:
        loads, most = m.module_loads, 0
        t0 = time.perf_counter()
        for _ in range(args.resnet_calls):
            n = int(rng.integers(1, 65))
            (y,) = m.run(xs[n])
            assert y.shape == (n, 1000)
            most = max(most, m.stats()["graphs_alive"])
        secs = time.perf_counter() - t0
        st = m.stats()
    RESULTS["random_resnet50"] = {"calls": args.resnet_calls, "seconds": secs, "max_alive": most,
                                  "module_loads_during_run": st["module_loads"] - loads, "stats": st}
    print(f"ResNet-50, {args.resnet_calls} calls at random N in [1, 64], max_graphs={args.max_graphs}: at most "
          f"{most} graphs alive, {st['captures']} captures, {st['evictions']} evictions, "
          f"{st['module_loads'] - loads} module loads, {secs:.1f} s", flush=True)
    for k, v in st["buckets"].items():
        print(f"  {k:5}: captures {v['captures']}, capture {v['capture_ms']:.1f} ms total / {v['last_capture_ms']:.1f} "
              f"last, {v['nodes']} nodes, graph memory {v['graph_bytes']} B, hits {v['hits']}, misses {v['misses']}, "
              f"evictions {v['evictions']}", flush=True)


def random_small(args):
    from cuvil import Pipeline
    from cuvil.targets.ptx import bundle as bundle_mod
    from cuvil.targets.ptx import profile_bundle as pb_mod
    from cuvil.targets.ptx.runtime import load_bundle
    p = Pipeline.from_onnx(small_cnn_batched()).optimize()
    b = p.compile("nvptx64-nvidia-cuda", shape_profiles={"N": (1, 8, 64)}, cache=False)
    compiles = [0]
    real = bundle_mod.compile_bundle

    def counting(*a, **k):
        compiles[0] += 1
        return real(*a, **k)
    bundle_mod.compile_bundle = pb_mod.compile_bundle = counting
    rng = np.random.default_rng(11)
    bad = 0
    try:
        with load_bundle(b.path, max_graphs=args.max_graphs) as m:
            loads, most = m.module_loads, 0
            t0 = time.perf_counter()
            for i in range(args.calls):
                n = int(rng.integers(1, 65))
                x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
                (y,) = m.run(x)
                alive = m.stats()["graphs_alive"]
                most = max(most, alive)
                if alive > args.max_graphs:
                    bad += 1
                if i % 500 == 0:
                    ref = p.run_reference({"x": x})["y"]
                    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
            secs = time.perf_counter() - t0
            st = m.stats()
    finally:
        bundle_mod.compile_bundle = pb_mod.compile_bundle = real
    RESULTS["random_small"] = {"calls": args.calls, "seconds": secs, "compiles_during_run": compiles[0],
                               "module_loads_during_run": st["module_loads"] - loads, "max_alive": most,
                               "over_bound": bad, "captures": st["captures"], "evictions": st["evictions"],
                               "hits": st["hits"], "misses": st["misses"], "stats": st}
    print(f"small CNN, {args.calls} calls at random N in [1, 64], max_graphs={args.max_graphs}: {compiles[0]} compiles, "
          f"{st['module_loads'] - loads} module loads, at most {most} graphs alive, {st['captures']} captures, "
          f"{st['hits']} hits, {st['evictions']} evictions, {secs:.1f} s", flush=True)


def table():
    c, t = RESULTS.get("cuvil", {}), (RESULTS.get("torch") or {}).get("compile", {})
    lines = ["| batch | Cuvil one bundle, run (numpy in/out) | Cuvil run_device | torch.compile fp32 | ratio run_device / torch |",
             "|---|---|---|---|---|"]
    for n in BATCHES:
        a = c.get("numpy_io", {}).get(str(n), {}).get("p50_ms")
        d = c.get("device", {}).get(str(n), {}).get("p50_ms")
        tt = t.get(str(n), {}).get("p50_ms")
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        lines.append(f"| {n} | {fmt(a)} | {fmt(d)} | {fmt(tt)} | "
                     + (f"{d / tt:.2f}" if d is not None and tt else "-") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--resnet-calls", type=int, default=300)
    ap.add_argument("--max-graphs", type=int, default=4)
    ap.add_argument("--budget", type=float, default=330.0)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    from cuvil.targets.x86.cpu import cpu_label
    RESULTS["cpu"] = cpu_label()
    print(f"host CPU: {RESULTS['cpu']}", flush=True)
    rc = 0
    b = None
    steps = [("cuvil", lambda: bench_cuvil(args)), ("random_small", lambda: random_small(args)),
             ("random_resnet50", lambda: random_resnet(args, b)),
             ("torch", lambda: None if args.no_torch else bench_torch(args))]
    for name, fn in steps:
        if over_budget(args, name) or (name == "random_resnet50" and b is None):
            continue
        try:
            out = fn()
            if name == "cuvil":
                b = out[1]
        except Exception as e:  # noqa: BLE001 - reported, the other steps still run
            rc = 1
            RESULTS.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
    print("\n" + table(), flush=True)
    RESULTS["table"] = table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
