"""A/B of libraries of one CNN of ``cuvil.testing.light_model`` at 1 or 2 threads, every run after a 700 MB read
(no weight cached, as when other engines run in between) and an idle pause, the libraries interleaved run by run
(order reversed every other round). bench/knobs_ab.py measures one thread's CPU time; this measures wall time at
any thread count, and with ``--steps`` where it goes: each step's in-kernel time (the runtime's profiler) of
single runs after the read and the pause, beside runs after the pause alone.

    # libraries with a module constant of the x86 kernels changed (knobs_ab.KNOBS), built uncached:
    PYTHONPATH=src python3 bench/cold_ab.py --build resnet50 /tmp/base.so
    PYTHONPATH=src python3 bench/cold_ab.py --build resnet50 /tmp/off.so NEXT_CHUNK_PREFETCH=False
    PYTHONPATH=src python3 bench/cold_ab.py /tmp/base.so /tmp/off.so --threads 2 [--rounds 30]
    PYTHONPATH=src python3 bench/cold_ab.py /tmp/base.so --threads 2 --steps 12      # cold vs paused-warm steps

The CPU model is printed first; a shared VM's timings are noisy: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from knobs_ab import KNOBS  # noqa: E402


def build(model: str, out: str, knobs) -> None:
    os.environ["CUVIL_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuvil-cold-ab-")   # the constants are not in the key
    from cuvil import Pipeline
    from cuvil.testing import light_model
    for kv in knobs:
        name, _, expr = kv.partition("=")
        if name not in KNOBS:
            raise SystemExit(f"unknown knob {name!r}; one of {', '.join(KNOBS)}")
        setattr(KNOBS[name], name, eval(expr, {}))
    art = Pipeline.from_onnx(light_model(model, seed=0)).optimize().compile()
    shutil.copy(art.path, out)
    shutil.copy(art.path[:-3] + ".manifest.json", out[:-3] + ".manifest.json")
    print(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="*")
    ap.add_argument("--build", nargs="+", metavar="ARG", help="MODEL OUT.so [KNOB=EXPR ...]: build one library")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--pause-ms", type=float, default=100)
    ap.add_argument("--steps", type=int, default=0, metavar="R",
                    help="instead: R rounds of per-step profiles of the first library, cold and paused-warm")
    a = ap.parse_args(argv)
    if a.build:
        if len(a.build) < 2:
            ap.error("--build MODEL OUT.so [KNOB=EXPR ...]")
        build(a.build[0], a.build[1], a.build[2:])
        return 0
    if not a.libs:
        ap.error("give libraries, or --build")
    from cuvil.targets.x86.cpu import cpu_label
    from cuvil.targets.x86.loader import load
    print(f"{cpu_label()} | {a.threads} thread(s) | load {os.getloadavg()[0]:.2f}")
    libs = [load(p, num_threads=a.threads) for p in a.libs]
    shape = json.load(open(a.libs[0][:-3] + ".manifest.json"))["inputs"][0]["shape"]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    big = np.ones(700 << 18, np.float32)
    evict = lambda: float(big.sum())                  # noqa: E731
    pause = a.pause_ms / 1e3
    if a.steps:
        man = json.load(open(a.libs[0][:-3] + ".manifest.json"))
        acc = {"cold": [], "warm": []}
        for _ in range(a.steps):
            for k in ("cold", "warm"):
                if k == "cold":
                    evict()
                time.sleep(pause)
                acc[k].append(np.array(libs[0].profile(x, runs=1, num_threads=a.threads, warm_up=False)))
        med = {k: 1e3 * np.median(np.stack(v), axis=0) for k, v in acc.items()}
        print(f"steps sum (median of {a.steps} single runs after the pause): cold {med['cold'].sum():.2f} ms, "
              f"warm {med['warm'].sum():.2f} ms")
        d = med["cold"] - med["warm"]
        for i in np.argsort(-d)[:12]:
            s = man["steps"][i]
            print(f"  step {i:3} cold {med['cold'][i]:6.3f} warm {med['warm'][i]:6.3f} ms  {s['kernel']} {s['op']} "
                  f"{s['shape']} {s.get('tile', '')}")
        return 0
    outs = [lib.run(x)[0] for lib in libs]
    for lib in libs:
        lib.run(x)
    res = [[] for _ in libs]
    for i in range(a.rounds):
        for j in (range(len(libs)) if i % 2 == 0 else reversed(range(len(libs)))):
            evict()
            time.sleep(pause)
            t0 = time.perf_counter()
            libs[j].run(x)
            res[j].append(1e3 * (time.perf_counter() - t0))
    base = statistics.median(res[0])
    for p, r in zip(a.libs, res):
        print(f"  {p:36} p50 {statistics.median(r):7.2f} ms  min {min(r):7.2f}  x{statistics.median(r) / base:.3f}")
    print("outputs bit-identical to the first library's:", all(np.array_equal(outs[0], o) for o in outs[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
