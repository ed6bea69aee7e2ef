"""Cost of the Winograd output transform's direct-convolution fallback (x86/winograd.py): one 3x3 layer
(C = K = 64, 28 x 28, pads 1, Conv + bias + Relu) compiled with F(4x4) forced, run on 1 thread with a normal
input, one NaN, all NaN, and every activation scaled by 1e37 (the transforms overflow, direct sums stay
finite). Prints p50 latency and a digest of each output's bytes (equal digests across two builds: the same
results bit for bit).

    PYTHONPATH=src python3 bench/winograd_fallback.py [--runs 10] [--tile 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
from onnx import helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.tuning import X86Tuning

C = K = 64
H = 28


def layer():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((K, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(K).astype(np.float32) * 0.1, "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", 1, [1, C, H, H])],
                          [helper.make_tensor_value_info("y", 1, [1, K, H, H])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def inputs():
    x = np.random.default_rng(1).standard_normal((1, C, H, H)).astype(np.float32)
    one = x.copy()
    one[0, 5, 13, 17] = np.nan
    return {"normal": x, "one NaN": one, "all NaN": np.full_like(x, np.nan),
            "all x1e37": (x.astype(np.float64) * 1e37).astype(np.float32)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tile", type=int, default=4, choices=(2, 4))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    art = Pipeline.from_onnx(layer()).optimize().compile(cache=False, tuning=X86Tuning(winograd_tile=args.tile))
    assert "winograd_out" in [s["kernel"] for s in art.manifest["steps"]], "the layer did not take Winograd"
    mod = art.model(num_threads=args.threads)
    print(f"C=K={C}, {H}x{H}, F({args.tile}x{args.tile}), {args.threads} thread(s), p50 of {args.runs} runs")
    print(f"{'input':<12}{'ms':>10}  {'non-finite':>10}  output digest")
    for name, x in inputs().items():
        y = mod.run(x=x)[0]
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            mod.run(x=x)
            times.append(time.perf_counter() - t0)
        digest = hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()[:16]
        print(f"{name:<12}{np.median(times) * 1e3:>10.3f}  {np.count_nonzero(~np.isfinite(y)):>10}  {digest}")


if __name__ == "__main__":
    main()
