"""Fraction of fp32 peak of the hot GEMM kernels, Cuvil beside onnxruntime (MLAS) on the same one-op model
(issue 20): BERT-base's four dense-layer products ``x[S, K] @ W[K, N] + bias`` at S rows and ResNet-50's
largest convolutions (bias + Relu fused, as in the model).

    PYTHONPATH=src python3 bench/gemm_peak.py [--seqs 32,128,384] [--rounds 9] [--only bert|resnet]

Peak: 12 independent FMA chains (bench/run_all.py's loop, ``cc -O3 -march=native``) timed in the thread's
CPU time (``CLOCK_THREAD_CPUTIME_ID``), best of 3: FLOP/cycle x the clock the core actually ran at. Each
kernel: the calling thread's CPU time (``time.thread_time``) of a batch of runs, one thread, the engines
alternating in order and reverse, p50 of the rounds; fraction of peak = FLOPs / (CPU time x peak). Each BERT
shape is one library for S = 1..512 (the one BERT gets); a convolution is compiled as Cuvil compiles it
inside ResNet-50 (Winograd where its cost model picks it; the kernel kind is printed). Prints the CPU, the load
average, GFLOP/s, % of peak and Cuvil's time over onnxruntime's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import onnxruntime as ort
from onnx import helper

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.oracles import max_rel_error, ort_session

from matmul_tiles import dense, time_pair       # bench/ is the script's own directory
from run_all import _PEAK_C
from x86_layers import _conv, _model

BERT_SHAPES = [(768, 768), (768, 3072), (3072, 768)]
# ResNet-50's convolutions with the most FLOPs per layer kind: (kernel, in, out, spatial)
RESNET_CONVS = [(3, 64, 64, 56), (3, 128, 128, 28), (3, 256, 256, 14), (3, 512, 512, 7),
                (1, 64, 256, 56), (1, 256, 1024, 14), (1, 512, 2048, 7), (1, 1024, 256, 14)]


def thread_peak_gflops() -> float:
    """One core's fp32 FMA throughput in its own CPU time (descheduled time not counted)."""
    with tempfile.TemporaryDirectory(prefix="cuvil-peak-") as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(_PEAK_C.replace("CLOCK_MONOTONIC", "CLOCK_THREAD_CPUTIME_ID"))
        subprocess.run(["cc", "-O3", "-march=native", "-ffp-contract=fast", src, "-o", exe], check=True)
        return max(float(subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()[0])
                   for _ in range(3))


def conv_model(kern: int, c: int, k: int, h: int):
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    y = _conv(rng, "c", "x", c, k, kern, nodes, inits)
    nodes.append(helper.make_node("Relu", [y], ["y"]))
    return _model(nodes, inits, (1, c, h, h), "y")


def kernel_kind(so: str) -> str:
    """The manifest's steps of the library (op and kernel name: e.g. a Winograd transform beside the GEMM)."""
    with open(so[:-3] + ".manifest.json") as f:
        steps = json.load(f)["steps"]
    return ", ".join(dict.fromkeys(f"{st['op']}/{st['kernel']}" for st in steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", choices=("bert", "resnet"))
    ap.add_argument("--peak-gflops", type=float, help="skip the peak measurement")
    a = ap.parse_args(argv)
    peak = a.peak_gflops or thread_peak_gflops()
    print(f"{cpu_label()}; fp32 peak {peak:.1f} GFLOP/s per core (thread CPU time); 1 thread; "
          f"CPU time p50 of {a.rounds} rounds; load average {os.getloadavg()[0]:.2f}", flush=True)
    print("| kernel | rows | Cuvil GFLOP/s | % peak | ORT GFLOP/s | % peak | Cuvil / ORT | Cuvil kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    tmp = tempfile.mkdtemp(prefix="cuvil-gemm-peak-")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    cases = []
    if a.only != "resnet":
        for k, n in BERT_SHAPES:
            cases.append((f"dense {k} -> {n}", dense(k, n), {"S": (1, 128, 512)},
                          [(s, np.random.default_rng(1).standard_normal((s, k)).astype(np.float32), 2 * s * k * n)
                           for s in (int(v) for v in a.seqs.split(","))]))
    if a.only != "bert":
        for kern, c, k, h in RESNET_CONVS:
            x = np.random.default_rng(1).standard_normal((1, c, h, h)).astype(np.float32)
            cases.append((f"conv {kern}x{kern} {c} -> {k} {h}x{h}", conv_model(kern, c, k, h), None,
                          [(h * h, x, 2 * c * k * kern * kern * h * h)]))
    for name, model, profile, points in cases:
        so = os.path.join(tmp, f"lib{len(os.listdir(tmp))}.so")
        Pipeline.from_onnx(model).optimize().compile(cache=False, shape_profiles=profile).save(so)
        lib = load(so, num_threads=1)
        kind = kernel_kind(so)
        sess = ort_session(model, opts)
        in_name = sess.get_inputs()[0].name
        for rows, x, flops in points:
            runs = {"cuvil": lambda: lib.run(x), "onnxruntime": lambda: sess.run(None, {in_name: x})}
            err = max_rel_error(runs["cuvil"]()[0], runs["onnxruntime"]()[0])
            if not err <= 1e-4:
                print(f"{name}: relative error {err:.2g} against onnxruntime", file=sys.stderr)
                return 1
            reps = max(1, int(2e9 / flops))
            p50 = time_pair(runs, a.rounds, reps)
            g = {e: flops / t / 1e9 for e, t in p50.items()}
            print(f"| {name} | {rows} | {g['cuvil']:.0f} | {100 * g['cuvil'] / peak:.0f}% | {g['onnxruntime']:.0f} | "
                  f"{100 * g['onnxruntime'] / peak:.0f}% | {p50['cuvil'] / p50['onnxruntime']:.2f} | {kind} |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
