"""A/B of the x86 GEMM kernels' module constants (``cuvil.targets.x86.matmul``: NEXT_PANEL_L2_BYTES,
NEXT_PANEL_PREFETCH, NEXT_PANEL_SPREAD, MATMUL_PREFETCH_K, MATMUL_UNROLL_K; ``cuvil.targets.x86.gemm``: PREFETCH_K,
NEXT_CHUNK_PREFETCH, A_BLOCK_BYTES, B_BLOCK_BYTES) on a whole model with its weights streaming from memory as in
bench/run_all.py and bench/cnn_blocks.py (where onnxruntime and OpenVINO run in between and evict them): a 700 MB
buffer is read before every timed run. Models: BERT-base (``cuvil.testing.hf_models.bert_model``, seeded weights,
340 MB of float32; B = 1 at the fixed sequence length ``--seq``) or a CNN of ``cuvil.testing.light_model`` (batch
1). One library per variant (built uncached: the constants are not in the cache key), one thread, the calling
thread's CPU time of single runs, variants alternating in order and reverse; the outputs are compared bit for bit
with the first variant's.

    PYTHONPATH=src python3 bench/knobs_ab.py bert "base,NEXT_PANEL_L2_BYTES=1<<20" --seq 32 [--rounds 7] [--warm]
    PYTHONPATH=src python3 bench/knobs_ab.py resnet50 "base,PREFETCH_K=64"

A variant is ``base`` or ``NAME=PYTHON_EXPR`` terms joined by ``+`` (each NAME one of KNOBS). ``--warm``: no
eviction.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import numpy as np

from cuvil import Pipeline
from cuvil.kernels.lower import attention as attention_lowering
from cuvil.targets.x86 import codegen, gemm, matmul
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import LIGHT_MODELS, light_model
from cuvil.testing.hf_models import bert_model, text_feeds

KNOBS = {"NEXT_PANEL_L2_BYTES": matmul, "NEXT_PANEL_PREFETCH": matmul, "NEXT_PANEL_SPREAD": matmul,
         "MATMUL_PREFETCH_K": matmul,
         "MATMUL_UNROLL_K": matmul, "PREFETCH_K": gemm, "NEXT_CHUNK_PREFETCH": gemm,
         "A_BLOCK_BYTES": gemm, "B_BLOCK_BYTES": gemm, "EXP_SCALEF": codegen,
         "KEY_BLOCK": attention_lowering, "QUERY_BLOCK": attention_lowering, "KEY_PANELS_FROM_ROWS": attention_lowering}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"bert or one of {', '.join(LIGHT_MODELS)}")
    ap.add_argument("variants", help="comma-separated: base, or NAME=EXPR[+NAME=EXPR...]")
    ap.add_argument("--seq", type=int, default=128, help="BERT's sequence length")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warm", action="store_true", help="no 700 MB read between runs")
    a = ap.parse_args(argv)
    if a.model == "bert":
        model = bert_model()
        feeds = text_feeds(model, 1, a.seq)
        fixed = {"batch": 1, "sequence": a.seq}
        what = f"BERT-base B = 1, S = {a.seq}"
    else:
        model = light_model(a.model, seed=0)
        fixed, what = None, f"{a.model} batch 1"
    p = Pipeline.from_onnx(model).optimize()
    shipped = {k: getattr(mod, k) for k, mod in KNOBS.items()}
    libs = {}
    names = a.variants.split(",")
    if len(set(names)) != len(names):
        raise SystemExit(f"variants repeat: {a.variants}")
    try:
        for v in names:
            for k, val in shipped.items():
                setattr(KNOBS[k], k, val)
            for term in v.split("+"):
                if term != "base":
                    name, expr = term.split("=", 1)
                    if name not in KNOBS:
                        raise SystemExit(f"unknown knob {name!r}: one of {', '.join(KNOBS)}")
                    setattr(KNOBS[name], name, eval(expr, {}))
            libs[v] = p.compile(fixed=fixed, cache=False).model()
    finally:
        for k, val in shipped.items():
            setattr(KNOBS[k], k, val)
    if a.model != "bert":
        inp = next(iter(libs.values())).inputs[0]
        feeds = {inp.name: np.random.default_rng(1).standard_normal(inp.shape).astype(np.float32)}
    first = None
    for v, m in libs.items():
        out = [np.asarray(o) for o in m.run(num_threads=1, **feeds)]
        if first is None:
            first = out
        same = len(out) == len(first) and all(np.array_equal(x, y) for x, y in zip(out, first))
        with open(m.path, "rb") as f:     # whether the variants built different code at all
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        print(f"{v}: library sha256 {digest}; outputs {'bit-identical to' if same else 'DIFFER from'} the first "
              "variant's")
    big = np.ones(700 << 18, dtype=np.float32)
    times = {v: [] for v in libs}
    for r in range(a.rounds):
        for v in (list(libs) if r % 2 == 0 else list(reversed(libs))):
            if not a.warm:
                big.sum()
            t = time.thread_time()
            libs[v].run(num_threads=1, **feeds)
            times[v].append((time.thread_time() - t) * 1e3)
    print(f"{what}, 1 thread, CPU time of single runs, {a.rounds} rounds, "
          f"{'warm' if a.warm else 'weights evicted before each run'}; {cpu_label()}; load {os.getloadavg()[0]:.2f}")
    base = statistics.median(next(iter(times.values())))
    for v, xs in times.items():
        med = statistics.median(xs)
        print(f"  {v:40s} p50 {med:8.2f} ms  min {min(xs):8.2f}  x{med / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
