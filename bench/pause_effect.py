"""Why bench/run_all.py pauses between engines: Cuvil and onnxruntime alternating in one process, with
an idle pause of 0 to 200 ms before each run, at 2 threads. onnxruntime's intra-op workers keep spinning for
a while after a run (``session.intra_op.allow_spinning``, on by default); back to back they hold the second
core while the other engine runs.

    python3 bench/pause_effect.py [resnet50] [--runs 8] [--threads 2]

Prints each engine's p50 per pause. Timings on a shared 2-core machine are noisy: read the trend.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline
from cuvil.testing import light_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="resnet50")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pauses-ms", type=float, nargs="+", default=[0, 10, 30, 100, 200])
    a = ap.parse_args(argv)
    m = light_model(a.model)
    lib = Pipeline.from_onnx(m).optimize().compile().model()
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    feeds = {m.graph.input[0].name: x}
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = a.threads, 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    print(f"{a.model}, {a.threads} threads, p50 over {a.runs} alternating runs")
    for pause_ms in a.pauses_ms:
        pause = pause_ms / 1e3
        tc, to = [], []
        for _ in range(2):
            lib.run(x, num_threads=a.threads)
            sess.run(None, feeds)
        for _ in range(a.runs):
            time.sleep(pause)
            t = time.perf_counter()
            lib.run(x, num_threads=a.threads)
            tc.append(time.perf_counter() - t)
            time.sleep(pause)
            t = time.perf_counter()
            sess.run(None, feeds)
            to.append(time.perf_counter() - t)
        c, o = 1e3 * statistics.median(tc), 1e3 * statistics.median(to)
        print(f"  pause {pause_ms:5.0f} ms: cuvil {c:7.1f} ms  onnxruntime {o:7.1f} ms  ratio {c / o:.2f}", flush=True)


if __name__ == "__main__":
    main()
