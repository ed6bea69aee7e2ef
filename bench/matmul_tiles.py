"""Register tiles of the float32 MatMul micro-kernel (``X86Tuning.matmul_tile``) side by side with
onnxruntime, on BERT-base's dense layers: ``x[S, K] @ W[K, N] + bias`` for (K, N) = (768, 3072) and
(3072, 768), each compiled ONCE per tile for S = 1..512 (the library BERT gets), timed at the given S.

    PYTHONPATH=src python3 bench/matmul_tiles.py [--tiles 6x64,8x48,9x48,12x32] [--seqs 32,128,384]
    PYTHONPATH=src python3 bench/matmul_tiles.py --bert-layers 2 --tiles 6x64,8x48   # BERT-base width, 2 layers

``--bert-layers N``: instead of the single layers, BERT at BERT-base width with N layers (cuvil.testing.hf_models,
vocabulary 1000; one library per tile for batch 1..8, sequence 1..512), B = 1, all tokens real.

One thread; per engine the calling thread's CPU time (``time.thread_time``) of a batch of runs, engines
alternating in order and reverse, p50 of the rounds: on a machine shared with other jobs, time spent
descheduled counts for no engine. Prints GFLOP/s and each engine's time over onnxruntime's, and the CPU.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxruntime as ort

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm import matmul_tile
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.hf_models import BERT_PROFILE, bert_model, text_feeds
from cuvil.testing.oracles import max_rel_error, ort_session


def dense(k: int, n: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), "W")
    b = numpy_helper.from_array((rng.standard_normal(n) * 0.02).astype(np.float32), "B")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"]), helper.make_node("Add", ["t", "B"], ["y"])],
                          "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["S", n])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def time_pair(runs: dict, rounds: int, reps: int) -> dict:
    """p50 per engine of the calling thread's CPU time per call over ``rounds`` batches of ``reps`` calls, the
    engines alternating in order and reverse (time spent descheduled counts for none)."""
    times = {name: [] for name in runs}
    for i in range(rounds):
        for name, r in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
            c0 = time.thread_time()
            for _ in range(reps):
                r()
            times[name].append((time.thread_time() - c0) / reps)
    return {name: statistics.median(v) for name, v in times.items()}


def compare(model, libs: dict, k, n, seqs, rounds: int, label: str = "tile") -> int:
    """Time each library of ``libs`` (name -> loaded model) beside onnxruntime (1 thread) on ``model`` (BERT at
    BERT-base width with ``n`` layers when ``k == "bert"``, else the dense layer ``k -> n``) at each sequence length:
    per engine the calling thread's CPU time of a batch of runs, engines alternating in order and reverse, p50 of
    ``rounds``. Checks each against onnxruntime first (relative error <= 1e-5); prints ms, GFLOP/s and the ratio.
    Returns 0, or 1 on a wrong answer."""
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
                print(f"{label} {name}: relative error {err:.2g} against onnxruntime", file=sys.stderr)
                return 1
        p50 = time_pair(runs, rounds, max(1, (256 if k == "bert" else 2048) // s))
        if k == "bert":   # the dense layers' and attention's multiply-adds (embeddings, pooler left out)
            flops = 2 * n * (s * (4 * 768 * 768 + 2 * 768 * 3072) + 2 * s * s * 768)
            what = f"BERT-base width, {n} layers"
        else:
            flops, what = 2 * s * k * n, f"{k} -> {n}"
        print(f"S = {s:4}, {what}: " + "  ".join(
            f"{name} {1e3 * p50[name]:.2f} ms {flops / p50[name] / 1e9:.0f} GFLOP/s ({p50[name] / p50['onnxruntime']:.2f})"
            for name in runs), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="6x64,8x48,9x48,12x32", help="rows x cols, comma-separated")
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--bert-layers", type=int, default=0, help="time BERT-base width with this many layers instead")
    a = ap.parse_args(argv)
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    seqs = [int(s) for s in a.seqs.split(",")]
    print(f"{cpu_label()}; default tile here: {'x'.join(map(str, matmul_tile(host_cpu())))}; 1 thread, "
          f"CPU time p50 of {a.rounds} rounds")
    tmp = tempfile.mkdtemp(prefix="cuvil-matmul-tiles-")
    cases = [("bert", a.bert_layers)] if a.bert_layers else [(768, 3072), (3072, 768)]
    for k, n in cases:
        model = bert_model(vocab=1000, layers=n) if k == "bert" else dense(k, n)
        profile = BERT_PROFILE if k == "bert" else {"S": (1, 128, 512)}
        libs = {}
        for t in tiles:
            art = Pipeline.from_onnx(model).optimize().compile(
                cache=False, shape_profiles=profile, tuning=X86Tuning(matmul_tile=t))
            so = os.path.join(tmp, f"libdense_{k}_{n}_{t[0]}x{t[1]}.so")
            art.save(so)
            libs["x".join(map(str, t))] = load(so, num_threads=1)
        if compare(model, libs, k, n, seqs, a.rounds):
            return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
