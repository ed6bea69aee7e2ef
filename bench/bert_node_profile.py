"""BERT-base (``cuvil.testing.hf_models``, seeded weights) at one sequence length, 1 thread: onnxruntime's per-node
times summed by op type (its profiler) beside Cuvil's kernel times summed by kernel kind (the runtime's step
profiler), with both engines' wall p50 over runs alternated in one process. Where BERT's time goes in each
engine: the dense products (MatMul / ``gemm``) against everything else.

    PYTHONPATH=src python3 bench/bert_node_profile.py LIB.so --seq 128 [--runs 5]

``LIB.so``: a BERT library for B = 1..8, S = 1..512 (``bench/bert_wall_gap.py`` builds one). The CPU model is
printed first; a shared VM's timings are noisy: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import numpy as np
import onnxruntime as ort

from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.loader import load
from cuvil.testing.hf_models import BERT_BASE, bert_model, text_feeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args(argv)
    m = bert_model(**BERT_BASE)
    feeds = text_feeds(m, 1, a.seq)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="cuvil-ort-prof-"), "bert")
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    lib = load(a.lib, num_threads=1)
    man = json.load(open(a.lib[:-3] + ".manifest.json"))
    mine = {k: v for k, v in feeds.items() if k in {x.name for x in lib.inputs}}
    print(f"{cpu_label()} | 1 thread | S = {a.seq}")
    warm = 2
    for _ in range(warm):
        sess.run(None, feeds)
        lib.run(**mine)
    wo, wc = [], []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        wo.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        lib.run(**mine)
        wc.append(time.perf_counter() - t0)
    events = json.load(open(sess.end_profiling()))
    by = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"] / 1e3 / (a.runs + warm)
    t = np.array(lib.profile(runs=3, num_threads=1, **mine))
    kinds = collections.defaultdict(float)
    for x, st in zip(t, man["steps"]):
        if x > 0:
            kinds[f"{st['kernel']} {st['op']}"] += 1e3 * x
    ow, cw = 1e3 * statistics.median(wo), 1e3 * statistics.median(wc)
    print(f"wall p50: onnxruntime {ow:.2f} ms, Cuvil {cw:.2f} ms ({cw / ow:.3f})")
    print(f"onnxruntime nodes {sum(by.values()):.2f} ms a run:")
    for k, v in sorted(by.items(), key=lambda kv: -kv[1]):
        if v >= 0.05:
            print(f"  {k:30} {v:8.2f}")
    print(f"Cuvil kernels {sum(kinds.values()):.2f} ms a run:")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        if v >= 0.05:
            print(f"  {k:40} {v:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
