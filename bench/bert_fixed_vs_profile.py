"""BERT-base at B = 1, 1 thread: the library built for this one shape beside the one library for the whole
profile (B 1..8, S 1..512, as bench/run_all.py builds it) and onnxruntime, in one process.

Does serving every shape from one library cost speed? Blocks of ``--per`` runs per engine (the order reversed
every other block), thread CPU time, the median of each block, then the median over blocks. On a shared VM
whole blocks run 30% slower when a neighbour is busy: read the per-block lines as well as the medians.

    PYTHONPATH=src python3 bench/bert_fixed_vs_profile.py --seq 128 [--blocks 7] [--per 5] [--dir /tmp/bert-libs]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.loader import load
from cuvil.testing.hf_models import BERT_BASE, BERT_PROFILE, bert_model, text_feeds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import ort_runner, ort_session, time_blocks  # noqa: E402 - bench/ is no package


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--per", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/cuvil-bert-libs", help="where the two libraries are built (reused)")
    a = ap.parse_args(argv)
    S = a.seq
    os.makedirs(a.dir, exist_ok=True)
    m = bert_model(**BERT_BASE)
    feeds = text_feeds(m, 1, S)
    libs = {}
    for name, prof in [("profile", BERT_PROFILE), ("fixed", {"batch": (1, 1, 1), "sequence": (S, S, S)})]:
        so = os.path.join(a.dir, f"bert_{name}_{S}.so")
        if not os.path.exists(so):
            t0 = time.time()
            Pipeline.from_onnx(m).optimize().compile(shape_profiles=prof).save(so)
            print(f"{name}: compiled in {time.time() - t0:.1f} s", flush=True)
        libs[name] = load(so, num_threads=1)

    def runner(lib):
        args = [feeds[d.name] for d in lib.inputs]
        return lambda: lib.run(*args)
    eng = {"profile": runner(libs["profile"]), "fixed": runner(libs["fixed"]),
           "ort": ort_runner(ort_session(m, 1), feeds)}
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(eng["profile"](), eng["fixed"]()))
    print(f"{cpu_label()}; S = {S}; max |profile - fixed| = {diff:g}")
    for e in eng.values():
        e()
        e()
    res = time_blocks(eng, a.blocks, a.per, clock=time.thread_time, log=lambda blk, r: print(
        f"block {blk}: " + ", ".join(f"{k} {r[k][-1]:.1f}" for k in eng) + " ms", flush=True))
    med = {k: statistics.median(v) for k, v in res.items()}
    print("medians (thread CPU ms): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(f"profile / fixed {med['profile'] / med['fixed']:.3f}; profile / onnxruntime {med['profile'] / med['ort']:.3f}; "
          f"fixed / onnxruntime {med['fixed'] / med['ort']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
