"""ConvTranspose layers alone, Cuvil beside onnxruntime (1 thread, thread CPU time, 5 blocks of 5 runs, medians):
the forms rules/layout.rule rewrites (kernel = stride: a 1x1 Conv and DepthToSpace; k = 4, s = 2, p = 1: a 3x3
Conv with 4 phase channels; k = 3, s = 2, p = 1 with output padding 1: a 2x2 Conv with 4), and a general one
(k = 3, s = 2, p = 1 without output padding) that runs kernels/lower/conv.py's phase form.

    PYTHONPATH=src python3 bench/convtranspose.py

Also beside them, "gather": the library built with ``cuvil.kernels.lower.conv.CONV_TRANSPOSE_BY_PHASE`` off (the
loop over every tap with a divisibility test, as before session 25), for the forms the rule leaves alone.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import cuvil.kernels.lower.conv as lower_conv
from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import ort_runner, ort_session, time_blocks  # noqa: E402

LAYERS = [  # (in channels, out channels, kernel, stride, attributes, input size)
    (24, 24, 2, 2, {}, 160),
    (64, 32, 4, 2, {"pads": [1, 1, 1, 1]}, 64),
    (32, 16, 3, 2, {"pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 96),
    (32, 16, 3, 2, {"pads": [1, 1, 1, 1]}, 96),
]


def layer(cin, cout, k, s, attrs, hw):
    rng = np.random.default_rng(cin + cout + k)
    inits = [numpy_helper.from_array(rng.standard_normal((cin, cout, k, k)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b")]
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[s, s], **attrs)
    g = helper.make_graph([node], "ct", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main() -> int:
    print(cpu_label())
    for cin, cout, k, s, attrs, hw in LAYERS:
        m = layer(cin, cout, k, s, attrs, hw)
        p = Pipeline.from_onnx(m).optimize()
        lib = p.compile(cache=False).model()
        x = np.random.default_rng(0).standard_normal((1, cin, hw, hw)).astype(np.float32)
        sess = ort_session(m, 1)
        err = float(np.max(np.abs(lib.run(x)[0] - sess.run(None, {"x": x})[0])))
        eng = {"cuvil": lambda: lib.run(x, num_threads=1), "ort": ort_runner(sess, {"x": x})}
        if "ConvTranspose" in [n.op for n in p.graph.nodes]:      # the loop form: its gather variant beside
            lower_conv.CONV_TRANSPOSE_BY_PHASE = False
            try:
                old = p.compile(cache=False).model()
            finally:
                lower_conv.CONV_TRANSPOSE_BY_PHASE = True
            eng["gather"] = lambda: old.run(x, num_threads=1)
        res = time_blocks(eng, 5, 5, clock=time.thread_time)
        mc, mo = statistics.median(res["cuvil"]), statistics.median(res["ort"])
        g = (f", gather form {statistics.median(res['gather']):.2f} ms (phase / gather "
             f"{mc / statistics.median(res['gather']):.2f})") if "gather" in res else ""
        print(f"ConvTranspose {cin}->{cout} k{k} s{s} {attrs or ''} at {hw}x{hw}: Cuvil {mc:.2f} ms, onnxruntime "
              f"{mo:.2f} ms, Cuvil / ORT {mc / mo:.2f}, max abs diff {err:.1e}{g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
