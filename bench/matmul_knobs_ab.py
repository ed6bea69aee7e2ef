"""A/B of the float32 MatMul kernel's module constants (``cuvil.targets.x86.matmul``: NEXT_PANEL_L2_BYTES,
NEXT_PANEL_PREFETCH, MATMUL_PREFETCH_K) on the whole of BERT-base (``cuvil.testing.hf_models.bert_model``, seeded
weights, 340 MB of float32), B = 1 at one fixed sequence length, with its weights streaming from memory as in
bench/run_all.py (where onnxruntime and OpenVINO run in between and evict them): a 700 MB buffer is read before
every timed run. One library per variant (built uncached: the constants are not in the cache key), one thread,
the calling thread's CPU time of single runs, variants alternating in order and reverse; the outputs are
compared bit for bit with the first variant's.

    PYTHONPATH=src python3 bench/matmul_knobs_ab.py 32 "base,NEXT_PANEL_L2_BYTES=4<<20" [--rounds 7] [--warm]

A variant is ``base`` or ``NAME=PYTHON_EXPR`` terms joined by ``+``. ``--warm``: no eviction.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86 import matmul
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.hf_models import bert_model, text_feeds

KNOBS = ("NEXT_PANEL_L2_BYTES", "NEXT_PANEL_PREFETCH", "MATMUL_PREFETCH_K")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seq", type=int)
    ap.add_argument("variants", help="comma-separated: base, or NAME=EXPR[+NAME=EXPR...]")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warm", action="store_true", help="no 700 MB read between runs")
    a = ap.parse_args(argv)
    model = bert_model()
    feeds = text_feeds(model, 1, a.seq)
    p = Pipeline.from_onnx(model).optimize()
    shipped = {k: getattr(matmul, k) for k in KNOBS}
    libs = {}
    try:
        for v in a.variants.split(","):
            for k, val in shipped.items():
                setattr(matmul, k, val)
            for term in v.split("+"):
                if term != "base":
                    name, expr = term.split("=", 1)
                    if name not in KNOBS:
                        raise SystemExit(f"unknown knob {name!r}: one of {', '.join(KNOBS)}")
                    setattr(matmul, name, eval(expr, {}))
            libs[v] = p.compile(fixed={"batch": 1, "sequence": a.seq}, cache=False).model()
    finally:
        for k, val in shipped.items():
            setattr(matmul, k, val)
    first = None
    for v, m in libs.items():
        out = [np.asarray(o) for o in m.run(num_threads=1, **feeds)]
        if first is None:
            first = out
        same = all(np.array_equal(x, y) for x, y in zip(out, first))
        print(f"{v}: outputs {'bit-identical to' if same else 'DIFFER from'} the first variant's")
    big = np.ones(700 << 18, dtype=np.float32)
    times = {v: [] for v in libs}
    for r in range(a.rounds):
        for v in (list(libs) if r % 2 == 0 else list(reversed(libs))):
            if not a.warm:
                big.sum()
            t = time.thread_time()
            libs[v].run(num_threads=1, **feeds)
            times[v].append((time.thread_time() - t) * 1e3)
    print(f"BERT-base B = 1, S = {a.seq}, 1 thread, CPU time of single runs, {a.rounds} rounds, "
          f"{'warm' if a.warm else 'weights evicted before each run'}; {cpu_label()}; load {os.getloadavg()[0]:.2f}")
    base = statistics.median(next(iter(times.values())))
    for v, xs in times.items():
        med = statistics.median(xs)
        print(f"  {v:40s} p50 {med:8.2f} ms  min {min(xs):8.2f}  x{med / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
