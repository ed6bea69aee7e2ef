"""Where BERT-base's GPU time goes, from a ``tensor_cores.py --parts bert`` result (``tensor_cores.json``):
per variant the graph p50 and every kernel's eager event time (``all_kernels``) summed over the 12 layers by
stage (the layer index dropped), largest first.

    python3 bench/gpu/bert_kernels.py DIR/tensor_cores.json [--min-ms 0.005]

The event times include each launch's host gap (a few µs, bench/gpu/RESULTS.md "Launch overhead"), so their
sum exceeds the graph p50; the ranking is what they are for.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def by_stage(kernels):
    agg = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        key = (k["kind"], re.sub(r"layer\.\d+\.", "layer.*.", k.get("stage") or k["name"]))
        agg[key][0] += 1
        agg[key][1] += k["ms"]
    return sorted(((ms, n, kind, stage) for (kind, stage), (n, ms) in agg.items()), reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--min-ms", type=float, default=0.005)
    args = ap.parse_args(argv)
    bert = json.load(open(args.json))["bert"]
    for label, r in bert.items():
        if not isinstance(r, dict) or "p50_ms" not in r:
            continue
        ks = r.get("all_kernels") or []
        kinds = defaultdict(float)
        for k in ks:
            kinds[k["kind"]] += k["ms"]
        print(f"== {label}: graph p50 {r['p50_ms']:.3f} ms" + (f", {len(ks)} kernels, event sum "
              f"{sum(k['ms'] for k in ks):.3f} ms ({', '.join(f'{k} {v:.3f}' for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))})"
              if ks else "") + (f", error vs ort {['%.1e' % e for e in r['normwise_vs_ort']]}" if "normwise_vs_ort" in r else ""))
        for ms, n, kind, stage in by_stage(ks):
            if ms >= args.min_ms:
                print(f"   {ms:7.4f} ms  x{n:<3d} {kind:12s} {stage}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
