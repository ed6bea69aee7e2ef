"""The five CNNs (or any light models) beside onnxruntime and OpenVINO (float32) at batch 1, timed in blocks:
per model and thread count, ``--blocks`` rounds in which each engine runs ``--per`` inferences back to back
(50 ms pause between engines); the p50 of each block, then the median over blocks, per engine, and the ratios.
A lighter alternative to bench/run_all.py (no cold starts, no pause before every run) whose block medians
carry less of a loaded machine's noise.

    python3 bench/cnn_blocks.py                                   # the five CNNs, 1 and 2 threads
    python3 bench/cnn_blocks.py --models squeezenet,resnet50 --threads 1 --blocks 11
    python3 bench/cnn_blocks.py --models squeezenet,inception_v1 --ab concat_in_place   # an X86Tuning A/B

``--ab FIELD`` adds a second Cuvil library, compiled with the boolean ``X86Tuning`` field FIELD flipped from its
default ("Cuvil B"), as one more engine of every block, and the column B / Cuvil: an A/B of a compiler choice
side by side with the peers in one process. The two libraries' outputs are compared bit for bit first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import light_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import openvino_peer, openvino_version, ort_runner, ort_session  # noqa: E402 - bench/ is no package

MODELS = "squeezenet,resnet50,shufflenet,densenet121,inception_v1"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--per", type=int, default=5, help="inferences per engine and block")
    ap.add_argument("--ab", metavar="FIELD", help="a boolean X86Tuning field: also time the library with it flipped")
    a = ap.parse_args(argv)
    flipped = None
    if a.ab:
        from cuvil.targets.x86.tuning import X86Tuning
        default = getattr(X86Tuning(), a.ab)
        if not isinstance(default, bool):
            ap.error(f"--ab {a.ab}: not a boolean field of X86Tuning")
        flipped = X86Tuning(**{a.ab: not default})
        print(f"Cuvil B: X86Tuning({a.ab}={not default}) (Cuvil: the default, {default})")
    ov = openvino_version() is not None
    print(f"{cpu_label()}; OpenVINO {'float32' if ov else 'not installed'}")
    b_head = (" Cuvil B p50 (ms) | B / Cuvil |", "---:|---:|") if flipped else ("", "")
    print(f"| model | threads | Cuvil p50 (ms) | ORT p50 (ms) | OV p50 (ms) | Cuvil / ORT | Cuvil / OV |{b_head[0]} "
          "load (1 min) |")
    print(f"|---|---:|---:|---:|---:|---:|---:|{b_head[1]}---:|")
    for name in a.models.split(","):
        m = light_model(name, seed=0)
        rng = np.random.default_rng(1)
        feeds = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
                 for vi in m.graph.input}
        pipe = Pipeline.from_onnx(m).optimize()
        lib = pipe.compile().model()
        args = list(feeds.values())
        lib_b = pipe.compile(tuning=flipped).model() if flipped else None
        if lib_b is not None:
            for x, y in zip(lib.run(*args), lib_b.run(*args)):
                if not np.array_equal(x, y):
                    print(f"{name}: Cuvil B's outputs differ from Cuvil's", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name + ".onnx")
            onnx.save(m, path)
            for t in a.threads:
                eng = {"cuvil": (lambda t=t: lib.run(*args, num_threads=t)), "ort": ort_runner(ort_session(m, t), feeds)}
                if lib_b is not None:
                    eng["b"] = lambda t=t: lib_b.run(*args, num_threads=t)
                if ov:
                    eng["ov"] = openvino_peer(path, t, list(feeds), args)
                for f in eng.values():
                    for _ in range(3):
                        f()
                meds = {k: [] for k in eng}
                for _ in range(a.blocks):
                    for k, f in eng.items():
                        ts = []
                        for _ in range(a.per):
                            s = time.perf_counter()
                            f()
                            ts.append(time.perf_counter() - s)
                        meds[k].append(statistics.median(ts))
                        time.sleep(0.05)
                p = {k: 1e3 * statistics.median(v) for k, v in meds.items()}
                o = p.get("ov", float("nan"))
                b_cols = f" {p['b']:.2f} | {p['b'] / p['cuvil']:.2f} |" if lib_b is not None else ""
                print(f"| {name} | {t} | {p['cuvil']:.2f} | {p['ort']:.2f} | {o:.2f} | {p['cuvil'] / p['ort']:.2f} | "
                      f"{p['cuvil'] / o:.2f} |{b_cols} {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
