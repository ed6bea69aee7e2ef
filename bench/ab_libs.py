"""A/B of two compiled libraries of the same model in one process, alternating run by run with an idle pause
before each run (the way bench/run_all.py times them), reporting p50/p90/p99/max of each. This is how the
runtime changes' 2-thread tail figures were measured (old and new runtime, same model).

    # two builds of one model, e.g. the previous commit's in a worktree:
    git worktree add /tmp/old HEAD~1
    (cd /tmp/old && CUVIL_CACHE_DIR=/tmp/old-cache PYTHONPATH=src python3 -c "from cuvil import Pipeline; \\
        from cuvil.testing import light_model; \\
        print(Pipeline.from_onnx(light_model('shufflenet')).optimize().compile().path)")
    python3 -c "from cuvil import Pipeline; from cuvil.testing import light_model; \\
        print(Pipeline.from_onnx(light_model('shufflenet')).optimize().compile().path)"
    python3 bench/ab_libs.py OLD.so NEW.so [--runs 60] [--threads 2] [--pause-ms 150]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from cuvil.targets.x86.loader import load


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-ms", type=float, default=150)
    args = ap.parse_args(argv)
    libs = {"A": load(args.a, num_threads=args.threads), "B": load(args.b, num_threads=args.threads)}
    xs = [np.random.default_rng(0).standard_normal(d.shape).astype(d.dtype) for d in libs["A"].inputs]
    for m in libs.values():
        for _ in range(3):
            m.run(*xs)
    times = {k: [] for k in libs}
    for i in range(args.runs):
        order = list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]
        for k, m in order:
            time.sleep(args.pause_ms / 1e3)
            t0 = time.perf_counter()
            m.run(*xs)
            times[k].append((time.perf_counter() - t0) * 1e3)
    for k, path in (("A", args.a), ("B", args.b)):
        v = np.array(times[k])
        print(f"{k} p50 {np.median(v):.2f} p90 {np.percentile(v, 90):.2f} p99 {np.percentile(v, 99):.2f} "
              f"max {v.max():.2f} ms  {path}")


if __name__ == "__main__":
    main()
