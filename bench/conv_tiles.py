"""AVX-512's position-lane convolution register tiles (``X86Tuning.conv_tiles``: 12 x 32, 8 x 48, 6 x 64),
each forced in turn, side by side with the shipped tile set and onnxruntime, on ResNet-50's and SqueezeNet's
direct-convolution layers (issue 20: are the tiles fitted on Zen 5 the right ones on an Intel AVX-512 core?).

    PYTHONPATH=src python3 bench/conv_tiles.py [--tiles 12x2,8x3,6x4] [--rounds 11]
    PYTHONPATH=src python3 bench/conv_tiles.py --cpus rocketlake,native   # LLVM CPU names instead of tiles

``--cpus``: the shipped tiles compiled for each LLVM CPU (``native``: this one, named by cpu.tuning_name; a named one
runs only where this CPU has every feature LLVM gives it, e.g. not ``sapphirerapids`` on a VM hiding ``pconfig``;
float32 kernels use AVX-512F alike) instead of per tile: what the CPU name tuned for changes alone.

Tiles as rows x position vectors (16 floats each). Every layer compiled without Winograd (the direct
kernels are what the tiles change), once per tile with channel-lane tiles off so the forced tile is the one
taken, plus "shipped" (today's choice, channel-lane tiles included). One thread; per engine the calling
thread's CPU time (``time.thread_time``) of a batch of runs, engines alternating in order and reverse, p50 of
the rounds: time spent descheduled on a shared machine counts for no engine. Prints each engine's time over
onnxruntime's, the CPU and the load.
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
import onnxruntime as ort
from onnx import helper

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.oracles import max_rel_error, ort_session

from x86_layers import _conv, _model, cases   # bench/ is the script's own directory


def squeezenet_cases(rng):
    """SqueezeNet 1.x's fire-module convolutions at their widest maps (squeeze 1x1, expand 1x1 and 3x3)."""
    for name, c, k, kern, h in [("sq fire2 squeeze 1x1 96->16 55x55", 96, 16, 1, 55),
                                ("sq fire2 expand 1x1 16->64 55x55", 16, 64, 1, 55),
                                ("sq fire2 expand 3x3 16->64 55x55", 16, 64, 3, 55),
                                ("sq fire4 expand 3x3 32->128 27x27", 32, 128, 3, 27),
                                ("sq fire8 expand 3x3 64->256 13x13", 64, 256, 3, 13)]:
        nodes, inits = [], []
        y = _conv(rng, "c", "x", c, k, kern, nodes, inits)
        nodes.append(helper.make_node("Relu", [y], ["y"]))
        yield name, _model(nodes, inits, (1, c, h, h), "y")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="12x2,8x3,6x4", help="rows x position vectors, comma-separated")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--only", default="", help="layers whose name contains this")
    ap.add_argument("--cpus", default="", help="comma-separated LLVM CPU names to compare instead of tiles")
    a = ap.parse_args(argv)
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    print(f"{cpu_label()}; load {os.getloadavg()[0]:.1f}; 1 thread, CPU time p50 of {a.rounds} rounds, "
          "time / onnxruntime's (lower is better)", flush=True)
    rng = np.random.default_rng(0)
    layers = [(n, m) for kind, n, m in cases(rng) if kind in ("conv3x3", "conv1x1")] + list(squeezenet_cases(rng))
    tmp = tempfile.mkdtemp(prefix="cuvil-conv-tiles-")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    for name, model in layers:
        if a.only not in name:
            continue
        if a.cpus:
            tunings = {c: (c, X86Tuning()) for c in a.cpus.split(",")}
        else:
            tunings = {"shipped": (None, X86Tuning())}
            tunings.update({f"{r}x{16 * v}": (None, X86Tuning(conv_tiles=((r, v),), channel_tiles=()))
                            for r, v in tiles})
        libs = {}
        for tname, (cpu, tuning) in tunings.items():
            art = Pipeline.from_onnx(model).optimize().compile(cache=False, winograd=False, tuning=tuning, cpu=cpu)
            so = os.path.join(tmp, f"lib_{len(libs)}_{abs(hash(name))}.so")
            art.save(so)
            libs[tname] = load(so, num_threads=1)
        sess = ort_session(model, opts)
        x = rng.standard_normal(tuple(d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
                                ).astype(np.float32)
        runs = {tname: (lambda m=m: m.run(x)) for tname, m in libs.items()}
        runs["onnxruntime"] = lambda: sess.run(None, {"x": x})
        want = runs["onnxruntime"]()[0]
        for tname in libs:
            err = max_rel_error(runs[tname]()[0], want)
            if not err <= 1e-4:
                print(f"{name} tile {tname}: relative error {err:.2g} against onnxruntime", file=sys.stderr)
                return 1
        c0 = time.thread_time()
        runs["onnxruntime"]()
        reps = max(1, int(0.02 / max(time.thread_time() - c0, 1e-5)))
        times = {tname: [] for tname in runs}
        for i in range(a.rounds):
            for tname, r in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
                c0 = time.thread_time()
                for _ in range(reps):
                    r()
                times[tname].append((time.thread_time() - c0) / reps)
        p50 = {tname: statistics.median(v) for tname, v in times.items()}
        print(f"{name:36} ort {1e3 * p50['onnxruntime']:7.3f} ms  " + "  ".join(
            f"{tname} {p50[tname] / p50['onnxruntime']:.2f}" for tname in libs), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
