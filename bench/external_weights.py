"""What external and encrypted weights cost at load time, and that they cost nothing per run.

One model, ``y = relu(x @ W1) @ W2`` with ``--mb`` MiB of float32 weights, compiled three ways: weights
embedded in the library, external (``libNAME.weights``, mapped read-only and shared, its SHA-256 checked by
the library's bind_weights), external and encrypted (AES-256-GCM, decrypted into private memory). Each
variant is loaded in ``--procs`` fresh processes (a process loads a library once: a second load in the same
process reuses the binding), each reporting the time from ``cuvil.load`` to the end of the first run and the
median of ``--runs`` later runs. Printed: medians, ratios to the embedded library, and the CPU.

    PYTHONPATH=src python3 bench/external_weights.py --mb 64 --procs 5
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
from cuvil.targets.x86.weights_file import new_key_file  # noqa: E402

CHILD = r"""
import json, sys, time
import numpy as np
import cuvil
path, key, runs, k = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4])
x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
t0 = time.perf_counter()
m = cuvil.load(path, num_threads=1, weights_key=key)
m.run(x)
first = time.perf_counter() - t0
times = []
for _ in range(runs):
    t = time.perf_counter()
    m.run(x)
    times.append(time.perf_counter() - t)
print(json.dumps({"first": first, "run": sorted(times)[len(times) // 2]}))
"""


def model(k: int, n: int):
    rng = np.random.default_rng(1)
    w1 = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    w2 = (rng.standard_normal((n, k)) / np.sqrt(n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, k])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="MiB of weights (default 64)")
    ap.add_argument("--procs", type=int, default=5, help="fresh processes per variant (default 5)")
    ap.add_argument("--runs", type=int, default=50, help="runs after the first, per process (default 50)")
    args = ap.parse_args()
    k = 1024
    n = max(1, args.mb * (1 << 20) // (4 * 2 * k))
    tmp = tempfile.mkdtemp(prefix="cuvil-weights-bench-")
    key = os.path.join(tmp, "key")
    new_key_file(key)
    p = Pipeline.from_onnx(model(k, n)).optimize()
    variants = {"embedded": ({}, ""), "external": ({"external_weights": True}, ""),
                "encrypted": ({"encrypt_weights": key}, key)}
    paths = {name: p.compile(cache=False, **opts).save(os.path.join(tmp, name, "libmlp.so"))
             for name, (opts, _) in variants.items()}
    results = {}
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    for _ in range(args.procs):      # the variants interleaved, so a load on the machine hits all alike
        for name, (_, kf) in variants.items():
            out = subprocess.run([sys.executable, "-c", CHILD, paths[name], kf, str(args.runs), str(k)],
                                 capture_output=True, text=True, check=True, env=env).stdout
            results.setdefault(name, []).append(json.loads(out))
    print(f"cpu        {cpu_label()}")
    print(f"weights    {2 * k * n * 4 / (1 << 20):.1f} MiB (x[1, {k}] @ W1[{k}, {n}] -> relu -> @ W2[{n}, {k}]), "
          f"1 thread, {args.procs} fresh processes per variant")
    base = {key_: np.median([r[key_] for r in results["embedded"]]) for key_ in ("first", "run")}
    print(f"{'variant':10} {'load+first run ms':>18} {'ratio':>6} {'run us (median)':>16} {'ratio':>6}")
    for name, rs in results.items():
        first, run = np.median([r["first"] for r in rs]), np.median([r["run"] for r in rs])
        print(f"{name:10} {first * 1e3:18.1f} {first / base['first']:6.2f} {run * 1e6:16.1f} {run / base['run']:6.2f}")


if __name__ == "__main__":
    main()
