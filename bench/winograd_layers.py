"""Per-layer A/B of Winograd vs direct convolution on this machine (one process, alternating runs).

For each stride-1 3x3 layer shape of the benchmark models (ResNet-50, DenseNet-121, Inception-v1) it builds
Conv + bias + Relu, compiles it three ways (direct, forced F(2x2,3x3), forced F(4x4,3x3)) and reports
p50 latency, the error against onnxruntime (normwise relative) and which one the x86 cost model picks
(cuvil.targets.x86.choose). This is the measurement the cost model's constants come from.

    python3 bench/winograd_layers.py [--runs 30] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86 import choose
from cuvil.targets.x86.cpu import host_cpu
from cuvil.targets.x86.gemm import tile_shapes
from cuvil.targets.x86.tuning import DEFAULT_TUNING, X86Tuning

# (C, K, H) for square maps, pads 1
LAYERS = [(64, 64, 56), (128, 128, 28), (256, 256, 14), (512, 512, 7),     # ResNet-50 stages
          (128, 32, 56), (128, 32, 28), (128, 32, 14), (128, 32, 7),       # DenseNet-121 growth convs
          (96, 128, 28), (112, 224, 14), (160, 320, 7), (192, 384, 7),      # Inception-v1
          (96, 208, 13), (160, 320, 13), (160, 320, 6), (64, 256, 13)]      # the light Inception-v1 / SqueezeNet


def layer(c, k, h, rng):
    w = numpy_helper.from_array((rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(k).astype(np.float32) * 0.1, "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", 1, [1, c, h, h])],
                          [helper.make_tensor_value_info("y", 1, [1, k, h, h])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def compile_forced(p: Pipeline, tile):
    """tile None: direct; 2 or 4: that Winograd tile wherever a rule matches."""
    if tile is None:
        return p.compile(cache=False, winograd=False)
    return p.compile(cache=False, tuning=X86Tuning(winograd_tile=tile))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", nargs="+", metavar="C,K,H", help="layer shapes instead of the built-in list")
    ap.add_argument("--weight-costs", type=float, nargs="+", default=[DEFAULT_TUNING.weight_cost],
                    help="the cost model's pick for each of these X86Tuning.weight_cost values (default: the shipped one)")
    args = ap.parse_args()
    layers = [tuple(int(v) for v in t.split(",")) for t in args.layers] if args.layers else LAYERS
    rng = np.random.default_rng(0)
    picks = " | ".join(f"cost model (W={w:g})" for w in args.weight_costs)
    print(f"| C | K | HxW | direct ms | F(2x2) ms | F(4x4) ms | onnxruntime ms | best | {picks} | err direct | err F2 | err F4 |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(args.weight_costs) + "---|---|---|")
    for c, k, h in layers:
        m = layer(c, k, h, rng)
        x = rng.standard_normal((1, c, h, h)).astype(np.float32)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        shapes = tile_shapes(host_cpu().vector_bits)
        ref = sess.run(None, {"x": x})[0]
        p = Pipeline.from_onnx(m).optimize()
        engines = {"direct": None, "F2": 2, "F4": 4}
        models = {name: compile_forced(p, t).model(num_threads=args.threads) for name, t in engines.items()}
        times = {name: [] for name in list(models) + ["ort"]}
        errs = {}
        for name, mod in models.items():
            y = mod.run(x=x)[0]
            errs[name] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        for _ in range(args.runs):
            for name, mod in models.items():
                t0 = time.perf_counter()
                mod.run(x=x)
                times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sess.run(None, {"x": x})
            times["ort"].append(time.perf_counter() - t0)
        p50 = {name: 1e3 * float(np.median(v)) for name, v in times.items()}
        best = min(engines, key=lambda n: p50[n])
        pick = []
        for w in args.weight_costs:
            tuning = X86Tuning(weight_cost=w)
            pick.append({None: "direct", 2: "F2", 4: "F4"}[choose.best_tile(c, k, h, h, shapes, tuning)])
        print(f"| {c} | {k} | {h}x{h} | {p50['direct']:.3f} | {p50['F2']:.3f} | {p50['F4']:.3f} | {p50['ort']:.3f} | "
              f"{best} | {' | '.join(pick)} | {errs['direct']:.1e} | {errs['F2']:.1e} | {errs['F4']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
