"""Ops imported as their ONNX function bodies, on the GPU: models with symbolic batch and sequence length (opset-23 Attention with GQA and a padded bool mask, causal or not; RotaryEmbedding, interleaved), compiled
with the symbols fixed at each shape (the GPU target specialises them) and run against onnxruntime on the CPU. The normwise error max|gpu - ref| / max|ref| must stay <= 1e-4.

    python3 bench/gpu/function_ops.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

from check_correctness import RTOL, TARGET, _ort, rel_error  # noqa: E402

SHAPES = [(1, 1), (1, 16), (2, 5), (3, 17), (1, 128), (4, 128)]


def models():
    import onnx.helper as h
    from onnx import TensorProto as TP
    from test_function_ops import gqa_attention, model
    rope = h.make_node("RotaryEmbedding", ["X", "cos", "sin", "pos"], ["Y"], num_heads=2, interleaved=1)
    rope_model = model([rope], [("X", TP.FLOAT, ["B", "S", 16]), ("cos", TP.FLOAT, [128, 4]),
                                ("sin", TP.FLOAT, [128, 4]), ("pos", TP.INT64, ["B", "S"])],
                       [("Y", TP.FLOAT, ["B", "S", 16])], 23)
    return {"attention_gqa_padded": gqa_attention(0), "attention_gqa_padded_causal": gqa_attention(1),
            "rotary_embedding_interleaved": rope_model}


def feeds_for(name, b, s, rng):
    from test_function_ops import D, HKV, HQ, padded_mask
    if name.startswith("attention"):
        return {"Q": rng.standard_normal((b, s, HQ * D), np.float32), "K": rng.standard_normal((b, s, HKV * D), np.float32),
                "V": rng.standard_normal((b, s, HKV * D), np.float32), "M": padded_mask(rng, b, s, s)}
    angles = rng.uniform(0, 6, (128, 4)).astype(np.float32)
    return {"X": rng.standard_normal((b, s, 16), np.float32), "cos": np.cos(angles), "sin": np.sin(angles),
            "pos": rng.integers(0, 128, (b, s)).astype(np.int64)}


def main(argv=None) -> int:
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import load_bundle
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="cuvil-function-ops-")
    rows = []
    for name, m in models().items():
        rng = np.random.default_rng(0)
        p = Pipeline.from_onnx(m).optimize()
        for bsz, s in SHAPES:
            # the GPU target specialises every symbol: one bundle per shape
            b = p.compile(TARGET, cache=False, fixed={"B": bsz, "S": s})
            path = b.save(os.path.join(out_dir, f"{name}_{bsz}x{s}.cuvil"))
            feeds = feeds_for(name, bsz, s, rng)
            ref = _ort(m, feeds)
            with load_bundle(path) as gm:
                got = gm.run(*[feeds[vi.name] for vi in m.graph.input])
            err = max(rel_error(a, r) for a, r in zip(got, ref))
            rows.append({"model": name, "B": bsz, "S": s, "rel_err": err, "status": "pass" if err <= RTOL else "mismatch"})
            print(f"{name:32} B={bsz} S={s:<4} rel.err {err:.2e} {rows[-1]['status']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
