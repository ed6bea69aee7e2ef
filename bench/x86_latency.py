"""Batch-1 latency of Cuvil's native libraries beside onnxruntime, in one process, on the light
architectures with seeded random weights.

    python3 bench/x86_latency.py                      # all nine models
    python3 bench/x86_latency.py resnet50 squeezenet --runs 20

For each model and thread count (1, 2): p50 and p99 of Cuvil and onnxruntime, their ratio, and Cuvil's
GFLOP/s (Conv/Gemm/MatMul FLOPs of the model / p50). Runs alternate between the two engines so machine
noise hits both alike. Timings on a shared 2-core machine are noisy: read ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline
from cuvil.testing import LIGHT_MODELS, light_model


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def bench_model(name: str, runs: int, threads: int, opt_level: int):
    m = light_model(name, seed=0)
    rng = np.random.default_rng(1)
    feeds = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
             for vi in m.graph.input}
    p = Pipeline.from_onnx(m).optimize()
    flops = p.stats().flops
    t0 = time.perf_counter()
    art = p.compile(opt_level=opt_level)
    compile_s = time.perf_counter() - t0
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    native = art.model()
    args = list(feeds.values())
    native.run(*args, num_threads=threads)
    sess.run(None, feeds)
    tc, to = [], []
    for _ in range(runs):
        t = time.perf_counter()
        native.run(*args, num_threads=threads)
        tc.append(time.perf_counter() - t)
        t = time.perf_counter()
        sess.run(None, feeds)
        to.append(time.perf_counter() - t)
    c50, c99, o50, o99 = (percentile(tc, 50), percentile(tc, 99), percentile(to, 50), percentile(to, 99))
    return {"model": name, "threads": threads, "cuvil_p50_ms": 1e3 * c50, "cuvil_p99_ms": 1e3 * c99,
            "ort_p50_ms": 1e3 * o50, "ort_p99_ms": 1e3 * o99, "ratio": c50 / o50,
            "gflops": flops / c50 / 1e9, "compile_s": compile_s if not art.cached else float("nan")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=list(LIGHT_MODELS))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--opt-level", type=int, default=3)
    a = ap.parse_args(argv)
    rows = []
    print(f"{'model':14} {'thr':>3} {'cuvil p50':>10} {'p99':>8} {'ort p50':>9} {'p99':>8} {'ratio':>7} {'GFLOP/s':>8}")
    for name in a.models:
        for t in a.threads:
            r = bench_model(name, a.runs, t, a.opt_level)
            rows.append(r)
            print(f"{name:14} {t:>3} {r['cuvil_p50_ms']:>8.2f}ms {r['cuvil_p99_ms']:>6.1f}ms {r['ort_p50_ms']:>7.2f}ms "
                  f"{r['ort_p99_ms']:>6.1f}ms {r['ratio']:>7.2f} {r['gflops']:>8.2f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"geometric mean of ratios (Cuvil / onnxruntime, lower is better): {statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    sys.exit(main())
