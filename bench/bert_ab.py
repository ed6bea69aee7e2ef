"""A/B of two builds of the BERT-like encoder of bench/attention.py (hidden 768, 12 heads, ffn 3072, erf GELU,
LayerNormalization; each library one for B = 1..8, S = 1..512), or of one of its parts (``--model``), beside
onnxruntime, in one process: B = 1, the engines alternating in order and reverse; the libraries' outputs are
also compared bit for bit. 1 thread: p50 of the calling thread's CPU time per run over rounds
of back-to-back runs (time spent descheduled counts for no engine); ``--threads 2`` adds wall-clock p50s of
single runs with an idle pause before each.

    # a library of each build, e.g. the previous commit's source in /tmp/old:
    PYTHONPATH=/tmp/old/src python3 bench/bert_ab.py --save /tmp/old.so --layers 2
    PYTHONPATH=src python3 bench/bert_ab.py --save /tmp/new.so --layers 2
    PYTHONPATH=src python3 bench/bert_ab.py /tmp/old.so /tmp/new.so --layers 2 [--seqs 32,128,384] [--rounds 9]

``--model``: ``bert`` (default); ``attention`` (the attention alone, bench/attention.py's ``attention_only``: 12
heads, d 64, an eighth of the keys masked); ``gelu`` (the FFN's first product, 768 -> 3072 + bias, erf GELU
fused); ``dense768`` / ``dense3072`` (768 -> 768 and 3072 -> 768 + bias).

``--kinds R``: then, per S, R alternating rounds of the step profiler on each library (1 thread, 3 runs a round),
the median time per kernel kind and op (``gemm Add``, ``attention_keys FusedAttention``, ``loop
LayerNormalization``, ...) side by side: where an A/B's difference comes from.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import PROFILE, attention_only, bert_like, feeds  # noqa: E402
from matmul_tiles import dense, time_pair  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from cuvil import Pipeline, load  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
from cuvil.testing.oracles import ort_session  # noqa: E402


def dense_gelu(k: int, n: int):
    """``x[S, k] @ W + b`` then erf GELU as torch exports it (the FFN's first product)."""
    m = dense(k, n)
    g = m.graph
    g.output[0].name = "y"
    g.node[1].output[0] = "f"
    g.initializer.extend(numpy_helper.from_array(np.float32(v), nm) for nm, v in (("h", 0.5), ("s", 2 ** -0.5),
                                                                                   ("one", 1.0)))
    g.node.extend([helper.make_node("Mul", ["f", "s"], ["fs"]), helper.make_node("Erf", ["fs"], ["e"]),
                   helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["f", "h"], ["fh"]),
                   helper.make_node("Mul", ["fh", "e1"], ["y"])])
    return m


MODELS = {"attention": lambda layers: attention_only(), "gelu": lambda layers: dense_gelu(768, 3072),
          "dense768": lambda layers: dense(768, 768), "dense3072": lambda layers: dense(3072, 768),
          "bert": bert_like}


def model_feeds(model: str, s: int) -> dict:
    if model == "bert":
        return feeds(1, s, 768)
    if model == "attention":
        return feeds(1, s, 768, only_attention=True)
    k = 3072 if model == "dense3072" else 768
    return {"x": np.random.default_rng(1).standard_normal((s, k)).astype(np.float32)}


