"""The register-pressure pass on a GPU: ResNet-50 at batch 1 and 8 with the pass off, on (the default: caps
ptxas meets without spilling) and on with up to 64 B of spills allowed, all loaded in one process and timed
in interleaved rounds (graph replay, device-resident input and output), then every capped kernel timed
alone (CUDA events, eager) beside its uncapped self.

    python3 bench/gpu/register_pass.py [--batches 1 8] [--iters 100] [--rounds 3] [--json out.json]

Registers and occupancy before/after come from the bundles' manifests (``register_pass``), so the same
report without a GPU is ``python3 bench/gpu/register_pass.py --no-gpu``. Outputs of every configuration
are compared bit for bit with the pass-off bundle (a cap changes register allocation, not arithmetic).
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

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.ptx.bundle import compile_bundle  # noqa: E402
from cuvil.targets.ptx.runtime import _call, device_info, load_bundle  # noqa: E402
from cuvil.testing import light_model, with_batch  # noqa: E402
from resnet50 import primary_context, timed  # noqa: E402  (the ResNet-50 table's context and p50 / p99)

CONFIGS = {"off": dict(register_pass=False), "on": dict(register_pass=True, max_spill=0),
           "spill64": dict(register_pass=True, max_spill=64)}


def build(batch: int, name: str, out: str, arch: str) -> dict:
    """Compile light ResNet-50 at ``batch`` in configuration ``name`` (in a worker process)."""
    g = Pipeline.from_onnx(with_batch(light_model("resnet50"), batch)).optimize().graph
    return compile_bundle(g, out, arch=arch, **CONFIGS[name])


def summary(man: dict) -> dict:
    rp = man.get("register_pass") or {}
    rows = rp.get("kernels") or {}
    capped = {k: r for k, r in rows.items() if r.get("cap")}
    return {"looked_at": len(rows), "capped": len(capped),
            "kernels": {k: {"before": r["before"], "after": r["after"], "cap": r["cap"], "tried": r["tried"],
                            "grid": r["grid"]} for k, r in rows.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arch", default=None, help="default: the GPU's (sm_90 with --no-gpu)")
    ap.add_argument("--no-gpu", action="store_true", help="compile and report registers only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
    arch = args.arch or "sm_90"
    if not args.no_gpu:
        res["device"] = device_info(0)
        arch = args.arch or res["device"]["arch"]
    root = tempfile.mkdtemp(prefix="cuvil-regpass-")
    jobs = [(bt, c) for bt in args.batches for c in CONFIGS]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        futs = {j: pool.submit(build, j[0], j[1], os.path.join(root, f"b{j[0]}_{j[1]}.cuvil"), arch) for j in jobs}
        mans = {j: f.result() for j, f in futs.items()}
    print(f"compiled {len(jobs)} bundles in {time.perf_counter() - t0:.1f} s", flush=True)
    for (bt, c), man in mans.items():
        s = summary(man)
        res.setdefault(f"batch{bt}", {})[c] = {"register_pass": s, "compile_s": man["timings"]["compile_seconds"]}
        print(f"batch {bt} {c:8}: {s['looked_at']} register-limited multi-wave kernels, {s['capped']} capped", flush=True)
        for k, r in s["kernels"].items():
            if r["cap"]:
                b, a = r["before"], r["after"]
                print(f"    {k:11} grid {r['grid']:6d}: {b['registers']} -> {a['registers']} regs, "
                      f"{100 * b['occupancy']:.0f}% -> {100 * a['occupancy']:.0f}% occupancy, waves {b['waves']} -> "
                      f"{a['waves']}, spills {a['spill_stores']} B", flush=True)
    save()
    if args.no_gpu:
        shutil.rmtree(root, ignore_errors=True)
        return 0

    with primary_context() as (drv, ctx):
        try:
            for bt in args.batches:
                x = np.random.default_rng(1).standard_normal((bt, 3, 224, 224)).astype(np.float32)
                models = {c: load_bundle(os.path.join(root, f"b{bt}_{c}.cuvil")) for c in CONFIGS}
                outs = {c: m.run(x)[0] for c, m in models.items()}
                d_in = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
                d_out = int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(outs["off"].nbytes)))
                _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
                row = res[f"batch{bt}"]
                for c in CONFIGS:
                    row[c].update({"same_output_as_off": bool(np.array_equal(outs[c], outs["off"])), "graph_p50_ms": [],
                                   "graph_p99_ms": []})
                for rnd in range(args.rounds):
                    for c, m in models.items():
                        _call(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
                        r = timed(lambda: m.run_device([d_in], [d_out], mode="graph"), args.iters)
                        row[c]["graph_p50_ms"].append(r["p50_ms"])
                        row[c]["graph_p99_ms"].append(r["p99_ms"])
                    print(f"batch {bt} round {rnd + 1}: " + ", ".join(f"{c} {row[c]['graph_p50_ms'][-1]:.3f}" for c in CONFIGS),
                          flush=True)
                    save()
                prof = {c: {p["name"]: p["ms"] for p in m.profile_kernels(repeats=5)} for c, m in models.items()}
                for c in CONFIGS:
                    row[c]["kernel_sum_ms"] = sum(prof[c].values())
                    for k, r in row[c]["register_pass"]["kernels"].items():
                        r["ms"] = prof[c].get(k)
                        r["ms_off"] = prof["off"].get(k)
                    capped = {k: r for k, r in row[c]["register_pass"]["kernels"].items() if r["cap"]}
                    print(f"batch {bt} {c:8}: graph p50 {' / '.join(f'{v:.3f}' for v in row[c]['graph_p50_ms'])} ms; kernel sum "
                          f"{row[c]['kernel_sum_ms']:.3f} ms; output == off: {row[c]['same_output_as_off']}; capped kernels "
                          + ", ".join(f"{k} {r['ms_off']:.3f} -> {r['ms']:.3f} ms" for k, r in capped.items()), flush=True)
                save()
                drv.cuMemFree(d_in)
                drv.cuMemFree(d_out)
                for m in models.values():
                    m.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
