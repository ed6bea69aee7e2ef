"""Where BERT-base's single timed runs lose against its back-to-back step profile (issue 20): the same library,
one thread, timed in four situations, interleaved round by round, each with its per-step profile:

- ``b2b``: right after another run of itself (everything it touched last is as warm as it gets);
- ``pause``: after an idle pause only (what the caches and the core keep over idle time);
- ``ort``: after an onnxruntime run of the same model and a pause (run_all's transformer protocol);
- ``evict``: after a 700 MB read and a pause (no weight cached).

Per situation: the wall p50, the steps' sum, and the steps that grow most against ``b2b``; the kernel kinds'
sums side by side. What this separates: time outside kernels (wall - steps), and per kernel kind what the
previous engine's run costs (weights, activations, code and page-table walks out of the caches).

    PYTHONPATH=src python3 bench/bert_wall_gap.py --seq 128 [--rounds 9] [--lib /tmp/bert.so]

The CPU model is printed first; a shared VM's timings are noisy: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def build(out: str) -> None:
    from cuvil import Pipeline
    from cuvil.testing.hf_models import BERT_BASE, BERT_PROFILE, bert_model
    os.environ.setdefault("CUVIL_CACHE_DIR", tempfile.mkdtemp(prefix="cuvil-bert-gap-"))
    p = Pipeline.from_onnx(bert_model(**BERT_BASE)).optimize()
    art = p.compile(shape_profiles={k: v for k, v in BERT_PROFILE.items() if k in p.graph.symbols})
    art.save(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--pause-ms", type=float, default=100)
    ap.add_argument("--lib", default="/tmp/cuvil-bert-gap/libbert.so", help="built here when missing")
    ap.add_argument("--situations", nargs="+", default=["b2b", "pause", "ort", "evict"])
    a = ap.parse_args(argv)
    from cuvil.targets.x86.cpu import cpu_label
    from cuvil.targets.x86.loader import load
    from cuvil.testing.hf_models import BERT_BASE, bert_model, text_feeds
    from engines import ort_runner, ort_session
    if not os.path.exists(a.lib):
        os.makedirs(os.path.dirname(a.lib), exist_ok=True)
        t0 = time.perf_counter()
        build(a.lib)
        print(f"built {a.lib} in {time.perf_counter() - t0:.0f} s")
    print(f"{cpu_label()} | 1 thread | S = {a.seq} | load {os.getloadavg()[0]:.2f}")
    model = bert_model(**BERT_BASE)
    feeds = text_feeds(model, 1, a.seq)
    lib = load(a.lib, num_threads=1)
    mine = {k: v for k, v in feeds.items() if k in {d.name for d in lib.inputs}}
    ort = ort_runner(ort_session(model, 1), feeds)
    man = json.load(open(a.lib[:-3] + ".manifest.json"))
    big = np.ones(700 << 18, np.float32)
    pause = a.pause_ms / 1e3
    before = {"b2b": lambda: lib.run(**mine), "pause": lambda: time.sleep(pause),
              "ort": lambda: (ort(), time.sleep(pause)), "evict": lambda: (float(big.sum()), time.sleep(pause))}
    for _ in range(2):
        lib.run(**mine)
        ort()
    wall = {k: [] for k in a.situations}
    steps = {k: [] for k in a.situations}
    for r in range(a.rounds):
        for k in (a.situations if r % 2 == 0 else a.situations[::-1]):
            before[k]()
            t0 = time.perf_counter()
            lib.run(**mine)
            wall[k].append(1e3 * (time.perf_counter() - t0))
            before[k]()
            steps[k].append(np.array(lib.profile(runs=1, num_threads=1, warm_up=False, **mine)))
    med = {k: 1e3 * np.median(np.stack(v), axis=0) for k, v in steps.items()}
    ran = med[a.situations[0]] > 0
    ref = a.situations[0]
    print(f"{'situation':9} {'wall p50':>9} {'min':>8} {'steps':>8} {'outside':>8}  (ms; x of {ref})")
    for k in a.situations:
        w = statistics.median(wall[k])
        s = med[k][ran].sum()
        print(f"{k:9} {w:9.2f} {min(wall[k]):8.2f} {s:8.2f} {w - s:8.2f}  x{w / statistics.median(wall[ref]):.3f}")
    kinds: dict = {}
    for i in np.flatnonzero(ran):
        st = man["steps"][i]
        key = f"{st['kernel']} {st['op']}"
        kinds.setdefault(key, np.zeros(len(a.situations)))
        kinds[key] += [med[k][i] for k in a.situations]
    print("kernel kinds (ms, per situation: " + " / ".join(a.situations) + ")")
    for key, v in sorted(kinds.items(), key=lambda kv: -kv[1][-1]):
        if v[-1] >= 0.2:
            print(f"  {key:44} " + " ".join(f"{x:8.2f}" for x in v) + f"   x{v[-1] / v[0]:.3f}")
    worst = a.situations[-1]
    d = med[worst] - med[ref]
    print(f"steps growing most, {ref} -> {worst}:")
    for i in np.argsort(-d)[:12]:
        st = man["steps"][i]
        print(f"  step {i:4} {med[ref][i]:7.3f} -> {med[worst][i]:7.3f} ms  {st['kernel']} {st['op']} "
              f"{st.get('stage', '')} {st.get('tile', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
