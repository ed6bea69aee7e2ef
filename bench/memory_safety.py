"""Memory-safety figures: how many kernels of the nine light models and of transformer blocks are proved in
bounds at compile time, how many accesses that covers and what the proofs cost.

    PYTHONPATH=src python bench/memory_safety.py              # full compiles (slow on 2 cores), writes
                                                              # bench/MEMORY_SAFETY.md
    PYTHONPATH=src python bench/memory_safety.py --only resnet50 transformer

Each model is compiled as `cuvil compile` does (x86, O3, Winograd where chosen, opt-point kernels beside the
generic ones for symbolic models) and the figures are read from the manifest's ``memory_safety`` record.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from cuvil import Pipeline
from cuvil.bench import host_info
from cuvil.testing import LIGHT_MODELS, light_model
from cuvil.testing.models import transformer_block

# transformer blocks: (name, model, shape profile)
TRANSFORMERS = {
    "transformer_d32": (lambda: transformer_block(d_model=32, heads=4, d_ff=64, seed=0),
                        {"B": (1, 2, 8), "S": (1, 16, 64)}),
    "transformer_d256": (lambda: transformer_block(d_model=256, heads=8, d_ff=1024, seed=0),
                         {"B": (1, 1, 16), "S": (1, 128, 512)}),
}


def measure(name: str) -> dict:
    if name in TRANSFORMERS:
        make, profile = TRANSFORMERS[name]
        p = Pipeline.from_onnx(make()).optimize()
    else:
        p, profile = Pipeline.from_onnx(light_model(name, seed=0)).optimize(), None
    t0 = time.perf_counter()
    art = p.compile(shape_profiles=profile, cache=False)
    wall = time.perf_counter() - t0
    try:
        ms = art.manifest["memory_safety"]
        return {"model": name, "kernels": ms["kernels"], "proved": ms["kernels_proved"],
                "guarded": len(ms["guarded"]), "accesses": ms["accesses"], "queries": ms["z3_queries"],
                "cache_hits": ms["cache_hits"], "proof_s": art.timings["proof_seconds"], "compile_s": wall,
                "arena_mb": art.manifest["arena_bytes"] / 2 ** 20,
                "unproved": [f"{g['stage']}: {g['unproved'][0]}" for g in ms["guarded"]]}
    finally:
        shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="models (light model names, or transformer for both blocks)")
    ap.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "MEMORY_SAFETY.md"))
    args = ap.parse_args(argv)
    names = list(LIGHT_MODELS) + list(TRANSFORMERS)
    if args.only:
        names = [n for n in names if n in args.only or (n in TRANSFORMERS and "transformer" in args.only)]
    rows = []
    for name in names:
        row = measure(name)
        rows.append(row)
        print(f"{name}: {row['proved']}/{row['kernels']} proved, {row['accesses']} accesses, "
              f"{row['proof_s']:.2f} s of {row['compile_s']:.1f} s", flush=True)
    total_k = sum(r["kernels"] for r in rows)
    total_p = sum(r["proved"] for r in rows)
    lines = ["# Memory safety: kernels proved in bounds", "",
             "Made by `PYTHONPATH=src python bench/memory_safety.py` (see docs/memory-safety.md). A kernel counts",
             "once per variant (symbolic models: the generic kernels and the opt-point ones). Proof seconds are",
             "part of compile seconds.", "",
             "| model | kernels | proved | guarded | accesses | Z3 queries | cache hits | proof s | compile s | arena MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kernels']} | {r['proved']} | {r['guarded']} | {r['accesses']} | "
                     f"{r['queries']} | {r['cache_hits']} | {r['proof_s']:.2f} | {r['compile_s']:.1f} | "
                     f"{r['arena_mb']:.1f} |")
    pct = 100.0 * total_p / max(total_k, 1)
    lines += ["", f"**{total_p}/{total_k} kernels proved ({pct:.2f}%)**; proofs "
              f"{sum(r['proof_s'] for r in rows):.1f} s of {sum(r['compile_s'] for r in rows):.1f} s compiling "
              f"(machine: {host_info()['cpu']}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
              f"{time.strftime('%Y-%m-%d', time.gmtime())})."]
    unproved = [u for r in rows for u in r["unproved"]]
    if unproved:
        lines += ["", "Guarded kernels:", ""] + [f"- {u}" for u in unproved]
    with open(args.output, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{total_p}/{total_k} kernels proved ({pct:.2f}%); wrote {args.output}")


if __name__ == "__main__":
    main()
