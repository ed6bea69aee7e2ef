"""Calibration data for the tensor-core products' split-K plan (``ptx/matmul_mma.py`` ``plan_slices``): each
product shape of a transformer layer timed at every K-slice count, as a CUDA graph, on the GPU it runs on.

    python3 bench/gpu/split_sweep.py --out DIR [--seqs 32 64 128 256 512] [--formats fp16 tf32]
                                     [--weights-mb 160]

A model per (format, shape, slice count): independent products of one shape (the same input, different seeded
weights, each its own output), so that a graph replay runs them back to back as a layer's products run, and the
time per product (p50 of ``--iters`` replays over the copies) includes the gaps between kernels that a split
product's second (sum) kernel adds. As many copies as make ``--weights-mb`` of weights in the format (at least
``--copies``): more than the GPU's L2 (50 MB on an H100, 60 on an H200), so each replay streams them from
memory as a model's layers do. Session 38's sweep ran 8 copies whose 1-5 MB each stayed in L2 across replays:
products with few blocks looked cheaper there than in BERT-base (bench/gpu/RESULTS.md, session 38). Shapes per sequence length S (batch 1, BERT-base):
the projections [S, 768] x [768, 768], the FFN's [S, 768] x [768, 3072] and [S, 3072] x [3072, 768], and
attention's batched [12, S, 64] x [12, 64, S] and [12, S, S] x [12, S, 64]. Slice counts: 0 (the synchronous
estimate's choice, ``PtxTuning(mma_splits=0, mma_async_costs=(1, 1))``: the plans before session 38) and the
forced counts of ``--splits`` (a count the chunks do not allow falls back to that estimate's: the JSON records
the kernels each build got; bench/gpu/split_fit.py leaves those rows out). Formats: fp16 (``enable_fp16``) and
tf32 (``allow_tf32``). Writes ``split_sweep.json`` (one row per build) into ``--out``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

HIDDEN, FFN, HEADS, HEAD = 768, 3072, 12, 64


def shapes(seq: int):
    """(name, batch, M, K, N) of a BERT-base layer's products at sequence length ``seq``."""
    return [("proj", (), seq, HIDDEN, HIDDEN), ("ffn1", (), seq, HIDDEN, FFN), ("ffn2", (), seq, FFN, HIDDEN),
            ("scores", (HEADS,), seq, HEAD, seq), ("ctx", (HEADS,), seq, seq, HEAD)]


