"""Drift of ``--enable-fp16`` measured on the CPU (no GPU needed): each light model's half graph in its
reference form (:func:`cuvil.rewrite_rules.precision.to_half` with ``reference=True``: half storage and
elementwise math, float32 accumulation in Conv/Gemm/pooling averages/Softmax, float32 at the inputs and outputs) against the float32
model, both run by onnxruntime's CPU provider (onnx.reference where onnxruntime lacks a float16 kernel).

    python3 bench/gpu/fp16_drift.py [MODEL ...] [--json out.json]

Errors: normwise max|half - fp32| / max|fp32| (the figure the GPU correctness check uses), and the largest
elementwise relative error over outputs with |fp32| >= 1% of max|fp32|.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))


def errors(got: np.ndarray, ref: np.ndarray) -> dict:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    scale = float(np.max(np.abs(r)))
    big = np.abs(r) >= 0.01 * scale
    return {"normwise": float(np.max(np.abs(g - r)) / scale),
            "max_rel_significant": float(np.max(np.abs(g[big] - r[big]) / np.abs(r[big]))),
            "nonfinite": int(np.sum(~np.isfinite(g))),
            "argmax_equal": bool(np.argmax(g.reshape(-1)) == np.argmax(r.reshape(-1)))}


def run(model, feeds):
    try:
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # no fp16 fusions
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds), "onnxruntime"
    except Exception:   # noqa: BLE001 - a float16 kernel onnxruntime's CPU provider lacks
        from cuvil.reference import run_reference
        return run_reference(model, feeds), "onnx.reference"


def measure(name: str, seed: int = 1) -> dict:
    from cuvil import Pipeline
    from cuvil.frontend import export_model
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.testing import light_model
    t0 = time.perf_counter()
    g = Pipeline.from_onnx(light_model(name)).optimize().graph
    _, names = to_half(g)
    x = np.random.default_rng(seed).standard_normal(tuple(g.inputs[0].shape)).astype(np.float32)
    feeds = {g.inputs[0].name: x}
    (ref,), _ = run(export_model(g), feeds)
    (half,), engine = run(export_model(to_half(g, reference=True)[0]), feeds)
    return {"model": name, "float16_tensors": len(names), "engine": engine, **errors(half, ref),
            "max_abs_ref": float(np.max(np.abs(ref))), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    from cuvil.testing import LIGHT_MODELS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(LIGHT_MODELS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    print("| model | float16 tensors | normwise error | max rel. error (|ref| ≥ 1% max) | top-1 same | engine |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        r = measure(name)
        rows.append(r)
        print(f"| {name} | {r['float16_tensors']} | {r['normwise']:.1e} | {r['max_rel_significant']:.1e} | "
              f"{'yes' if r['argmax_equal'] else 'no'} | {r['engine']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
