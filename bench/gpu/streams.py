"""Kernels that share no bytes, run at once: a bundle's CUDA graph captured over several streams
(``load_bundle(..., streams=N)``, cuvil.targets.ptx.launch_deps) against the launch order on one stream
(``streams=1``), the same bundle, in one process.

For each model (onnx's light zoo models at batch 1, float32 and float16): compile once (in parallel), then for
each stream count, blocks of graph replays with device-resident inputs and outputs, the counts alternated block
by block so drift hits both; p50 per count, the ratio to ``streams=1``, the outputs compared bit for bit (the
same kernels, each writing what it wrote before: any difference is a race), and the plan's ``launch_graph``
(kernels, critical path, widest level).

    python3 bench/gpu/streams.py --out results/streams.json [--models inception_v1,squeezenet] [--streams 1 2 4]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

MODELS = "inception_v1,inception_v2,squeezenet,densenet121,resnet50,shufflenet"


def compile_one(job):
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-streams-cache")
    try:
        from cuvil import Pipeline
        from cuvil.testing import light_model
        name, fp16, out = job
        p = Pipeline.from_onnx(light_model(name, bn_scale=(0.25, 0.75))).optimize()
        b = p.compile("nvptx64-nvidia-cuda", arch=os.environ.get("ARCH", "sm_90"), cache=False,
                      fixed={"N": 1} if "N" in p.graph.symbols else None, enable_fp16=fp16)
        b.save(out)
        return {"path": out, "launch_graph": b.manifest.get("launch_graph")}
    except Exception:  # noqa: BLE001 - reported
        return {"error": traceback.format_exc()[-1500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--work", default="/tmp/cuvil-streams")
    args = ap.parse_args()
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    from cuvil.targets.x86.cpu import cpu_label
    os.makedirs(args.work, exist_ok=True)
    jobs = [(m, fp16, os.path.join(args.work, f"{m}_{'fp16' if fp16 else 'fp32'}.cuvil"))
            for m in args.models.split(",") for fp16 in (False, True)]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as ex:
        built = dict(zip(jobs, ex.map(compile_one, jobs)))
    print(f"compiled {len(jobs)} bundles in {time.perf_counter() - t0:.1f} s", flush=True)
    drv = driver()
    R = {"host": cpu_label(), "streams": args.streams, "models": {}}
    for job, info in built.items():
        key = os.path.basename(job[2])[:-6]
        if "error" in info:
            R["models"][key] = info
            print(key, "compile error", info["error"][-300:], flush=True)
            continue
        try:
            ms = {n: load_bundle(info["path"], streams=n) for n in args.streams}
            m0 = ms[args.streams[0]]
            rng = np.random.default_rng(0)
            xs = [rng.standard_normal([int(d) for d in s.shape]).astype(s.dtype) for s in m0.inputs]
            outs = {n: m.run(*xs) for n, m in ms.items()}
            d_in = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(x.nbytes, 1)))) for x in xs]
            d_out = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(y.nbytes, 1)))) for y in outs[args.streams[0]]]
            for d, x in zip(d_in, xs):
                _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d, np.ascontiguousarray(x).ctypes.data, x.nbytes))
            times = {n: [] for n in args.streams}
            for blk in range(args.blocks):
                order = args.streams if blk % 2 == 0 else list(reversed(args.streams))
                for n in order:
                    m = ms[n]
                    for _ in range(5):
                        m.run_device(d_in, d_out)
                    for _ in range(args.iters):
                        t = time.perf_counter()
                        m.run_device(d_in, d_out)
                        times[n].append(1e3 * (time.perf_counter() - t))
            base = statistics.median(times[args.streams[0]])
            r = {"launch_graph": info["launch_graph"]}
            for n in args.streams:
                p50 = statistics.median(times[n])
                r[f"streams{n}"] = {"p50_ms": p50, "min_ms": min(times[n]), "ratio_to_first": p50 / base,
                                    "same_bits": all(np.array_equal(a, b) for a, b in
                                                     zip(outs[args.streams[0]], outs[n]))}
            R["models"][key] = r
            print(key, info["launch_graph"], " ".join(f"streams={n}: {r[f'streams{n}']['p50_ms']:.3f} ms "
                                                      f"(x{r[f'streams{n}']['ratio_to_first']:.3f}, same bits "
                                                      f"{r[f'streams{n}']['same_bits']})" for n in args.streams),
                  flush=True)
            for d in d_in + d_out:
                drv.cuMemFree(d)
            for m in ms.values():
                m.close()
        except Exception:  # noqa: BLE001 - the others still run
            R["models"][key] = {"error": traceback.format_exc()[-1500:]}
            print(key, traceback.format_exc()[-800:], flush=True)
        with open(args.out, "w") as f:
            json.dump(R, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
