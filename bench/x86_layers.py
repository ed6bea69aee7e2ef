"""Single layers through the x86 micro-kernels, timed kernel by kernel: the measurements behind the GEMM
changes' figures (register tiles, run-wise packing, weight prefetch, register epilogues).

    python3 bench/x86_layers.py [--runs 30] [--threads 1] [--only conv3x3 conv1x1 chain7 fc]

* conv3x3: Conv 3x3 pads 1 + bias + Relu at ResNet-50's stage shapes (C=K=64 56x56 ... 512 7x7), direct
  (no Winograd);
* conv1x1: Conv 1x1 + bias + Relu, and the same with a residual add of a second convolution, at 56x56,
  14x14 and 7x7;
* chain7: eight 512-channel 7x7 3x3 layers in a row (9.4 MB of weights each: they stream from memory, as
  in a whole model, instead of sitting in L3 as a single layer's do);
* fc: eight 1 x 2048 x 1000 Gemm + MatMul pairs (a classifier layer, bandwidth-bound).

Prints each gemm step's time, GFLOP/s and share of the measured per-core fp32 peak.
"""
from __future__ import annotations

import argparse

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline

from run_all import measure_peak   # bench/ is the script's own directory


def _model(nodes, inits, x_shape, out):
    g = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _conv(rng, name, x, c, k, kern, nodes, inits):
    w = (rng.standard_normal((k, c, kern, kern)) / np.sqrt(c * kern * kern)).astype(np.float32)
    inits += [numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(rng.standard_normal(k).astype(np.float32) * 0.1, f"{name}_b")]
    nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], pads=[kern // 2] * 4))
    return name


def cases(rng):
    for c, h in [(64, 56), (128, 28), (256, 14), (512, 7)]:
        nodes, inits = [], []
        y = _conv(rng, "c", "x", c, c, 3, nodes, inits)
        nodes.append(helper.make_node("Relu", [y], ["y"]))
        yield "conv3x3", f"3x3 {c}->{c} {h}x{h}", _model(nodes, inits, (1, c, h, h), "y")
    for c, k, h in [(64, 256, 56), (256, 1024, 14), (512, 2048, 7)]:
        for residual in (False, True):
            nodes, inits = [], []
            y = _conv(rng, "c", "x", c, k, 1, nodes, inits)
            if residual:
                y2 = _conv(rng, "d", "x", c, k, 1, nodes, inits)
                nodes.append(helper.make_node("Add", [y, y2], ["s"]))
                y = "s"
            nodes.append(helper.make_node("Relu", [y], ["y"]))
            yield "conv1x1", f"1x1 {c}->{k} {h}x{h}{' + residual' if residual else ''}", _model(nodes, inits, (1, c, h, h), "y")
    nodes, inits, x = [], [], "x"
    for i in range(8):
        x = _conv(rng, f"c{i}", x, 512, 512, 3, nodes, inits)
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
        x = f"r{i}"
    yield "chain7", "8 x 3x3 512->512 7x7", _model(nodes, inits, (1, 512, 7, 7), x)
    nodes, inits, x = [], [], "x"
    for i in range(8):
        inits += [numpy_helper.from_array((rng.standard_normal((1000, 2048)) / 50).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(rng.standard_normal(1000).astype(np.float32), f"b{i}"),
                  numpy_helper.from_array((rng.standard_normal((1000, 2048)) / 50).astype(np.float32), f"v{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"g{i}"], transB=1),
                  helper.make_node("MatMul", [f"g{i}", f"v{i}"], [f"h{i}"])]
        x = f"h{i}"
    g = helper.make_graph(nodes, "fc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    yield "fc", "8 x (1x2048 Gemm 1000, MatMul 2048)", m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="+", default=["conv3x3", "conv1x1", "chain7", "fc"])
    a = ap.parse_args(argv)
    peak = measure_peak()
    print(f"per-core fp32 peak (measured): {peak:.1f} GFLOP/s; {a.threads} thread(s)")
    rng = np.random.default_rng(0)
    for group, label, m in cases(rng):
        if group not in a.only:
            continue
        art = Pipeline.from_onnx(m).optimize().compile(winograd=False)
        model = art.model()
        xs = [np.random.default_rng(1).standard_normal(d.shape).astype(np.float32) for d in model.inputs]
        times = model.profile(*xs, runs=a.runs, num_threads=a.threads)
        for st, t in zip(art.manifest["steps"], times):
            if st["kernel"] != "gemm":
                continue
            gf = st["flops"] / t / 1e9
            print(f"{label:40s} {st['stage']:12s} {t * 1e3:8.3f} ms {gf:7.1f} GFLOP/s "
                  f"{100 * gf / (peak * a.threads):5.1f}% of peak")


if __name__ == "__main__":
    main()
