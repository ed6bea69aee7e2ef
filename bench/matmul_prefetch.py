"""The float32 MatMul k-loop's weight prefetch distance (``cuvil.targets.x86.matmul.MATMUL_PREFETCH_K``, rows of
the weight panel ahead) side by side with onnxruntime: BERT-base's dense layers ``x[S, K] @ W[K, N] + bias``
((K, N) = (768, 768), (768, 3072), (3072, 768)), or BERT at BERT-base width with N layers.

    PYTHONPATH=src python3 bench/matmul_prefetch.py [--distances 128,32] [--seqs 32,128,384] [--rounds 9]
    PYTHONPATH=src python3 bench/matmul_prefetch.py --bert-layers 2 --distances 128,32

The distance is a module constant (like ``NEXT_PANEL_PREFETCH`` beside it): set before each compile, one
library per distance for S = 1..512 (BERT: B 1..8, S 1..512), restored after. One thread; per engine the
calling thread's CPU time (``time.thread_time``) of a batch of runs, engines alternating in order and reverse,
p50 of the rounds. Prints GFLOP/s (dense layers) or ms (BERT) and each time over onnxruntime's, the CPU and
the load average.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from cuvil import Pipeline, load
from cuvil.targets.x86 import matmul
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.hf_models import BERT_PROFILE, bert_model

from matmul_tiles import compare, dense        # bench/ is the script's own directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distances", default="128,32", help="rows ahead, comma-separated")
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--bert-layers", type=int, default=0, help="time BERT-base width with this many layers instead")
    a = ap.parse_args(argv)
    distances = [int(d) for d in a.distances.split(",")]
    seqs = [int(s) for s in a.seqs.split(",")]
    print(f"{cpu_label()}; 1 thread, CPU time p50 of {a.rounds} rounds; load average {os.getloadavg()[0]:.2f}", flush=True)
    tmp = tempfile.mkdtemp(prefix="cuvil-matmul-prefetch-")
    cases = [("bert", a.bert_layers)] if a.bert_layers else [(768, 768), (768, 3072), (3072, 768)]
    shipped = matmul.MATMUL_PREFETCH_K
    for k, n in cases:
        model = bert_model(vocab=1000, layers=n) if k == "bert" else dense(k, n)
        libs = {}
        try:
            for d in distances:
                matmul.MATMUL_PREFETCH_K = d
                so = os.path.join(tmp, f"lib_{k}_{n}_{d}.so")
                Pipeline.from_onnx(model).optimize().compile(
                    cache=False, shape_profiles=BERT_PROFILE if k == "bert" else {"S": (1, 128, 512)}).save(so)
                libs[f"ahead {d}"] = load(so, num_threads=1)
        finally:
            matmul.MATMUL_PREFETCH_K = shipped
        if compare(model, libs, k, n, seqs, a.rounds, label="prefetch"):
            return 1
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
