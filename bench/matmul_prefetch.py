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
import statistics
import sys
import tempfile
import time

import numpy as np

from cuvil import Pipeline, load
from cuvil.targets.x86 import matmul
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.hf_models import BERT_PROFILE, bert_model, text_feeds
from cuvil.testing.oracles import max_rel_error, ort_session

from matmul_tiles import dense        # bench/ is the script's own directory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distances", default="128,32", help="rows ahead, comma-separated")
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--bert-layers", type=int, default=0, help="time BERT-base width with this many layers instead")
    a = ap.parse_args(argv)
    import onnxruntime as ort
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
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        sess = ort_session(model, opts)
        for s in seqs:
            if k == "bert":
                feeds = text_feeds(model, 1, s)
                runs = {name: (lambda m=m: m.run(**feeds)) for name, m in libs.items()}
                runs["onnxruntime"] = lambda: sess.run(None, feeds)
            else:
                x = np.random.default_rng(1).standard_normal((s, k)).astype(np.float32)
                runs = {name: (lambda m=m: m.run(x)) for name, m in libs.items()}
                runs["onnxruntime"] = lambda: sess.run(None, {"x": x})
            want = runs["onnxruntime"]()[0]
            for name in libs:
                err = max_rel_error(runs[name]()[0], want)
                if not err <= 1e-5:
                    print(f"{name}: relative error {err:.2g} against onnxruntime", file=sys.stderr)
                    return 1
            times = {name: [] for name in runs}
            reps = max(1, (256 if k == "bert" else 2048) // s)
            for i in range(a.rounds):
                for name, r in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
                    c0 = time.thread_time()
                    for _ in range(reps):
                        r()
                    times[name].append((time.thread_time() - c0) / reps)
            p50 = {name: statistics.median(v) for name, v in times.items()}
            if k == "bert":
                print(f"S = {s:4}, BERT-base width, {n} layers: " + "  ".join(
                    f"{name} {1e3 * p50[name]:.2f} ms ({p50[name] / p50['onnxruntime']:.2f})" for name in runs), flush=True)
            else:
                flops = 2 * s * k * n
                print(f"S = {s:4}, {k} -> {n}: " + "  ".join(
                    f"{name} {flops / p50[name] / 1e9:.0f} GFLOP/s ({p50[name] / p50['onnxruntime']:.2f})"
                    for name in runs), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
