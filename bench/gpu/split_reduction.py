"""Split reductions (several lanes per output element for stages with few outputs and long sums) and
channel coarsening (several output channels per thread) on the GPU, against one thread per element, kernel by
kernel, on ResNet-50 (batch 1, float32), plus correctness of the
light models built with the chosen thresholds.

    python3 bench/gpu/split_reduction.py [--json out.json] [--models squeezenet,densenet121]

For each candidate stage (a top-level float32 sum of at least ``WARP_MIN_TERMS`` terms) ResNet-50 is built
twice: every candidate as a warp kernel ("warp") and none ("thread"); each kernel is timed with CUDA events
in eager mode (median of 5), so the per-stage choice can be read off the two columns; the graph replay p50
of both builds and of the default build (the shipped thresholds) follows. Then the models in ``--models``
are built with the defaults and compared with onnxruntime (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

RESULTS: dict = {}


def build(model, arch):
    from cuvil import Pipeline
    return Pipeline.from_onnx(model).optimize().compile("nvptx64-nvidia-cuda", arch=arch, cache=False)


def graph_p50(m, x, iters=100):
    from cuvil.targets.ptx.runtime import _call, driver
    drv = driver()
    (y,) = m.run(x)
    d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
    d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes)))
    _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
    for _ in range(10):
        m.run_device([d_in], [d_out])
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        m.run_device([d_in], [d_out])
        ts.append(1e3 * (time.perf_counter() - t0))
    drv.cuMemFree(d_in)
    drv.cuMemFree(d_out)
    return statistics.median(ts), y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--models", default="squeezenet,densenet121,inception_v1,shufflenet,bvlc_alexnet")
    ap.add_argument("--variants", default="strided=SPLIT_MODE:strided",
                    help="extra builds: name=KEY:VALUE;KEY:VALUE,... over the codegen's SPLIT_*/WARP_* settings")
    args = ap.parse_args()
    import onnxruntime as ort
    import cuvil.targets.ptx.codegen as cg
    from cuvil.targets.ptx.runtime import device_info, load_bundle
    from cuvil.testing import light_model
    info = device_info(0)
    arch = info["arch"]
    RESULTS["device"] = info
    defaults = {k: getattr(cg, k) for k in ("WARP_MAX_OUTPUTS", "SPLIT_TARGET_THREADS", "SPLIT_MIN_TERMS_PER_LANE",
                                               "SPLIT_MODE", "COARSEN", "TILE_ENABLED", "TILE_MIN_OUTPUTS")}
    variants = [("thread", {"WARP_MAX_OUTPUTS": 0, "COARSEN": 1, "TILE_ENABLED": 0})]
    for spec in (args.variants or "").split(","):
        if spec:   # name=KEY:VALUE;KEY:VALUE (ints, or strings for SPLIT_MODE)
            label, _, body = spec.partition("=")
            over = {}
            for kv in body.split(";"):
                k, _, v = kv.partition(":")
                over[k] = v if k == "SPLIT_MODE" else int(v)
            variants.append((label, over))
    variants.append(("default", {}))
    model = light_model("resnet50")
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    per = {}
    for label, over in variants:
        for k, v in {**defaults, **over}.items():
            setattr(cg, k, v)
        t0 = time.perf_counter()
        bundle = build(model, arch)
        secs = time.perf_counter() - t0
        m = load_bundle(bundle.path)
        p50, y = graph_p50(m, x)
        err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
        prof = m.profile_kernels(repeats=5)
        lanes = {k["name"]: k.get("lanes", 1) for k in m.plan["kernels"]}
        kinds = {k["name"]: k.get("kind", "element") for k in m.plan["kernels"]}
        per[label] = {p["stage"]: {"ms": p["ms"], "lanes": lanes[p["name"]], "kind": kinds[p["name"]],
                                   "n": p["n"] // lanes[p["name"]]} for p in prof}
        RESULTS[label] = {"settings": {**defaults, **over}, "graph_p50_ms": p50, "rel_err": err, "compile_s": secs,
                          "kernel_sum_ms": sum(p["ms"] for p in prof),
                          "split_kernels": sum(1 for v in lanes.values() if v > 1)}
        print(f"resnet50 {label:8}: graph p50 {p50:.3f} ms, kernels sum {RESULTS[label]['kernel_sum_ms']:.3f} ms, "
              f"{RESULTS[label]['split_kernels']} split kernels, rel err {err:.1e}", flush=True)
        m.close()
    for k, v in defaults.items():
        setattr(cg, k, v)
    rows = []
    for stage, t in per["thread"].items():
        if any(per[v][stage]["kind"] != "element" or abs(per[v][stage]["ms"] - t["ms"]) > 0.005
               for v in per if stage in per[v]):
            rows.append({"stage": stage, "outputs": t["n"],
                         **{f"{v}_ms": per[v][stage]["ms"] for v in per}, **{f"{v}_lanes": per[v][stage]["lanes"] for v in per},
                         **{f"{v}_kind": per[v][stage]["kind"] for v in per}})
    RESULTS["stages"] = rows
    names = [v for v, _ in variants]
    print(f"\n{'stage':10} {'outputs':>8} " + " ".join(f"{n:>12}" for n in names))
    for r in sorted(rows, key=lambda r: r["outputs"]):
        print(f"{r['stage'][:10]:10} {r['outputs']:8d} " + " ".join(
            f"{r[n + '_ms']:8.3f} {r[n + '_kind'][:5]:5}" for n in names), flush=True)
    checks = []
    for name in [m for m in args.models.split(",") if m]:
        mod = light_model(name)
        inp = mod.graph.input[0]
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        xx = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
        r = ort.InferenceSession(mod.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {inp.name: xx})[0]
        m = load_bundle(build(mod, arch).path)
        (y,) = m.run(xx)
        (ye,) = m.run(xx, mode="eager")
        err = float(np.max(np.abs(y - r)) / np.max(np.abs(r)))
        warp = sum(1 for k in m.plan["kernels"] if k.get("lanes", 1) > 1)
        checks.append({"model": name, "rel_err": err, "graph_equals_eager": bool(np.array_equal(y, ye)),
                       "warp_kernels": warp, "kernels": len(m.plan["kernels"])})
        print(f"{name}: rel err {err:.1e} ({'PASS' if err <= 1e-4 else 'FAIL'}), {warp}/{len(m.plan['kernels'])} "
              f"warp kernels, graph == eager {np.array_equal(y, ye)}", flush=True)
        m.close()
    RESULTS["correctness"] = checks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
