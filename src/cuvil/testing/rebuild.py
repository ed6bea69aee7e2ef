"""Builds for the reproducible-build check (tests/test_reproducible.py, docs/supply-chain.md): run as
``python -m cuvil.testing.rebuild OUT CASE...`` it compiles each case with the artifact cache off and saves
the artifact (every file: library or bundle, header, manifest, SBOM, provenance) under ``OUT/CASE/``, and
prints one line per case with the seconds it took (wall and CPU). Two runs in different directories, with different
``PYTHONHASHSEED`` values, must write byte-identical trees.

Cases: the nine light models (:data:`cuvil.testing.LIGHT_MODELS`, seeded weights, saved to an ONNX file
first, so the SBOM names a file), ``bert_block`` (symbolic batch and sequence, with a shape profile: one
library for a range of shapes) and ``gpu_demo`` (the demo CNN as a GPU bundle for sm_90: the PTX, and the
cubin where ptxas is installed)."""
from __future__ import annotations

import os
import shutil
import sys
import time

import onnx

from ..pipeline import Pipeline
from .bert_block import BERT_BLOCK_PROFILE, bert_block
from .models import LIGHT_MODELS, light_model

DYNAMIC_CASES = ("bert_block",)
GPU_CASES = ("gpu_demo",)
CASES = LIGHT_MODELS + DYNAMIC_CASES + GPU_CASES


def build(case: str, out_dir: str) -> str:
    """Compile ``case`` (cache off) from an ONNX file written in the working directory; save its artifact
    into ``out_dir``; return the saved path."""
    os.makedirs(out_dir, exist_ok=True)
    if case == "gpu_demo":
        src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "demo_cnn.onnx")
        model_path = "demo_cnn.onnx"
        shutil.copyfile(src, model_path)
        art = Pipeline.from_onnx(model_path).optimize().compile("nvptx64-nvidia-cuda", arch="sm_90", cache=False)
        return _saved(art, os.path.join(out_dir, "demo.cuvil"))
    model = bert_block() if case == "bert_block" else light_model(case, seed=0)
    model_path = f"{case}.onnx"
    onnx.save(model, model_path)
    profiles = BERT_BLOCK_PROFILE if case == "bert_block" else None
    art = Pipeline.from_onnx(model_path).optimize().compile(shape_profiles=profiles, cache=False)
    return _saved(art, os.path.join(out_dir, os.path.basename(art.path)))


def _saved(art, path: str) -> str:
    """``art`` saved to ``path``, its build directory (a temporary one: cache off) removed."""
    out = art.save(path)
    shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)
    return out


def _cpu() -> float:
    """CPU seconds of this process and its finished children (cc, ptxas)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv) -> int:
    out, cases = argv[0], argv[1:]
    for case in cases:
        t0, c0 = time.perf_counter(), _cpu()
        build(case, os.path.join(out, case))
        print(f"{case} {time.perf_counter() - t0:.1f} s ({_cpu() - c0:.1f} s of CPU)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