def wall_p50(runs: dict, rounds: int, pause_ms: float) -> dict:
    """p50 wall milliseconds of single runs, an idle pause before each, engines alternating."""
    times = {k: [] for k in runs}
    for i in range(rounds):
        for k, r in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
            time.sleep(pause_ms / 1e3)
            t0 = time.perf_counter()
            r()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="*", help="libraries to compare (A B ...)")
    ap.add_argument("--save", metavar="PATH", help="only compile this source tree's library to PATH")
    ap.add_argument("--model", choices=sorted(MODELS), default="bert")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", default="1", help="1 and/or 2, comma-separated")
    ap.add_argument("--pause-ms", type=float, default=150,
                    help="idle sleep between runs (150: onnxruntime's 2-thread workers spin ~45 ms after a run; bench/PRECISION.md, session 35)")
    ap.add_argument("--kinds", type=int, default=0, metavar="R", help="rounds of the per-kernel-kind profile")
    a = ap.parse_args(argv)
    model = MODELS[a.model](a.layers)
    profile = PROFILE if a.model in ("bert", "attention") else {"S": (1, 128, 512)}
    if a.save:
        t0 = time.perf_counter()
        Pipeline.from_onnx(model).optimize().compile(shape_profiles=profile, cache=False).save(a.save)
        print(f"compiled in {time.perf_counter() - t0:.0f} s: {a.save}")
        return 0
    names = [chr(ord("A") + i) for i in range(len(a.libs))]
    what = f"BERT-like, {a.layers} layers" if a.model == "bert" else a.model
    print(f"{cpu_label()}; {what}, B = 1; load average {os.getloadavg()[0]:.2f}")
    for n, p in zip(names, a.libs):
        print(f"{n}: {p}")
    for threads in (int(t) for t in a.threads.split(",")):
        libs = {n: load(p, num_threads=threads) for n, p in zip(names, a.libs)}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        sess = ort_session(model, opts)
        for s in (int(x) for x in a.seqs.split(",")):
            f = model_feeds(a.model, s)
            want = sess.run(None, f)[0]
            outs = {n: m.run(f)["y"] for n, m in libs.items()}
            for n, y in outs.items():
                err = float(np.abs(y - want).max())
                if err > 1e-3 * max(1.0, float(np.abs(want).max())):
                    print(f"{n} at S = {s}: differs from onnxruntime by {err}", file=sys.stderr)
                    return 1
            first = next(iter(outs.values()))
            same = ", ".join(f"{n} {'=' if np.array_equal(y.view(np.int32), first.view(np.int32)) else '!='} A"
                             for n, y in list(outs.items())[1:])
            runs = {n: (lambda m=m: m.run(f)) for n, m in libs.items()}
            runs["ort"] = lambda: sess.run(None, f)
            if threads == 1:
                p50 = time_pair(runs, a.rounds, max(1, (128 if a.model == "bert" else 1024) // s))
                what = "CPU ms"
            else:
                p50 = {k: v / 1e3 for k, v in wall_p50(runs, a.rounds * 2, a.pause_ms).items()}
                what = "wall ms"
            print(f"S = {s:3}, {threads} thread(s), {what}: " + "  ".join(
                f"{k} {1e3 * v:.3f} ({v / p50['ort']:.3f})" for k, v in p50.items()) + f"; bits: {same}", flush=True)
    if a.kinds:
        for s in (int(x) for x in a.seqs.split(",")):
            kinds(dict(zip(names, a.libs)), model_feeds(a.model, s), a.kinds, s)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


def kinds(paths: dict, f: dict, rounds: int, s: int) -> None:
    """Median ms per (kernel kind, op) of each library's steps over ``rounds`` alternating profiled rounds."""
    libs = {n: load(p, num_threads=1) for n, p in paths.items()}
    steps = {n: json.load(open(p[:-3] + ".manifest.json"))["steps"] for n, p in paths.items()}
    acc = {n: defaultdict(list) for n in libs}
    for i in range(rounds):
        for n, m in (list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]):
            per = defaultdict(float)
            for st, t in zip(steps[n], m.profile(runs=3, num_threads=1, **f)):
                if t > 0:        # a library with a profile lists the generic and the opt-point kernels
                    per[f"{st['kernel']} {st['op']}"] += 1e3 * t
            for k, v in per.items():
                acc[n][k].append(v)
    med = {n: {k: statistics.median(v) for k, v in acc[n].items()} for n in libs}
    first = next(iter(med))
    print(f"S = {s}, 1 thread, ms per kernel kind (median of {rounds} rounds): " + "  ".join(libs))
    for k in sorted(set().union(*med.values()), key=lambda k: -med[first].get(k, 0.0)):
        if max(m.get(k, 0.0) for m in med.values()) >= 0.05:
            print(f"  {k:42} " + " ".join(f"{m.get(k, 0.0):9.3f}" for m in med.values()))


if __name__ == "__main__":
    sys.exit(main())
