"""onnxruntime's own per-node times for one of cuvil.testing's light models (its profiler, median over the runs),
to set beside ``bench/x86_profile.py``'s per-kernel times of the same model: both name the model's nodes the same
way (``r64`` ...), and onnxruntime's names carry its layout (``_nchwc``: its channel-blocked convolutions).

    PYTHONPATH=src python3 bench/ort_node_profile.py squeezenet [--threads 1] [--runs 40] [--top 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np
import onnxruntime as ort

from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import LIGHT_MODELS, light_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"one of {', '.join(LIGHT_MODELS)}")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    m = light_model(a.model, seed=0)
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as d:
        so.profile_file_prefix = os.path.join(d, "ort")
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        i = s.get_inputs()[0]
        x = np.random.default_rng(1).standard_normal([d_ if isinstance(d_, int) else 1 for d_ in i.shape])
        for _ in range(a.runs):
            s.run(None, {i.name: x.astype(np.float32)})
        with open(s.end_profiling()) as f:
            events = json.load(f)
    per_node = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            key = (e["name"][:-len("_kernel_time")], e["args"].get("op_name"), str(e["args"].get("output_type_shape")))
            per_node.setdefault(key, []).append(e["dur"] / 1e3)
    med = {k: statistics.median(v) for k, v in per_node.items()}
    print(f"{a.model}: onnxruntime {ort.__version__}, {a.threads} thread(s), {cpu_label()}: "
          f"{sum(med.values()):.3f} ms in nodes (median per node over {a.runs} runs)")
    for (name, op, shape), ms in sorted(med.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{ms:8.3f} ms  {op:16s} {name:28s} {shape[:70]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