def product_model(batch, m: int, k: int, n: int, copies: int, seed: int = 0):
    """``copies`` products y_i = x @ w_i of one shape: w_i constant weights (2-D) or, batched, a second input
    per copy (attention's operands are activations)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*batch, m, k])]
    nodes, outputs, inits = [], [], []
    for i in range(copies):
        if batch:
            inputs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [*batch, k, n]))
        else:
            inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
                                                 f"w{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [*batch, m, n]))
    g = helper.make_graph(nodes, "products", inputs, outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build(job):
    """Worker: compile one job's bundle; returns the job with its plan's product kernels (or the error)."""
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-split-cache")
    try:
        from cuvil import Pipeline
        from cuvil.targets.ptx.bundle import compile_bundle
        from cuvil.targets.ptx.tuning import PtxTuning
        model = product_model(tuple(job["batch"]), job["m"], job["k"], job["n"], job["copies"])
        g = Pipeline.from_onnx(model).optimize().graph
        kw = {"enable_fp16": True} if job["fmt"] == "fp16" else {"allow_tf32": True}
        tuning = PtxTuning(mma_splits=job["splits"], mma_async_costs=(1.0, 1.0))   # the costs a forced count's
        compile_bundle(g, job["out"], arch=job["arch"], tuning=tuning, **kw)          # K groups come from too
        with open(os.path.join(job["out"], "plan.json")) as f:
            plan = json.load(f)
        job["kernels"] = [{"kind": k.get("kind"), "grid": k.get("grid"), "block": k.get("block")}
                          for k in plan["kernels"] if str(k.get("kind", "")).startswith("matmul")][:2]
        job["launches"] = len(plan["kernels"])
        return job
    except Exception:  # noqa: BLE001 - reported in the JSON
        job["error"] = traceback.format_exc()[-1500:]
        return job


def time_bundle(path: str, iters: int) -> dict:
    """p50 / min ms of graph replays on device-resident inputs and outputs."""
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    drv = driver()
    m = load_bundle(path)
    rng = np.random.default_rng(1)
    feeds = [rng.standard_normal(i["shape"]).astype(np.float32) for i in m.plan["inputs"]]
    ys = m.run(*feeds)
    d_in = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(x.nbytes, 1)))) for x in feeds]
    d_out = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(y.nbytes, 1)))) for y in ys]
    for d, x in zip(d_in, feeds):
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d, x.ctypes.data, x.nbytes))
    for _ in range(20):
        m.run_device(d_in, d_out, mode="graph")
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        m.run_device(d_in, d_out, mode="graph")
        ts.append(1e3 * (time.perf_counter() - t0))
    for d in d_in + d_out:
        drv.cuMemFree(d)
    m.close()
    return {"p50_ms": statistics.median(ts), "min_ms": min(ts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--formats", nargs="+", default=["fp16", "tf32"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--copies", type=int, default=8, help="at least this many products per model")
    ap.add_argument("--weights-mb", type=float, default=160.0, help="... and as many as make this many MB of "
                    "weights (0: --copies alone, session 38's sweep)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds over all builds (min of the p50s)")
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--arch", default=None, help="default: the GPU's")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: stop timing past this (the JSON keeps "
                    "what was timed)")
    ap.add_argument("--work", default="/tmp/split_sweep")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    arch = args.arch
    info = {}
    if arch is None:
        from cuvil.targets.ptx.runtime import device_info
        info = device_info(0)
        arch = info["arch"]
    jobs = []
    for fmt in args.formats:
        for seq in args.seqs:
            for name, batch, m, k, n in shapes(seq):
                per = (2 if fmt == "fp16" else 4) * k * n if not batch else 0    # batched: activations only
                copies = max(args.copies, math.ceil(args.weights_mb * 1e6 / per) if per and args.weights_mb else 0)
                for s in [0] + list(args.splits):
                    key = f"{fmt}_s{seq}_{name}_sk{s}"
                    jobs.append(dict(key=key, fmt=fmt, seq=seq, name=name, batch=list(batch), m=m, k=k, n=n,
                                     splits=s, copies=copies, arch=arch,
                                     out=os.path.join(args.work, key + ".cuvil")))
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        rows = list(pool.map(build, jobs))
    print(f"{len(rows)} builds in {time.perf_counter() - t0:.0f} s; "
          f"{sum('error' in r for r in rows)} failed", flush=True)
    for r in rows:
        if "error" in r:
            print(r["key"], r["error"][-400:], flush=True)
    def save():
        with open(os.path.join(args.out, "split_sweep.json"), "w") as f:
            json.dump({"device": info, "copies": args.copies, "weights_mb": args.weights_mb, "iters": args.iters,
                       "rows": rows}, f, indent=1)
    save()
    if not args.compile_only:
        for rnd in range(args.rounds):
            for r in (rows if rnd % 2 == 0 else rows[::-1]):
                if "error" in r or time.perf_counter() - t0 > args.budget:
                    continue
                t = time_bundle(r["out"], args.iters)
                r["p50_ms"] = min(r.get("p50_ms", 1e9), t["p50_ms"])
                r["min_ms"] = min(r.get("min_ms", 1e9), t["min_ms"])
        for r in rows:
            if "p50_ms" in r:
                print(f"{r['key']:28} {r['p50_ms'] * 1e3 / r['copies']:8.2f} us/product  "
                      f"{[k['kind'] + str(k['grid']) for k in r['kernels']]}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
