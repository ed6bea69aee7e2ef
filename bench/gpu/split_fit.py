"""The split-K estimate of the cp.async products (``PtxTuning.mma_async_costs``) against the sweep of
bench/gpu/split_sweep.py, no GPU needed:

    python3 bench/gpu/split_fit.py bench/gpu/results/session38/split_sweep_h100.json [--fit] [--formats fp16 tf32]

For each product shape of the sweep (the 2-D ones: attention's batched products never split), the time per
product at every forced K-slice count the chunks allow (rows whose count fell back to the estimate's plan are
left out), the slice count the shipped costs pick and its measured time, the synchronous estimate's pick (costs
(1, 1): the plan before session 38, the sweep's "sk0" builds), and the best measured. A forced count ``s`` was
built with the K groups the synchronous estimate gives ``s``; a pick is looked up only where the shipped
costs' groups for it are those (else "unmeasured"). ``--fit``: a grid search over (round, sum) costs on the
sweep alone, total time of the picks, least first. Its best (a round at 0.4) is not what ships: the sweep's
weights stayed in L2 across replays, and whole BERT-base at S = 32 ran slower with its choices
(``matmul_mma.plan_slices`` says why).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

from cuvil.targets.ptx.matmul_mma import TK, block_tile, plan_slices  # noqa: E402
from cuvil.targets.ptx.tuning import DEFAULT_TUNING  # noqa: E402

STAGES = {"fp16": 3, "tf32": 1}     # the sweep's builds: cp.async (PtxTuning.mma_async = 3) for float16 only
SYNC = (1.0, 1.0)                   # the synchronous estimate's costs (a round, the sum kernel)
GROUPS, MAX_KS, SMS = 4, 4, 132     # PtxTuning's mma_sm_groups / mma_max_ks, the H100's and H200's SMs


def shapes(path: str):
    with open(path) as f:
        d = json.load(f)
    times, info = collections.defaultdict(dict), {}
    for r in d["rows"]:
        if "p50_ms" in r and not r["batch"]:
            key = (r["fmt"], r["seq"], r["name"])
            times[key][r["splits"]] = 1e3 * r["p50_ms"] / r.get("copies", d["copies"])
            info[key] = r
    return times, info


def picks(times, info, fmt: str, costs=DEFAULT_TUNING.mma_async_costs):
    """Per shape: (key, measured times of the counts its chunks allow and of "sk0", pick of ``costs``, pick of
    the synchronous estimate)."""
    out = []
    for key in sorted(k for k in times if k[0] == fmt):
        r = info[key]
        bm, bn = block_tile(1, r["m"], r["n"])
        tiles, chunks = -(-r["m"] // bm) * -(-r["n"] // bn), -(-r["k"] // TK)
        args = (fmt, bm, bn, tiles, chunks, MAX_KS, GROUPS, SMS, STAGES[fmt])
        built = {s: plan_slices(*args, only=s, async_costs=SYNC)[:2] for s in times[key] if s}
        t = {s: v for s, v in times[key].items() if not s or built[s][1] == s}     # fallback rows left out
        ks, s, _ = plan_slices(*args, async_costs=costs)
        pick = s if s in t and built[s][0] == ks else None
        out.append((key, t, pick, plan_slices(*args, async_costs=SYNC)[1]))
    return out


def report(times, info, fmt: str, verbose: bool = True, costs=DEFAULT_TUNING.mma_async_costs):
    tot = {"shipped": 0.0, "synchronous": 0.0, "best": 0.0}
    missing = 0
    for key, t, pick, sync in picks(times, info, fmt, costs):
        best = min(v for s, v in t.items() if s)
        if pick is None:
            missing += 1
        tot["shipped"] += t.get(pick, float("nan")) if pick else float("nan")
        tot["synchronous"] += t[0]
        tot["best"] += best
        if verbose:
            row = " ".join(f"{s}:{v:.1f}" for s, v in sorted(t.items()) if s)
            shown = f"{t[pick]:6.2f} (sk{pick})" if pick else "unmeasured"
            print(f"{key[0]} S={key[1]:<4d} {key[2]:5s} shipped {shown:>14}  synchronous {t[0]:6.2f} (sk{sync})  "
                  f"best {best:6.2f}  | {row}")
    return tot, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("--formats", nargs="+", default=["fp16"])
    ap.add_argument("--fit", action="store_true")
    args = ap.parse_args(argv)
    times, info = shapes(args.sweep)
    for fmt in args.formats:
        tot, missing = report(times, info, fmt)
        print(f"{fmt}: us per product summed over the shapes: shipped {tot['shipped']:.1f}, synchronous estimate "
              f"{tot['synchronous']:.1f}, best measured {tot['best']:.1f}" + (f" ({missing} picks unmeasured)"
                                                                             if missing else ""))
        if args.fit and STAGES[fmt] > 1:
            grid = []
            for rnd in (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0):
                for ssum in (0.5, 1, 2, 4, 6, 8, 10, 12, 16):
                    t, miss = report(times, info, fmt, verbose=False, costs=(rnd, ssum))
                    if not miss:
                        grid.append((t["shipped"], rnd, ssum))
            for total, rnd, ssum in sorted(grid)[:8]:
                print(f"  mma_async_costs ({rnd}, {ssum}): {total:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
