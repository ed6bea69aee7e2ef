"""Where a model's second thread goes: each step's in-kernel time at 1 and 2 threads (the runtime's step
profiler), their sums beside the wall-clock p50, and the steps that scale worst (largest time above half their
1-thread time) with their kernel, op, shape and register tile.

    PYTHONPATH=src python3 bench/thread_scaling.py squeezenet [--rounds 15] [--top 25]

The CPU model is printed first; a shared VM's timings are noisy, so read the ratios of steps of some size.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import LIGHT_MODELS, light_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"one of {', '.join(LIGHT_MODELS)}")
    ap.add_argument("--rounds", type=int, default=15, help="profiles of 5 runs each, per thread count")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    m = light_model(a.model, seed=0)
    art = Pipeline.from_onnx(m).optimize().compile()
    mod = art.model()
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    steps = art.manifest["steps"]
    print(cpu_label())
    prof = {}
    for t in (1, 2):
        mod.run(x, num_threads=t)
        rounds = []
        for _ in range(a.rounds):
            time.sleep(0.01)
            rounds.append(mod.profile(x, runs=5, num_threads=t))
        prof[t] = np.median(np.array(rounds), 0) * 1e3
        walls = []
        for _ in range(60):
            t0 = time.perf_counter()
            mod.run(x, num_threads=t)
            walls.append(time.perf_counter() - t0)
        print(f"{t} thread(s): steps sum {prof[t].sum():.3f} ms, wall p50 {np.median(walls) * 1e3:.3f} ms")
    p1, p2 = prof[1], prof[2]
    print(f"if every step halved: {p1.sum() / 2:.3f} ms; steps' 2-thread time above half their 1-thread time: "
          f"{(p2 - p1 / 2).sum():.3f} ms")
    print(f"{'step':>4} {'1 thr':>7} {'2 thr':>7} {'ratio':>6}  kernel, op, shape, tile")
    for k in np.argsort(-(p2 - p1 / 2))[:a.top]:
        s = steps[k]
        print(f"{k:4d} {p1[k]:7.3f} {p2[k]:7.3f} {p1[k] / max(p2[k], 1e-9):6.2f}  {s['kernel']}, {s['op']}, "
              f"{s['shape']}, {s.get('tile', '')}")


if __name__ == "__main__":
    main()
