"""What the erf GELU fused into BERT's FFN1 product costs: the product 768 -> 3072 + bias alone against the same
product with torch's erf GELU in its epilogue (bench/bert_ab.py's ``dense`` / ``dense_gelu``), each one library
for S = 1..512, 1 thread, alternating rounds of the step profiler (kernel time), at S = 128 and 384. ``--knob
NAME=EXPR`` adds the GELU product built with a module constant of the x86 code generator changed (e.g.
``EXP_SCALEF=False``).

    PYTHONPATH=src python3 bench/gelu_cost.py [--rounds 9] [--knob EXP_SCALEF=False]

The CPU model is printed first; a shared VM's timings are noisy: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert_ab import dense, dense_gelu  # noqa: E402
from knobs_ab import KNOBS  # noqa: E402

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402


def build(model, knobs=()):
    """A library for S = 1..512 in a fresh cache (the module constants are not in the cache key)."""
    os.environ["CUVIL_CACHE_DIR"] = tempfile.mkdtemp(prefix="cuvil-gelu-cost-")
    old = {}
    for kv in knobs:
        name, _, expr = kv.partition("=")
        old[name] = getattr(KNOBS[name], name)
        setattr(KNOBS[name], name, eval(expr, {}))
    try:
        return Pipeline.from_onnx(model).optimize().compile(shape_profiles={"S": (1, 128, 512)}).model()
    finally:
        for name, v in old.items():
            setattr(KNOBS[name], name, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=EXPR")
    a = ap.parse_args(argv)
    for kv in a.knob:
        if kv.partition("=")[0] not in KNOBS:
            ap.error(f"unknown knob {kv!r}; one of {', '.join(KNOBS)}")
    libs = {"plain": build(dense(768, 3072)), "gelu": build(dense_gelu(768, 3072))}
    if a.knob:
        libs["gelu " + " ".join(a.knob)] = build(dense_gelu(768, 3072), a.knob)
    print(f"{cpu_label()} | 1 thread | kernel time, median of {a.rounds} rounds of 10 profiled runs")
    for s in (128, 384):
        x = np.random.default_rng(1).standard_normal((s, 768)).astype(np.float32)
        acc = {k: [] for k in libs}
        for r in range(a.rounds):
            for k, m in (list(libs.items()) if r % 2 == 0 else list(libs.items())[::-1]):
                acc[k].append(sum(m.profile(x=x, runs=10, num_threads=1)))
        base = np.median(acc["plain"])
        print(f"S = {s}: " + "  ".join(f"{k} {1e3 * np.median(v):.3f} ms (x{np.median(v) / base:.3f})"
                                       for k, v in acc.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
