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
    python3 bench/ab_libs.py OLD.so NEW.so [--runs 60] [--threads 2] [--pause-ms 150] [--kinds 5]

``--kinds R``: then R alternating rounds of the step profiler on each (10 back-to-back runs a round), printing
the time per kernel kind (the best round of each) from the manifest's step names.

Both libraries are first copied (with their manifests) to fresh files in one temporary directory, and loaded
from there (``--in-place``: where they are). Session 38 (Zen 4): two copies of libraries written minutes apart
differed by up to 3% on steps that a change could not touch, the page cache holding their weights differently
(see also bench/weights_pages.py); an A/B that read 0.982x in place read 0.997x / 1.001x (both orders) from fresh
copies.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict

import numpy as np

from cuvil.targets.x86.loader import load, manifest_path


def fresh_copy(so: str, dest: str) -> str:
    """``so`` and its manifest copied to ``dest`` (a ``libNAME.so`` path), written now: both arms of an A/B
    then start from the same page-cache state."""
    shutil.copyfile(so, dest)
    shutil.copyfile(manifest_path(so), manifest_path(dest))
    return dest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-ms", type=float, default=150)
    ap.add_argument("--kinds", type=int, default=0, metavar="R", help="rounds of the per-kernel-kind profile")
    ap.add_argument("--in-place", action="store_true", help="load the libraries where they are (no fresh copies)")
    args = ap.parse_args(argv)
    if not args.in_place:
        tmp = tempfile.mkdtemp(prefix="ab-libs-")
        atexit.register(shutil.rmtree, tmp, True)
        args.a, args.b = (fresh_copy(p, os.path.join(tmp, f"lib{k}.so")) for k, p in (("A", args.a), ("B", args.b)))
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
    if args.kinds:
        kinds(libs, {"A": args.a, "B": args.b}, xs, args.kinds, args.threads)


def kinds(libs, paths, xs, rounds, threads):
    prof = {k: [] for k in libs}
    for i in range(rounds):
        for k, m in (list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]):
            prof[k].append(m.profile(*xs, runs=10, num_threads=threads))
    per = {}
    for k in libs:
        with open(manifest_path(paths[k])) as f:
            steps = json.load(f)["steps"]
        best = np.array(prof[k]).min(0)
        per[k] = defaultdict(float)
        for st, t in zip(steps, best):
            per[k][st["kernel"]] += 1e3 * t
        per[k]["total"] = 1e3 * best.sum()
    print(f"{'kernel kind (ms, best round)':28} {'A':>9} {'B':>9}  B/A")
    for kind in sorted(set(per["A"]) | set(per["B"]), key=lambda n: (n == "total", -per["A"].get(n, 0))):
        a, b = per["A"].get(kind, 0.0), per["B"].get(kind, 0.0)
        print(f"{kind:28} {a:9.3f} {b:9.3f}  {b / a if a else float('nan'):.3f}")


if __name__ == "__main__":
    main()
