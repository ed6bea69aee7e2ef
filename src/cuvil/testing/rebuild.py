"""Builds for the reproducible-build check (tests/test_reproducible.py, docs/supply-chain.md): run as
``python -m cuvil.testing.rebuild OUT CASE...`` it compiles each case with the artifact cache off, from an
ONNX file written in the working directory, and records every file of the artifact (library or bundle
files, header, manifest, SBOM, provenance) in ``OUT/CASE/SHA256SUMS`` (``sha256  NAME`` lines, sorted),
copying the files of up to :data:`KEEP_BYTES` into ``OUT/CASE/`` as well (so a difference can be read);
the build itself is removed (a light VGG-19 library is 0.5 GB). It prints one line per case with the
seconds it took, wall and CPU. Two runs in different directories, with different ``PYTHONHASHSEED``
values, must record the same digests and files.

Cases: the nine light models (:data:`cuvil.testing.LIGHT_MODELS`, seeded weights), ``bert_block``
(symbolic batch and sequence over a shape profile: one library for a range of shapes) and ``gpu_demo`` (the
demo CNN as a GPU bundle for sm_90: the PTX, and the cubin where ptxas is installed)."""
from __future__ import annotations

import os
import shutil
import sys
import time

import onnx

from ..artifact import artifact_files
from ..pipeline import Pipeline
from ..supply_chain import sha256_file
from .bert_block import BERT_BLOCK_PROFILE, bert_block
from .models import LIGHT_MODELS, light_model

DYNAMIC_CASES = ("bert_block",)
GPU_CASES = ("gpu_demo",)
CASES = LIGHT_MODELS + DYNAMIC_CASES + GPU_CASES
#: Files up to this size are copied beside the digests (JSON, headers, PTX); larger ones are only hashed.
KEEP_BYTES = 4 << 20


def build(case: str):
    """Compile ``case`` (cache off) from an ONNX file written in the working directory; the artifact."""
    if case == "gpu_demo":
        src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "demo_cnn.onnx")
        shutil.copyfile(src, "demo_cnn.onnx")
        return Pipeline.from_onnx("demo_cnn.onnx").optimize().compile("nvptx64-nvidia-cuda", arch="sm_90",
                                                                      cache=False)
    model = bert_block() if case == "bert_block" else light_model(case, seed=0)
    onnx.save(model, f"{case}.onnx")
    profiles = BERT_BLOCK_PROFILE if case == "bert_block" else None
    return Pipeline.from_onnx(f"{case}.onnx").optimize().compile(shape_profiles=profiles, cache=False)


def record(art, out_dir: str) -> None:
    """``out_dir/SHA256SUMS`` of every file of ``art``, and copies of the small ones; ``art``'s build removed."""
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    for name, path in artifact_files(art.path).items():
        lines.append(f"{sha256_file(path)}  {name}\n")
        if os.path.getsize(path) <= KEEP_BYTES:
            dest = os.path.join(out_dir, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(path, dest)
    with open(os.path.join(out_dir, "SHA256SUMS"), "w", encoding="utf-8") as f:
        f.writelines(lines)
    shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def _cpu() -> float:
    """CPU seconds of this process and its finished children (cc, ptxas)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv) -> int:
    out, cases = argv[0], argv[1:]
    for case in cases:
        t0, c0 = time.perf_counter(), _cpu()
        record(build(case), os.path.join(out, case))
        print(f"{case} {time.perf_counter() - t0:.1f} s ({_cpu() - c0:.1f} s of CPU)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
