"""SHA-256 of the PTX that the GPU test models compile to, for refactors of the PTX kernels that must not change
a byte (the "process replay" of the GPU matmul kernels; no GPU needed, ptxas not needed).

    PYTHONPATH=src python scripts/ptx_digest.py --write before.json   # on the old commit
    PYTHONPATH=src python scripts/ptx_digest.py --check before.json   # after the change: exit 1 on a difference

Covers the matmul models of tests/test_gpu_matmul_simt.py (strict fp32 with and without fma, every forced SIMT
tile of its ptxas test, TF32 / fp16 / bf16 tensor cores) and a small BERT block (fp32, TF32, fp16)."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

from cuvil import Pipeline
from cuvil.targets.ptx.codegen import build_ptx, gpu_schedule
from cuvil.targets.ptx.tuning import PtxTuning
from cuvil.testing.bert_block import bert_block
from cuvil.testing.matmul_models import attention_scores, batched_matmul, gemm_transb_residual, linear_gelu

MODELS = {
    "linear_gelu": lambda: linear_gelu(2, 40, 272, 48)[0],
    "ragged_short_k": lambda: linear_gelu(3, 37, 17, 50)[0],
    "long_k": lambda: linear_gelu(1, 130, 3001, 70)[0],
    "qkt": lambda: attention_scores(2, 3, 40, 32)[0],
    "pv": lambda: batched_matmul(2, 3, 40, 45, 33)[0],
    "gemm_transb": lambda: gemm_transb_residual(24, 200, 56)[0],
}
FORCED = [(), (128, 64, 1), (64, 64, 4), (32, 32, 8), (16, 32, 8), (32, 16, 8)]


def _bert():
    import onnx
    m = bert_block(batch=1, seq=40)
    return m if isinstance(m, onnx.ModelProto) else m[0]


def variants():
    for name, make in list(MODELS.items()) + [("bert_block", _bert)]:
        s = gpu_schedule(Pipeline.from_onnx(make()).optimize().graph)
        forced = FORCED if name != "bert_block" else [()]
        for force in forced:
            for fma in (True, False):
                yield f"{name}/fp32/fma={fma}/force={force}", lambda s=s, fma=fma, force=force: build_ptx(
                    s, "sm_90", fma=fma, tuning=PtxTuning(simt_force=force))
        yield f"{name}/tf32", lambda s=s: build_ptx(s, "sm_90", fma=True, allow_tf32=True)
        for fmt in ("fp16", "bf16"):
            yield f"{name}/{fmt}", lambda s=s, fmt=fmt: build_ptx(
                s, "sm_90", fma=True, allow_tf32=True, precisions={st.name: fmt for st in s.stages})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="JSON")
    g.add_argument("--check", metavar="JSON")
    a = ap.parse_args(argv)
    got = {k: hashlib.sha256(make().ptx.encode()).hexdigest() for k, make in variants()}
    if a.write:
        with open(a.write, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
        print(f"{len(got)} PTX digests -> {a.write}")
        return 0
    with open(a.check) as f:
        want = json.load(f)
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    for k in bad:
        print(f"differs: {k}")
    print(f"{len(got) - len(bad)} of {len(got)} PTX modules byte-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
