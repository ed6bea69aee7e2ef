"""What BERT's GELU costs a bf16 FFN contraction: one FFN1 product (x[1, 128, 768] @ W[768, 3072] + bias) with
and without the erf GELU fused after it, Cuvil float32 and Cuvil bf16 (the precision policy's narrowing; AMX
tiles where the CPU has AMX-BF16, else ``vdpbf16ps``), side by side in one process.

    PYTHONPATH=src python3 bench/amx_gelu_epilogue.py [--blocks 7] [--runs 20]

Each build runs in interleaved blocks (order reversed every other block) through the step profiler (in-kernel
seconds per run, ``runs`` runs per block); the median and min of the blocks per build, and what the GELU adds
to each format (ms, and the product with it over the product without). The erf GELU is the same work in both
formats (an exp and two polynomials per element); once AMX has cut the product to a third, it is a larger share
of the bf16 product. The AMX kernel applies its fused epilogue over a spilled stack tile in a loop LLVM
vectorises at its preferred width (8 lanes on the AMX Xeon); figures in bench/PRECISION.md.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label


def ffn1(gelu: bool, k: int = 768, n: int = 3072, seq: int = 128, seed: int = 0):
    """``x[1, seq, k] @ W + b``, then (``gelu``) 0.5·f·(1 + erf(f/√2)) as bench/attention.py's BERT spells it."""
    rng = np.random.default_rng(seed)
    inits = [nh.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), "w"),
             nh.from_array((0.1 * rng.standard_normal(n)).astype(np.float32), "b"),
             nh.from_array(np.float32(0.5), "half"), nh.from_array(np.float32(2 ** -0.5), "is2"),
             nh.from_array(np.float32(1), "one")]
    nodes = [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "b"], ["f" if gelu else "y"])]
    if gelu:
        nodes += [h.make_node("Mul", ["f", "half"], ["fh"]), h.make_node("Mul", ["f", "is2"], ["fs"]),
                  h.make_node("Erf", ["fs"], ["e"]), h.make_node("Add", ["e", "one"], ["e1"]),
                  h.make_node("Mul", ["fh", "e1"], ["y"])]
    g = h.make_graph(nodes, "ffn1", [h.make_tensor_value_info("x", T.FLOAT, [1, seq, k])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, seq, n])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args(argv)
    x = np.random.default_rng(1).standard_normal((1, 128, 768)).astype(np.float32)
    box = {"x": (float(x.min()), float(x.max()))}
    builds, paths = {}, {}
    for gelu in (False, True):
        for prec in ("fp32", "bf16"):
            p = Pipeline.from_onnx(ffn1(gelu)).optimize()
            art = p.compile(precision="bf16", input_ranges=box) if prec == "bf16" else p.compile()
            key = f"{prec} {'+ GELU' if gelu else 'bias only'}"
            builds[key] = art.model()
            paths[key] = ", ".join(s.get("path", "fp32") for s in art.manifest["steps"])
    ms = {k: [] for k in builds}
    for blk in range(a.blocks):
        items = list(builds.items())
        for k, m in (items if blk % 2 == 0 else items[::-1]):
            ms[k].append(1e3 * float(np.sum(m.profile(x, runs=a.runs, num_threads=1))))
    print(f"CPU: {cpu_label()}; load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("| build | kernel path | median ms | min ms |")
    print("|---|---|---|---|")
    for k, v in ms.items():
        print(f"| {k} | {paths[k]} | {np.median(v):.3f} | {np.min(v):.3f} |")
    for prec in ("fp32", "bf16"):
        med = {g: float(np.median(ms[f"{prec} {g}"])) for g in ("bias only", "+ GELU")}
        low = {g: float(np.min(ms[f"{prec} {g}"])) for g in ("bias only", "+ GELU")}
        print(f"{prec}: the GELU adds {med['+ GELU'] - med['bias only']:.3f} ms median "
              f"({low['+ GELU'] - low['bias only']:.3f} min), {med['+ GELU'] / med['bias only']:.2f}x the product")


if __name__ == "__main__":
    main()
