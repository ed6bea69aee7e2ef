"""Same input, same bits? Repeated calls of one GPU bundle, per code-generation option, as CUDA graphs and eagerly.

    python3 bench/gpu/determinism.py [--calls 8] [--variants default staged_out=0 ...] [--json OUT]

For each variant (``default``, or ``name=value`` overrides of :class:`cuvil.targets.ptx.tuning.PtxTuning`, several
joined by ``,``): ResNet-50 (onnx's light model, batch 1, BatchNormalization scales in [0.25, 0.75] so that its
activations stay within float16's range) compiled with ``enable_fp16``, loaded, and one input run
``--calls`` times as CUDA graphs (the first call captures) and then eagerly (kernels launched one by one); per
call: equal to the first call's bits or not, the largest difference, and the relative error against onnxruntime
float32. A variant whose calls all agree prints ``deterministic``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "..", "src"))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--model", default="resnet50", choices=["resnet50"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import onnxruntime as ort
    from cuvil import Pipeline
    from cuvil.targets.ptx.bundle import compile_bundle
    from cuvil.targets.ptx.runtime import device_info, load_bundle
    from cuvil.targets.ptx.tuning import PtxTuning
    from cuvil.testing import with_batch
    from codegen_settings import parse_assignments
    from profiles import resnet50_batched
    info = device_info(0)
    print(f"device: {info['name']} ({info['arch']})", flush=True)
    model = resnet50_batched(bn_scale=(0.25, 0.75))     # activations within float16's range
    name = model.graph.input[0].name
    x = np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    results = {}
    for text in a.variants:
        kw = parse_assignments(text)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "b")
            g = Pipeline.from_onnx(with_batch(model, 1)).optimize().graph
            compile_bundle(g, out, arch=info["arch"], enable_fp16=True, tuning=PtxTuning(**kw))
            rows = []
            for mode in ("graph", "eager"):
                with load_bundle(out, mode=mode) as m:
                    ys = [np.array(m.run({name: x})[m.outputs[0].name], dtype=np.float32) for _ in range(a.calls)]
                first = ys[0]
                for i, y in enumerate(ys):
                    rows.append({"mode": mode, "call": i, "same_as_first": bool(np.array_equal(y, first)),
                                 "max_diff_vs_first": float(np.max(np.abs(y - first))),
                                 "rel_err_vs_ort": float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                                 "nan": bool(np.isnan(y).any())})
        same = all(r["same_as_first"] for r in rows if r["mode"] == "graph") and \
            all(r["same_as_first"] for r in rows if r["mode"] == "eager")
        g0 = next(r for r in rows if r["mode"] == "graph")
        e0 = next(r for r in rows if r["mode"] == "eager")
        across = "graph call 0 = eager call 0" if g0["rel_err_vs_ort"] == e0["rel_err_vs_ort"] else "graph != eager"
        print(f"{text}: {'deterministic' if same else 'NOT deterministic'} ({across})", flush=True)
        for r in rows:
            print(f"   {r['mode']:5} call {r['call']}: same {r['same_as_first']!s:5} max diff {r['max_diff_vs_first']:.3e} "
                  f"rel err vs ORT {r['rel_err_vs_ort']:.3e}{' NaN' if r['nan'] else ''}", flush=True)
        results[text] = {"deterministic": same, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
