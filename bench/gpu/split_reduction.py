"""Split reductions (several lanes per output element for stages with few outputs and long sums) and
channel coarsening (several output channels per thread) on the GPU, against one thread per element, kernel by
kernel, on ResNet-50 (batch 1, float32), plus correctness of the
light models built with the chosen thresholds.

    python3 bench/gpu/split_reduction.py [--json out.json] [--models squeezenet,densenet121]
                                         [--variants "strided=split_mode:strided"]

For each candidate stage (a top-level float32 sum of at least ``WARP_MIN_TERMS`` terms) ResNet-50 is built
with one thread per element ("thread": no split, coarsening or tiles), in each ``--variants`` build
(``name=KEY:VALUE;...`` over :class:`cuvil.targets.ptx.tuning.PtxTuning`'s fields, see ``codegen_settings.py``)
and with the shipped settings ("default"); each kernel is timed with CUDA events
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
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)

from codegen_settings import bundle_options, parse_settings  # noqa: E402
from cuvil import Pipeline  # noqa: E402
from cuvil.targets.ptx.bundle import compile_bundle  # noqa: E402
from cuvil.targets.ptx.runtime import _call, device_info, driver, load_bundle  # noqa: E402
from cuvil.targets.ptx.tuning import DEFAULT_TUNING  # noqa: E402
from cuvil.testing import light_model  # noqa: E402

RESULTS: dict = {}
# the shipped values of the settings this benchmark varies (recorded beside each variant's overrides)
SETTINGS = ("warp_max_outputs", "split_target_threads", "split_min_terms_per_lane", "split_mode", "coarsen",
            "tile_enabled", "tile_min_outputs")


def build(model, arch, settings: dict):
    """Compile ``model`` for ``arch`` with the code generator settings ``settings``; the loaded bundle."""
    out = os.path.join(tempfile.mkdtemp(prefix="cuvil-split-"), "model.cuvil")
    compile_bundle(Pipeline.from_onnx(model).optimize().graph, out, arch=arch, **bundle_options(settings))
    return load_bundle(out)


def graph_p50(m, x, iters=100):
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--models", default="squeezenet,densenet121,inception_v1,shufflenet,bvlc_alexnet")
    ap.add_argument("--variants", default="strided=split_mode:strided",
                    help="extra builds: name=KEY:VALUE;KEY:VALUE,... over PtxTuning's fields (split_mode, "
                         "warp_max_outputs, split_target_threads, split_min_terms_per_lane, coarsen, ...)")
    args = ap.parse_args(argv)
    defaults = {k: getattr(DEFAULT_TUNING, k) for k in SETTINGS}
    variants = [("thread", {"warp_max_outputs": 0, "coarsen": 1, "tile_enabled": False})]
    for spec in (args.variants or "").split(","):
        if spec:
            label, _, body = spec.partition("=")
            variants.append((label, parse_settings(body)))
    variants.append(("default", {}))
    import onnxruntime as ort
    info = device_info(0)
    arch = info["arch"]
    RESULTS["device"] = info
    model = light_model("resnet50")
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    per = {}
    for label, over in variants:
        t0 = time.perf_counter()
        m = build(model, arch, over)
        secs = time.perf_counter() - t0
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
        m = build(mod, arch, {})
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
