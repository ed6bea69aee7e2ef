"""What one small compile costs, phase by phase, this checkout against another revision, side by side.

A "small compile" is what the ONNX node conformance cases are (tests/test_onnx_conformance.py, ~1,450 compiles
in the gate) and what a user's tiny graph is: import, optimise, schedule, LLVM, the C compiler and linker, ldd,
SBOM and provenance, load, run. Each block is a fresh process with its own empty artifact cache that compiles a
fixed sample of the listed passing cases at the conformance test's ``opt_level=1`` (after one warm-up compile,
which fills the cached runtime objects as a conformance worker's first case does); blocks of the two sources
alternate, and the medians of the per-case CPU (the process's own + its children's: ``cc``, ``ld``, ``ldd``)
are compared. Phase times come from timers wrapped around the compiler's functions (thread CPU + children).

    PYTHONPATH=src python3 bench/small_compile.py [--base main] [--blocks 3] [--cases 60] [--seed 1]

``--base REV``: the other side (default: where this branch left main), its ``src/`` and ``rules/`` exported with
``git archive`` into a temporary directory (``--base none``: this checkout only).
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: (module, attribute, label): the phases timed (present in every revision this bench compares).
PHASES = [
    ("cuvil.pipeline", "Pipeline.from_onnx", "import (from_onnx)"),
    ("cuvil.pipeline", "Pipeline.optimize", "optimize"),
    ("cuvil.targets.x86.codegen", "KernelModule.compile_parts", "LLVM (passes + object emission)"),
    ("cuvil.targets.x86.compile", "generate_object", "codegen (IR + LLVM)"),
    ("cuvil.targets.x86.compile", "link_shared", "cc (compile model.c + link)"),
    ("cuvil.targets.x86.compile", "check_dependencies", "ldd"),
    ("cuvil.supply_chain.record", "write_sbom", "SBOM (CycloneDX)"),
    ("cuvil.supply_chain.record", "write_provenance", "provenance"),
    ("cuvil.pipeline", "Pipeline.compile", "compile (all of the above but import/optimize)"),
]


def _worker(n: int, seed: int) -> dict:
    warnings.simplefilter("ignore")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import numpy as np
    np.seterr(all="ignore")
    from test_onnx_conformance import collect_cases, expected_pass, run_case

    times = collections.defaultdict(lambda: [0.0, 0])

    def wrap(modname, attr, label):
        obj = importlib.import_module(modname)
        *path, name = attr.split(".")
        for p in path:
            obj = getattr(obj, p)
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a, **k):
            c0, r0 = time.thread_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            try:
                return f(*a, **k)
            finally:
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                t = times[label]
                t[0] += time.thread_time() - c0 + (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
                t[1] += 1
        setattr(obj, name, timed)

    for modname, attr, label in PHASES:
        wrap(modname, attr, label)
    rng = random.Random(seed)
    names = rng.sample(expected_pass(), n + 1)
    cases = collect_cases()

    def one(name):
        c = cases[name]
        r = run_case(c.model.SerializeToString(), c.data_sets, c.rtol, c.atol)
        if r.status != "pass":
            raise SystemExit(f"{name}: {r.status}: {r.detail[:400]}")

    one(names[0])                   # warm-up: the cached runtime objects, as a conformance worker's first case
    times.clear()
    r0, c0, w0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time(), time.perf_counter()
    for name in names[1:]:
        one(name)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cases": n, "self_ms": (time.process_time() - c0) / n * 1e3,
            "children_ms": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / n * 1e3,
            "wall_ms": (time.perf_counter() - w0) / n * 1e3,
            "phases_ms": {k: v[0] / n * 1e3 for k, v in times.items()}}


def _block(src: str, n: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="cuvil-small-compile-") as cache:
        env = {**os.environ, "PYTHONPATH": src, "CUVIL_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--cases", str(n),
                              "--seed", str(seed)], env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"block failed ({src}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="merge-base", help="git revision to compare against, 'merge-base' (of main and "
                                                         "HEAD: this branch's starting point) or 'none'")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--cases", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.cases, args.seed)))
        return
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from cuvil.targets.x86.cpu import cpu_label
    sides = {"this checkout": os.path.join(ROOT, "src")}
    tmp = None
    if args.base == "merge-base":
        args.base = subprocess.run(["git", "merge-base", "main", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                   check=True).stdout.strip()[:12]
    if args.base != "none":
        tmp = tempfile.mkdtemp(prefix="cuvil-base-")
        archive = subprocess.run(["git", "archive", args.base, "src", "rules"], cwd=ROOT, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        sides = {f"base {args.base}": os.path.join(tmp, "src"), **sides}
    print(f"CPU: {cpu_label()}; {os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.2f}")
    print(f"{args.cases} listed conformance cases a block (seed {args.seed}), opt_level=1, {args.blocks} blocks a side, "
          f"interleaved; per case, medians over blocks")
    runs = {k: [] for k in sides}
    try:
        for b in range(args.blocks):
            for label, src in sides.items():
                r = _block(src, args.cases, args.seed)
                runs[label].append(r)
                print(f"  block {b + 1} {label}: self {r['self_ms']:.1f} + children {r['children_ms']:.1f} ms CPU, "
                      f"wall {r['wall_ms']:.1f} ms", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    med = lambda label, f: statistics.median(f(r) for r in runs[label])
    labels = list(sides)
    phases = [p[2] for p in PHASES]
    print(f"\n{'per case, ms of CPU':48s}" + "".join(f"{k:>22s}" for k in labels)
          + ("   ratio" if len(labels) == 2 else ""))
    rows = [("total (self + children)", lambda r: r["self_ms"] + r["children_ms"]),
            ("  children (cc, ld, ldd)", lambda r: r["children_ms"]), ("wall", lambda r: r["wall_ms"])]
    rows += [(f"  {p}", (lambda p: lambda r: r["phases_ms"].get(p, 0.0))(p)) for p in phases]
    for name, f in rows:
        vals = [med(k, f) for k in labels]
        ratio = f"   {vals[1] / vals[0]:.3f}" if len(vals) == 2 and vals[0] else ""
        print(f"{name:48s}" + "".join(f"{v:22.1f}" for v in vals) + ratio)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
