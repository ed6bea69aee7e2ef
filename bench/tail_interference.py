"""Why bench/run_all.py measures Cuvil's p99/p50 alone: Cuvil's 2-thread latency next to an onnxruntime
session in the same process, alternating with 150 ms pauses, with onnxruntime's intra-op spinning on (its
default) and off, and Cuvil alone.

    python3 bench/tail_interference.py [resnet50] [--runs 40] [--threads 2] [--pause-ms 150]

Prints p50, max / p50 and the slow runs (> 1.15 x p50) of each engine in each setting. On the 2-core VM these
were measured on, spinning onnxruntime workers left 7 of 40 Cuvil ResNet-50 runs at 1-thread speed (29-31 ms
against a 16.7 ms p50), none with spinning off or alone (max 1.07-1.12 x p50); onnxruntime's own runs slowed
alike. Timings on a shared machine are noisy: read the slow-run counts.
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline
from cuvil.testing import light_model


def _summary(label, ts):
    ts = np.array(ts)
    p50 = float(np.median(ts))
    slow = ts[ts > 1.15 * p50]
    print(f"  {label:32} p50 {p50:7.2f} ms  max/p50 {ts.max() / p50:5.2f}  slow runs {len(slow):2d}: "
          f"{np.round(slow, 1).tolist()}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="resnet50")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-ms", type=float, default=150.0)
    a = ap.parse_args(argv)
    src = light_model(a.model, seed=0)
    lib = Pipeline.from_onnx(src).optimize().compile().model(num_threads=a.threads)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(d.shape).astype(d.dtype) for d in lib.inputs]
    pause = a.pause_ms / 1e3

    def timed(fn):
        time.sleep(pause)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    print(f"{a.model}, {a.threads} threads, {a.runs} runs per engine, {a.pause_ms:g} ms pauses")
    for spin in ("1", "0"):
        so = ort.SessionOptions()
        so.intra_op_num_threads = a.threads
        so.add_session_config_entry("session.intra_op.allow_spinning", spin)
        sess = ort.InferenceSession(src.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds = {i.name: x for i, x in zip(sess.get_inputs(), xs)}
        for _ in range(3):
            lib.run(*xs)
            sess.run(None, feeds)
        tc, to = [], []
        for _ in range(a.runs):
            tc.append(timed(lambda: lib.run(*xs)))
            to.append(timed(lambda s=sess: s.run(None, feeds)))
        print(f"onnxruntime intra-op spinning {'on' if spin == '1' else 'off'}:")
        _summary("Cuvil", tc)
        _summary("onnxruntime", to)
        del sess
        gc.collect()
    for _ in range(3):
        lib.run(*xs)
    print("Cuvil alone:")
    _summary("Cuvil", [timed(lambda: lib.run(*xs)) for _ in range(a.runs)])


if __name__ == "__main__":
    main()
