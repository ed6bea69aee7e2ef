"""The dense part of a BERT-base-like encoder on x86 (bench/attention.py's model: hidden 768, 12 heads, ffn
3072, erf GELU, LayerNormalization), compiled as ONE library for B = 1..8, S = 1..512, against onnxruntime:
where the time goes kernel by kernel, and Cuvil / onnxruntime side by side.

    PYTHONPATH=src python3 bench/transformer_dense.py [--seqs 32,128,384] [--threads 1,2] [--runs 15]
    PYTHONPATH=src python3 bench/transformer_dense.py --kernels 128 --peak-gflops 232   # the per-kernel table
    PYTHONPATH=src python3 bench/transformer_dense.py --ort-kernels 128     # onnxruntime's, by its profiler

Times are p50 of alternating runs (an idle pause before each). With one thread both engines run on the
calling thread, so the table also gives each one's CPU time on that thread (``time.thread_time``): on a
machine shared with other jobs, time spent descheduled then counts for neither, and that ratio is the
steadier one. ``--kernels S``: per step (the step profiler, 1 thread, its fastest of ``--runs`` runs) its time,
share, FLOPs (2 x multiply-adds of the products), the bytes a product must move at least (its weights, its
rows in and its rows out; 0 for the other kernels) and, with ``--peak-gflops`` (one core's float32 peak),
its share of peak. ``--ort-kernels S``: the same split for onnxruntime (1 thread), from its own profiler
(each node's fastest of ``--runs`` runs, summed by op type; a MatMul + Add pair is one MLAS call fused into
``FusedMatMul`` / ``Gemm`` or two nodes, as onnxruntime's graph optimiser leaves it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import PROFILE, bert_like, feeds  # noqa: E402  (the model and inputs bench/attention.py times)

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
from cuvil.testing.oracles import ort_session  # noqa: E402

HIDDEN = 768


def p50s(runners, f, runs: int, pause_ms: float):
    """p50 wall and calling-thread CPU milliseconds of each runner, runs alternating in order and reverse."""
    for r in runners.values():
        for _ in range(2):
            r(f)
    wall = {k: [] for k in runners}
    cpu = {k: [] for k in runners}
    for i in range(runs):
        for k, r in (list(runners.items()) if i % 2 == 0 else list(runners.items())[::-1]):
            time.sleep(pause_ms / 1e3)
            c0, t0 = time.thread_time(), time.perf_counter()
            r(f)
            wall[k].append((time.perf_counter() - t0) * 1e3)
            cpu[k].append((time.thread_time() - c0) * 1e3)
    return ({k: float(np.median(v)) for k, v in wall.items()}, {k: float(np.median(v)) for k, v in cpu.items()})


def kernel_table(art, seq: int, runs: int, peak: float | None):
    m = art.model()
    # each step's fastest of `runs` single-run profiles: time a shared machine took away from a step is
    # left out (the mean of the profiler's runs would count it)
    prof = np.min([m.profile(**feeds(1, seq, HIDDEN), runs=1, num_threads=1) for _ in range(runs)], axis=0)
    steps = art.manifest["steps"]
    total = sum(prof)
    rows = sorted(((t, st) for st, t in zip(steps, prof) if t > 0), key=lambda x: -x[0])
    print(f"\nS = {seq}, 1 thread: {1e3 * total:.2f} ms in kernels ({cpu_label()})")
    print(f"| kernel | stage | ms | share | GFLOP | MB moved | GFLOP/s | {'% of peak |' if peak else ''}")
    print(f"|---|---|---|---|---|---|---|{'---|' if peak else ''}")
    by_kind = {}
    for t, st in rows:
        # the manifest's FLOPs and shapes are at the profile's opt point (S = 128): scaled to this S
        flops, moved = 0, 0.0
        opt = {k: v[1] for k, v in PROFILE.items()}     # a generic step's dims: symbols, or expressions of them
        shape = [int(eval(d.replace("/", "//"), {}, dict(opt))) if isinstance(d, str) else d for d in st["shape"]]
        if st["kernel"] == "gemm":      # rows x n out, k x n weights, rows x k in: k from the FLOPs
            n, rows_opt = shape[-1], int(np.prod(shape[:-1]))
            k = st["flops"] // (2 * rows_opt * n)
            flops = 2 * seq * n * k
            moved = 4 * (seq * n + k * n + seq * k) / 1e6
        elif "FusedAttention" in st.get("op", ""):    # Q.Kt and P.V over S x S
            flops = st["flops"] * seq * seq // (shape[-1] * shape[-1])
        gf = flops / t / 1e9 if flops else 0.0
        pk = f" {100 * gf / peak:.0f}% |" if peak and gf else (" |" if peak else "")
        print(f"| {st['kernel']} | {st.get('op', '')}:{st['stage']} | {1e3 * t:.3f} | {100 * t / total:.1f}% | "
              f"{flops / 1e9:.3f} | {moved:.2f} | {gf:.0f} |{pk}")
        op = st.get("op", "")
        kind = "GEMM" if st["kernel"] == "gemm" else ("attention" if "FusedAttention" in op else op)
        acc = by_kind.setdefault(kind, [0.0, 0])
        acc[0] += t
        acc[1] += flops
    print("\n| kind | ms | share | GFLOP/s |")
    print("|---|---|---|---|")
    for kind, (t, f) in sorted(by_kind.items(), key=lambda x: -x[1][0]):
        print(f"| {kind} | {1e3 * t:.2f} | {100 * t / total:.1f}% | {f / t / 1e9 if f else 0:.0f} |")


def ort_kernel_table(model, seq: int, runs: int):
    """onnxruntime's time per op type at B = 1, this S, 1 thread: each node's fastest of ``runs`` profiled
    runs (its profiler's ``kernel_time`` events, microseconds), summed by op type."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(prefix="cuvil-ort-prof-"), "ort")
    sess = ort_session(model, so)
    f = feeds(1, seq, HIDDEN)
    for _ in range(runs):
        sess.run(None, f)
    with open(sess.end_profiling()) as fh:
        events = [e for e in json.load(fh) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    best = {}
    for e in events:
        key = (e["name"], e["args"]["op_name"])
        best[key] = min(best.get(key, float("inf")), e["dur"])
    total = sum(best.values())
    print(f"\nonnxruntime {ort.__version__}, S = {seq}, 1 thread: {total / 1e3:.2f} ms in kernels "
          f"({len(best)} nodes; {cpu_label()})")
    by_op = {}
    for (name, op), t in best.items():
        by_op[op] = by_op.get(op, 0) + t
    print("| op | ms | share |")
    print("|---|---|---|")
    for op, t in sorted(by_op.items(), key=lambda x: -x[1]):
        print(f"| {op} | {t / 1e3:.2f} | {100 * t / total:.1f}% |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--pause-ms", type=float, default=150,
                    help="idle sleep between runs (150: onnxruntime's 2-thread workers spin ~45 ms after a run; bench/PRECISION.md, session 35)")
    ap.add_argument("--kernels", type=int, metavar="S", help="only the per-kernel table at B = 1, this S")
    ap.add_argument("--peak-gflops", type=float, help="one core's float32 peak, for the %% of peak column")
    ap.add_argument("--ort-kernels", type=int, metavar="S", help="only onnxruntime's per-op table at B = 1, this S")
    a = ap.parse_args(argv)
    model = bert_like(a.layers)
    if a.ort_kernels:
        ort_kernel_table(model, a.ort_kernels, a.runs)
        return
    t0 = time.perf_counter()
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles=PROFILE)
    print(f"compiled in {time.perf_counter() - t0:.0f} s; {cpu_label()}")
    if a.kernels:
        kernel_table(art, a.kernels, a.runs, a.peak_gflops)
        return
    import onnxruntime as ort
    print("\n| S | threads | Cuvil (ms) | onnxruntime (ms) | Cuvil / ort | CPU ms Cuvil | CPU ms ort | CPU ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort_session(model, so)
        m = art.model()
        runners = {"cuvil": lambda f: m.run(f, num_threads=threads), "ort": lambda f: sess.run(None, f)}
        for s in [int(x) for x in a.seqs.split(",")]:
            f = feeds(1, s, HIDDEN)
            want = sess.run(None, f)[0]
            got = m.run(f)["y"]
            err = float(np.abs(got - want).max())
            if err > 1e-3 * max(1.0, float(np.abs(want).max())):
                raise SystemExit(f"S={s}: Cuvil differs from onnxruntime by {err}")
            wall, cpu = p50s(runners, f, a.runs, a.pause_ms)
            cpu_cols = (f"{cpu['cuvil']:.2f} | {cpu['ort']:.2f} | {cpu['cuvil'] / cpu['ort']:.2f}" if threads == 1
                        else "- | - | -")
            print(f"| {s} | {threads} | {wall['cuvil']:.2f} | {wall['ort']:.2f} | {wall['cuvil'] / wall['ort']:.2f} | "
                  f"{cpu_cols} |", flush=True)


if __name__ == "__main__":
    main()
