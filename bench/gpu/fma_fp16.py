"""Kernel rules (fma contraction), 32-bit index unflattening and ``--enable-fp16`` on a GPU: correctness of the
nine light models against onnxruntime (CPU) in three variants, then ResNet-50's latency in each.

    python3 bench/gpu/fma_fp16.py [--models ...] [--iters 200] [--json out.json]

Variants (all ``Pipeline.compile(target="nvptx64-nvidia-cuda")``):
  fp32_nofma   fma=False: exact kernel rules only, every operation rounded separately (the earlier numerics)
  fp32_fma     the default: proved kernel rules incl. fma contraction
  fp16         enable_fp16=True (fma on): half storage and elementwise math, float32 accumulation

Errors are normwise (max|gpu - ref| / max|ref|, as check_correctness.py) plus the largest elementwise relative
error over outputs with |ref| >= 1% of max|ref|. fp32 variants pass at 1e-4, fp16 at 1e-2 (normwise).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)

from occupancy import occupancy  # noqa: E402
from resnet50 import timed  # noqa: E402

TARGET = "nvptx64-nvidia-cuda"
VARIANTS = {"fp32_nofma": dict(fma=False), "fp32_fma": dict(fma=True), "fp16": dict(fma=True, enable_fp16=True)}
# (run 1 of 2026-11-29 ran these with the then-default 32-bit index unflattening; the default is now 64-bit)
TOL = {"fp32_nofma": 1e-4, "fp32_fma": 1e-4, "fp16": 1e-2}


def _compile(name: str, variant: str, out_dir: str, arch: str):
    from cuvil import Pipeline
    from cuvil.testing import light_model
    t0 = time.perf_counter()
    try:
        b = Pipeline.from_onnx(light_model(name, bn_scale=BN_SCALE)).optimize().compile(TARGET, arch=arch, cache=False, **VARIANTS[variant])
        path = b.save(os.path.join(out_dir, f"{name}.{variant}.cuvil"))
        m = b.manifest
        regs = [k["registers"] for k in ((m.get("ptxas") or {}).get("kernels") or {}).values()]
        return {"path": path, "kernels": m["kernels"], "compile_s": round(time.perf_counter() - t0, 1),
                "registers": regs, "kernel_rules": {k: v["applied"] for k, v in m["kernel_rules"].items() if v["applied"]},
                "float16_tensors": len(m["float16_tensors"]), "weights_bytes": m["weights_bytes"]}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}


def errors(got, ref) -> dict:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    scale = float(np.max(np.abs(r)))
    big = np.abs(r) >= 0.01 * scale
    return {"normwise": float(np.max(np.abs(g - r)) / scale) if np.all(np.isfinite(g)) else float("inf"),
            "max_rel_significant": float(np.max(np.abs(g[big] - r[big]) / np.abs(r[big]))),
            "top1_same": bool(np.argmax(g.reshape(-1)) == np.argmax(r.reshape(-1)))}


def correctness(names, out_dir, arch, jobs):
    import onnxruntime as ort
    from cuvil.targets.ptx.runtime import load_bundle
    from cuvil.testing import light_model
    rows = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futs = {(n, v): pool.submit(_compile, n, v, out_dir, arch) for n in names for v in VARIANTS}
        for n in names:
            model = light_model(n, bn_scale=BN_SCALE)
            rng = np.random.default_rng(1)
            inits = {t.name for t in model.graph.initializer}
            feeds = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
                     for vi in model.graph.input if vi.name not in inits}
            ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
            for v in VARIANTS:
                built = futs[(n, v)].result()
                row = {"model": n, "variant": v}
                if "error" in built:
                    rows.append({**row, "status": "compile error", "detail": built["error"]})
                else:
                    try:
                        with load_bundle(built["path"]) as m:
                            got = m.run(*feeds.values())
                            eager = m.run(*feeds.values(), mode="eager")
                            drv_regs = dict(m.registers)
                        same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, eager))
                        e = errors(got[0], ref[0])
                        status = "pass" if e["normwise"] <= TOL[v] and same else ("graph!=eager" if not same else "over tolerance")
                        rows.append({**row, "status": status, **e, **{k: built[k] for k in built if k != "path"},
                                     "driver_registers_equal": sorted(drv_regs.values()) == sorted(built["registers"])})
                    except Exception as ex:  # noqa: BLE001
                        rows.append({**row, "status": "run error", "detail": f"{type(ex).__name__}: {ex}".splitlines()[0][:300]})
                    shutil.rmtree(built["path"], ignore_errors=True)
                r = rows[-1]
                print(f"{n:14} {v:11} {r['status']:14} " + (f"normwise {r['normwise']:.2e} maxrel {r['max_rel_significant']:.2e} "
                      f"top1 {r['top1_same']} kernels {r['kernels']} regs max {max(r['registers'] or [0])} "
                      f"compile {r['compile_s']} s rules {r['kernel_rules']}" if "normwise" in r else r.get("detail", "")),
                      flush=True)
    return rows


def resnet(arch, iters):
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    from cuvil.testing import light_model
    model = light_model("resnet50")
    p = Pipeline.from_onnx(model).optimize()
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    drv = driver()
    out = {}
    for v, kw in VARIANTS.items():
        t0 = time.perf_counter()
        b = p.compile(TARGET, arch=arch, cache=False, **kw)
        cs = time.perf_counter() - t0
        with load_bundle(b.path) as m:
            (y,) = m.run(x)
            d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
            d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes)))
            _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
            r = {"compile_s": round(cs, 1), **errors(y, ref)}
            for mode in ("graph", "eager"):
                r[mode] = timed(lambda: m.run_device([d_in], [d_out], mode=mode), iters)
            prof = m.profile_kernels(repeats=5)
            occ_fn = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor
            fns = dict(zip([k["name"] for k in m.plan["kernels"]], m._functions))
            kern = []
            for pr in prof:
                rg = m.registers[pr["name"]]
                o = occupancy(rg, pr["block"])
                db = int(_call(drv, "cuOccupancyMaxActiveBlocksPerMultiprocessor", occ_fn(fns[pr["name"]], pr["block"], 0)))
                kern.append({**pr, "registers": rg, **o, "driver_blocks_per_sm": db})
            r["kernel_sum_ms"] = sum(k["ms"] for k in kern)
            r["kernels"] = kern
            r["occupancy_formula_mismatches"] = [k["name"] for k in kern if k["driver_blocks_per_sm"] != k["blocks_per_sm"]]
            r["kernel_rules"] = {k: v2["applied"] for k, v2 in b.manifest["kernel_rules"].items() if v2["applied"]}
            _call(drv, "cuMemFree", drv.cuMemFree(d_in))
            _call(drv, "cuMemFree", drv.cuMemFree(d_out))
        shutil.rmtree(b.path, ignore_errors=True)
        regs = [k["registers"] for k in kern]
        occs = [k["occupancy"] for k in kern]
        print(f"resnet50 {v:11}: graph p50 {r['graph']['p50_ms']:.3f} p99 {r['graph']['p99_ms']:.3f} ms; eager p50 "
              f"{r['eager']['p50_ms']:.3f}; kernels sum {r['kernel_sum_ms']:.3f} ms; normwise {r['normwise']:.2e}; "
              f"regs median {sorted(regs)[len(regs) // 2]} max {max(regs)}; mean occ {100 * sum(occs) / len(occs):.0f}%; "
              f"occupancy mismatches {len(r['occupancy_formula_mismatches'])}", flush=True)
        out[v] = r
    return out


BN_SCALE = (0.5, 1.5)   # light_model's default; --half-range-weights: (0.25, 0.75), activations that fit half

AB = {"old_codegen": dict(fma=False, kernel_rules=False, narrow_index=False),
      "nofma_wide_index": dict(fma=False, narrow_index=False),
      "fma_wide_index": dict(fma=True, narrow_index=False),
      "fma_narrow_index": dict(fma=True, narrow_index=True),
      "fp16": dict(fma=True, narrow_index=True, enable_fp16=True),
      "fp16_wide_index": dict(fma=True, narrow_index=False, enable_fp16=True)}
# old_codegen: no kernel rules, no fma, 64-bit index (the code generator before the kernel rules);
# nofma_wide_index: exact kernel rules only (--no-fma), 64-bit index; fma_wide_index: THE DEFAULT (rules + fma,
# 64-bit index); fma_narrow_index: + narrow_index=True; fp16*: --enable-fp16 (fma on) with 32- / 64-bit index


def resnet_ab(arch, iters, rounds=3, out=None, save=lambda: None):
    """ResNet-50 in each AB configuration, all loaded at once, timed in interleaved rounds (graph replay,
    device-resident input/output), then per-kernel times (CUDA events, eager). ``out`` is filled as results
    come in (``save`` is called after each phase), so a failure late in the run keeps what was measured."""
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.bundle import compile_bundle
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    from cuvil.testing import light_model
    out = {} if out is None else out
    model = light_model("resnet50")
    g = Pipeline.from_onnx(model).optimize().graph
    x = np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    root = tempfile.mkdtemp(prefix="cuvil-ab-")
    models = {}
    t0 = time.perf_counter()
    # compile in worker processes first; the CUDA work below happens in this process only
    with ProcessPoolExecutor(max_workers=len(AB)) as pool:
        futs = {k: pool.submit(compile_bundle, g, os.path.join(root, f"{k}.cuvil"), arch=arch, **kw) for k, kw in AB.items()}
        mans = {}
        for k in AB:
            try:
                mans[k] = futs[k].result()
            except Exception as e:  # noqa: BLE001 - reported, the other configurations go on
                out[k] = {"config": {a: b for a, b in AB[k].items()}, "error": f"compile: {type(e).__name__}: {e}"[:400]}
                print(f"resnet50 {k:17}: {out[k]['error']}", flush=True)
    print(f"compiled {len(mans)}/{len(AB)} configurations in {time.perf_counter() - t0:.1f} s", flush=True)
    # The primary context, retained and made current by this thread BEFORE any cuMemAlloc of our own (as
    # GpuModel does): an earlier version allocated before any model had done so and failed with
    # CUDA_ERROR_INVALID_CONTEXT (results/resnet50_ab_failed.txt). Retaining it here also keeps it alive
    # until our buffers are freed, whatever the models do.
    drv = driver()
    dev = _call(drv, "cuDeviceGet", drv.cuDeviceGet(0))
    ctx = _call(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
    d_in = d_out = None
    try:
        d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
        d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(ref.nbytes)))
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
        for k, man in mans.items():
            row = {"config": {a: b for a, b in AB[k].items()}}
            try:
                m = load_bundle(os.path.join(root, f"{k}.cuvil"))
                (y,) = m.run(x)
                regs = sorted(m.registers.values())
                row.update({**errors(y, ref), "kernels_n": man["kernels"], "module": m.module_source,
                            "registers_median": regs[len(regs) // 2], "registers_max": regs[-1],
                            "kernel_rules": {a: b["applied"] for a, b in man["kernel_rules"].items() if b["applied"]},
                            "float16_tensors": len(man.get("float16_tensors") or []),
                            "graph_p50_ms": [], "graph_p99_ms": [], "graph_min_ms": []})
                models[k] = m
            except Exception as e:  # noqa: BLE001
                row["error"] = f"load/run: {type(e).__name__}: {e}"[:400]
                print(f"resnet50 {k:17}: {row['error']}", flush=True)
            out[k] = row
        save()
        _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        for rnd in range(rounds):
            for k, m in models.items():
                r = timed(lambda: m.run_device([d_in], [d_out], mode="graph"), iters)
                out[k]["graph_p50_ms"].append(r["p50_ms"])
                out[k]["graph_p99_ms"].append(r["p99_ms"])
                out[k]["graph_min_ms"].append(r["min_ms"])
            print(f"round {rnd + 1}/{rounds}: " + ", ".join(f"{k} {out[k]['graph_p50_ms'][-1]:.3f}" for k in models),
                  flush=True)
            save()
        for k, m in models.items():
            # this configuration's run_device output (d_out is shared: run it once more, then read it back)
            y = np.empty_like(ref)
            m.run_device([d_in], [d_out], mode="graph")
            _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
            _call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(y.ctypes.data, d_out, y.nbytes))
            out[k]["run_device_normwise"] = errors(y, ref)["normwise"]
            prof = m.profile_kernels(repeats=5)
            out[k]["kernels"] = [{**p, "registers": m.registers[p["name"]]} for p in prof]
            out[k]["kernel_sum_ms"] = sum(p["ms"] for p in prof)
            out[k]["graph_stats"] = m.graph_stats()
            print(f"resnet50 {k:17}: graph p50 {' / '.join(f'{v:.3f}' for v in out[k]['graph_p50_ms'])} ms, p99 "
                  f"{' / '.join(f'{v:.3f}' for v in out[k]['graph_p99_ms'])} ms; kernels sum {out[k]['kernel_sum_ms']:.3f} ms; "
                  f"normwise {out[k]['normwise']:.2e} (run_device {out[k]['run_device_normwise']:.2e}); regs median "
                  f"{out[k]['registers_median']} max {out[k]['registers_max']}; rules {out[k]['kernel_rules']}", flush=True)
        save()
    finally:
        _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        for p in (d_in, d_out):
            if p is not None:
                drv.cuMemFree(p)
        for m in models.values():
            m.close()
        drv.cuDevicePrimaryCtxRelease(dev)
        shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv=None) -> int:
    from cuvil.testing import LIGHT_MODELS
    from cuvil.targets.ptx.runtime import device_info
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(LIGHT_MODELS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--skip-resnet", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--ab", action="store_true", help="ResNet-50 only: the AB configurations, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: interleaved timing rounds")
    ap.add_argument("--half-range-weights", action="store_true",
                    help="BatchNormalization scales in (0.25, 0.75): every model's activations fit float16")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    global BN_SCALE
    if args.half_range_weights:
        BN_SCALE = (0.25, 0.75)
    info = device_info(0)
    print(f"device: {info}", flush=True)
    res = {"device": info, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
    if args.ab:
        res["resnet50_ab"] = {}
        try:
            resnet_ab(info["arch"], args.iters, args.rounds, res["resnet50_ab"], save)
        finally:
            save()
        return 0
    if not args.skip_correctness:
        out_dir = tempfile.mkdtemp(prefix="cuvil-fma-fp16-")
        res["correctness"] = correctness(args.models, out_dir, info["arch"], args.jobs)
        save()
    if not args.skip_resnet:
        res["resnet50"] = resnet(info["arch"], args.iters)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
