"""Registers and theoretical occupancy of every kernel of a GPU bundle, from ``ptxas -v`` (no GPU needed).

    python3 bench/gpu/occupancy.py resnet50                 # compile the light model, report
    python3 bench/gpu/occupancy.py --bundle build/resnet50.cuvil --json occ.json

Occupancy on sm_90 (the H100/H200 limits): 65,536 registers per SM allocated per warp in units of 256,
at most 2,048 threads = 64 warps and 32 blocks per SM. Blocks per SM = min(by registers, by warps, 32);
occupancy = resident warps / 64. ``fill`` is how much of the whole GPU (132 SMs on an H200) the kernel's
grid can occupy at that residency: a small grid leaves SMs idle however good the occupancy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"))

from cuvil.targets.ptx.regpressure import LIMITS, SMS, occupancy  # noqa: E402  (one formula: the pass's)

SM90 = {**LIMITS["sm_90"], "max_threads": 2048, "sms": SMS["sm_90"]}


def report(bundle: str, limits=SM90) -> list:
    with open(os.path.join(bundle, "plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(bundle, "manifest.json")) as f:
        man = json.load(f)
    info = (man.get("ptxas") or {}).get("kernels")
    if not info:
        raise SystemExit(f"{bundle}: no ptxas report in the manifest (ptxas was not found at compile time)")
    rows = []
    for k in plan["kernels"]:
        r = info[k["name"]]
        occ = occupancy(r["registers"], k["block"][0], limits, r.get("shared") or 0)
        resident = occ["blocks_per_sm"] * limits["sms"]
        rows.append({"name": k["name"], "stage": k["stage"], "n": k["n"], "grid": k["grid"][0], "block": k["block"][0],
                     "registers": r["registers"], "spill_stores": r["spill_stores"], **occ,
                     "fill": min(1.0, k["grid"][0] / resident) if resident else 0.0})
    return rows


def print_report(rows, title: str) -> None:
    import statistics
    print(f"{title}: {len(rows)} kernels; registers/thread min {min(r['registers'] for r in rows)}, "
          f"median {statistics.median(r['registers'] for r in rows)}, max {max(r['registers'] for r in rows)}; "
          f"spill stores {sum(r['spill_stores'] for r in rows)} B")
    hist = {}
    for r in rows:
        hist[r["occupancy"]] = hist.get(r["occupancy"], 0) + 1
    print("  theoretical occupancy (sm_90, 256-thread blocks): "
          + ", ".join(f"{100 * o:.0f}%: {n} kernels" for o, n in sorted(hist.items(), reverse=True)))
    small = [r for r in rows if r["fill"] < 0.5]
    print(f"  kernels whose grid fills less than half the GPU at that occupancy: {len(small)}")
    print(f"  {'kernel':12} {'stage':28} {'n':>9} {'grid':>6} {'regs':>4} {'blk/SM':>6} {'occ':>5} {'fill':>5} limiter")
    for r in rows:
        print(f"  {r['name']:12} {r['stage'][:28]:28} {r['n']:9d} {r['grid']:6d} {r['registers']:4d} "
              f"{r['blocks_per_sm']:6d} {100 * r['occupancy']:4.0f}% {100 * r['fill']:4.0f}% {r['limiter']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["resnet50"])
    ap.add_argument("--bundle", help="report this bundle instead of compiling light models")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = {}
    if args.bundle:
        out[args.bundle] = report(args.bundle)
        print_report(out[args.bundle], args.bundle)
    else:
        from cuvil import Pipeline
        from cuvil.testing import light_model
        for name in args.models:
            b = Pipeline.from_onnx(light_model(name)).optimize().compile("nvptx64-nvidia-cuda", arch=args.arch,
                                                                         cache=False)
            out[name] = report(b.path)
            print_report(out[name], f"light {name} ({args.arch}, {b.manifest['ptxas']['ptxas']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
