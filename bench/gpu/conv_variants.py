"""ResNet-50 (batch 1, float32) under variants of the GPU code generator's settings, all loaded in one process
and timed in interleaved rounds (graph replay, device-resident input and output), each checked against
onnxruntime; per-kernel times of every variant go to the JSON.

    python3 bench/gpu/conv_variants.py [--variants "tb528=target_blocks:528,old=conv_enabled:0"]
                                       [--rounds 3] [--iters 100] [--json out.json]

A variant is ``name=KEY:VALUE;KEY:VALUE`` over the code generator's settings (``codegen_settings.py``:
``unpadded`` and ``fused_splitk``, compile_bundle's switches, and the fields of
:class:`cuvil.targets.ptx.tuning.PtxTuning`); ``default`` (the shipped settings) always runs first.
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

from codegen_settings import bundle_options, parse_settings  # noqa: E402
from cuvil import Pipeline  # noqa: E402
from cuvil.targets.ptx.bundle import compile_bundle  # noqa: E402
from cuvil.targets.ptx.runtime import _call, device_info, load_bundle  # noqa: E402
from cuvil.testing import light_model, with_batch  # noqa: E402
from resnet50 import primary_context, timed  # noqa: E402  (the ResNet-50 table's context and p50 / p99)


def parse(spec: str) -> dict:
    """``name=KEY:VALUE;KEY:VALUE,...`` -> {name: {KEY: value}}, the shipped settings first as ``default``."""
    out = {"default": {}}
    for item in filter(None, spec.split(",")):
        name, _, body = item.partition("=")
        out[name] = parse_settings(body)
    return out


def build(settings: dict, out: str, arch: str, batch: int) -> dict:
    g = Pipeline.from_onnx(with_batch(light_model("resnet50"), batch)).optimize().graph
    return compile_bundle(g, out, arch=arch, **bundle_options(settings))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="old=conv_enabled:0",
                    help="name=KEY:VALUE;KEY:VALUE,... (keys: unpadded, fused_splitk, PtxTuning's fields)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    variants = parse(args.variants)
    import onnxruntime as ort
    info = device_info(0)
    res = {"device": info, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "batch": args.batch,
           "variants": {k: {"settings": v} for k, v in variants.items()}}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
    root = tempfile.mkdtemp(prefix="cuvil-conv-")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        futs = {k: pool.submit(build, v, os.path.join(root, f"{k}.cuvil"), info["arch"], args.batch) for k, v in variants.items()}
        mans = {}
        for k, f in futs.items():
            try:
                mans[k] = f.result()
            except BaseException as e:  # noqa: BLE001 - reported, the others go on
                res["variants"][k]["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"{k}: compile failed: {res['variants'][k]['error']}", flush=True)
    print(f"compiled {len(mans)} variants in {time.perf_counter() - t0:.1f} s", flush=True)
    model = with_batch(light_model("resnet50"), args.batch)
    x = np.random.default_rng(1).standard_normal((args.batch, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"gpu_0/data_0": x})[0]
    models = {}
    with primary_context() as (drv, ctx):
        try:
            d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
            d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(ref.nbytes)))
            _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
            for k in mans:
                m = load_bundle(os.path.join(root, f"{k}.cuvil"))
                (y,) = m.run(x)
                err = float(np.abs(y - ref).max() / np.abs(ref).max())
                res["variants"][k].update({"normwise": err, "kernels": len(m.plan["kernels"]), "p50_ms": [], "p99_ms": [],
                                           "arena_bytes": m.plan["arena_bytes"]})
                models[k] = m
                print(f"{k}: {len(m.plan['kernels'])} kernels, normwise error {err:.2e}", flush=True)
            for rnd in range(args.rounds):
                for k, m in models.items():
                    _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
                    r = timed(lambda: m.run_device([d_in], [d_out]), args.iters, warmup=10)
                    res["variants"][k]["p50_ms"].append(r["p50_ms"])
                    res["variants"][k]["p99_ms"].append(r["p99_ms"])
                print(f"round {rnd + 1}: " + ", ".join(f"{k} {res['variants'][k]['p50_ms'][-1]:.3f}" for k in models), flush=True)
                save()
            for k, m in models.items():
                prof = m.profile_kernels(repeats=5)
                res["variants"][k]["kernel_sum_ms"] = sum(p["ms"] for p in prof)
                res["variants"][k]["per_kernel"] = [{"name": p["name"], "stage": p["stage"], "ms": p["ms"]} for p in prof]
                v = res["variants"][k]
                print(f"{k:10}: graph p50 {' / '.join(f'{t:.3f}' for t in v['p50_ms'])} ms, p99 "
                      f"{' / '.join(f'{t:.3f}' for t in v['p99_ms'])}; kernel sum {v['kernel_sum_ms']:.3f} ms; "
                      f"{v['kernels']} kernels; error {v['normwise']:.1e}", flush=True)
            save()
        finally:
            for m in models.values():
                m.close()
            shutil.rmtree(root, ignore_errors=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
