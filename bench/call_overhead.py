"""The fixed cost of one ``Model.run`` from Python on the x86 target: a 1-node model (Relu on 1x16), static and
with a symbol, and optionally any ONNX model given with ``--model`` (compiled with ``--fix`` values), side by
side with onnxruntime in one process, alternating blocks. Reports per call the process's CPU time (on a shared,
loaded machine wall time counts other processes' turns; the CPU time does not) and the wall time, p50 of the
blocks, with the ratio Cuvil / onnxruntime and the CPU model.

    PYTHONPATH=src python3 bench/call_overhead.py [--threads 1,2] [--calls 5000] [--blocks 7]
    PYTHONPATH=src python3 bench/call_overhead.py --model m.onnx --fix B=1 --fix S=32 --calls 50

The C side alone (no Python): ``bench/run_overhead.c``.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.oracles import ort_session


def relu(symbolic: bool) -> onnx.ModelProto:
    dims = ["N", 16] if symbolic else [1, 16]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def feeds_for(m) -> list:
    rng = np.random.default_rng(0)
    out = []
    for d in m.inputs:
        shape = [v if v is not None else 1 for v in d.shape]
        out.append(rng.integers(0, 2, shape).astype(d.dtype) if d.dtype.kind in "iu"
                   else rng.standard_normal(shape).astype(d.dtype))
    return out


def timed(f, calls: int) -> tuple:
    c, t = time.process_time(), time.perf_counter()
    for _ in range(calls):
        f()
    return (time.process_time() - c) / calls, (time.perf_counter() - t) / calls


def bench(label: str, model: onnx.ModelProto, fixed: dict, shapes: dict, threads: int, calls: int, blocks: int):
    art = Pipeline.from_onnx(model).compile(fixed=fixed or None, shape_profiles=shapes or None)
    m = load(art.path, num_threads=threads)
    xs = feeds_for(m)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    s = ort_session(model, opts)
    feeds = {d.name: x for d, x in zip(m.inputs, xs)}
    m.run(*xs), s.run(None, feeds)
    res = {"cuvil": [], "onnxruntime": []}
    for _ in range(blocks):
        res["cuvil"].append(timed(lambda: m.run(*xs), calls))
        res["onnxruntime"].append(timed(lambda: s.run(None, feeds), calls))
    cu = np.median(np.array(res["cuvil"]), axis=0) * 1e6
    ot = np.median(np.array(res["onnxruntime"]), axis=0) * 1e6
    print(f"{label:<28} {threads} thr  cuvil cpu {cu[0]:9.1f} us wall {cu[1]:9.1f} us | onnxruntime cpu {ot[0]:9.1f} "
          f"us wall {ot[1]:9.1f} us | ratio cpu {cu[0] / ot[0]:.2f}")
    m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--model", help="an ONNX model to time too (with --fix for its symbols)")
    ap.add_argument("--fix", action="append", default=[], metavar="SYMBOL=INT")
    a = ap.parse_args()
    print(f"CPU: {cpu_label()}; per call, p50 of {a.blocks} alternating blocks of {a.calls} calls")
    for th in (int(t) for t in a.threads.split(",")):
        if a.model:
            fixed = {k: int(v) for k, v in (f.split("=") for f in a.fix)}
            bench(os.path.basename(a.model), onnx.load(a.model), fixed, {}, th, a.calls, a.blocks)
        else:
            bench("relu 1x16 (static)", relu(False), {}, {}, th, a.calls, a.blocks)
            bench("relu Nx16, N in [1, 64]", relu(True), {}, {"N": (1, 1, 64)}, th, a.calls, a.blocks)


if __name__ == "__main__":
    main()
