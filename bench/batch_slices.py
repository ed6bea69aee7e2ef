"""Per-image cost at batch 8 against batch 1 (what dynamic batching in `cuvil serve` needs: a batch must not
cost more per row than single calls), for a light CNN with a symbolic batch N in [1, 8] (opt 1), beside
onnxruntime; Cuvil's library built twice from the one model: with batch slices (the default: N = 8 runs the
opt point's kernels once per image, see cuvil.kernels.batch_rows) and with ``batch_slices=False`` (the generic
kernels over the whole batch, layer by layer).

    python3 bench/batch_slices.py                         # SqueezeNet, 1 thread
    python3 bench/batch_slices.py --model densenet121 --threads 2 --blocks 15

Every engine and batch runs 8 images per block (eight N = 1 calls, or one N = 8 call), blocks alternating
between them with a short pause; per image: p50 over the blocks of the wall time and of the process's CPU time
(on a shared machine the CPU time is the steadier figure: waits for a core do not count). Also checks that
every N = 8 output matches onnxruntime.
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
from cuvil.testing import light_model
from cuvil.testing.oracles import max_rel_error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import ort_runner, ort_session  # noqa: E402 - bench/ is no package


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="squeezenet", help="a light model whose batch is free (squeezenet, densenet121)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=11)
    ap.add_argument("--pause-ms", type=float, default=50.0)
    a = ap.parse_args(argv)
    m = light_model(a.model, seed=0)
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "N"
    p = Pipeline.from_onnx(m).optimize()
    profile = {"N": (1, 1, 8)}
    sliced = p.compile(opt_level=3, shape_profiles=profile)
    layered = p.compile(opt_level=3, shape_profiles=profile, batch_slices=False)
    if sliced.manifest.get("batch_slices") != "N":
        print(f"{a.model}: its rows are not independent along N (a Reshape or op mixes them): no batch slices")
        return 1
    libs = {"sliced": sliced.model(), "layered": layered.model()}
    sess = ort_session(m, a.threads)
    name = sess.get_inputs()[0].name
    x8 = np.random.default_rng(1).standard_normal((8, 3, 224, 224)).astype(np.float32)
    x1 = np.ascontiguousarray(x8[:1])
    ref = sess.run(None, {name: x8})[0]
    for k, lib in libs.items():
        err = max_rel_error(lib.run(x8, num_threads=a.threads)[0], ref)
        print(f"Cuvil {k}, N = 8: max relative error vs onnxruntime {err:.1e}")
    ort1, ort8 = ort_runner(sess, {name: x1}), ort_runner(sess, {name: x8})
    engines = {
        "Cuvil N=1": (lambda: libs["sliced"].run(x1, num_threads=a.threads), 8),
        "Cuvil N=8, batch slices": (lambda: libs["sliced"].run(x8, num_threads=a.threads), 1),
        "Cuvil N=8, layer by layer": (lambda: libs["layered"].run(x8, num_threads=a.threads), 1),
        "onnxruntime N=1": (ort1, 8),
        "onnxruntime N=8": (ort8, 1),
    }
    for f, _ in engines.values():
        f(), f()
    wall = {k: [] for k in engines}
    cpu = {k: [] for k in engines}
    for _ in range(a.blocks):
        for k, (f, calls) in engines.items():
            time.sleep(a.pause_ms / 1e3)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                f()
            wall[k].append((time.perf_counter() - t0) / 8 * 1e3)
            cpu[k].append((time.process_time() - c0) / 8 * 1e3)
    load = os.getloadavg()
    print(f"\n{a.model}, {a.threads} thread(s), {a.blocks} blocks of 8 images; {cpu_label()}; "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    base = statistics.median(cpu["Cuvil N=1"])
    print(f"| engine, batch | wall ms per image (p50) | CPU ms per image (p50) | CPU / Cuvil N=1 |")
    print("|---|---:|---:|---:|")
    for k in engines:
        c = statistics.median(cpu[k])
        print(f"| {k} | {statistics.median(wall[k]):.2f} | {c:.2f} | {c / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
