"""A/B of two BERT-base libraries (``cuvil.testing.hf_models``, seeded weights; each one library for B = 1..8,
S = 1..512, as bench/run_all.py's transformer section builds it), or of two GPT-2 decode-step libraries
(``--model gpt2_decode``: ``--seqs`` are then past lengths), in one process, B = 1, the libraries
alternating in order and reverse, outputs compared bit for bit. 1 thread: p50 of the calling thread's CPU time
per run over rounds of back-to-back runs (time spent descheduled counts for neither); 2 threads: wall p50.

    # a library of each build, e.g. the previous commit's source in /tmp/old:
    PYTHONPATH=/tmp/old/src python3 -c "import sys; sys.path.insert(0, 'bench'); import bert_wall_gap as g; g.build('/tmp/a.so')"
    PYTHONPATH=src python3 -c "import sys; sys.path.insert(0, 'bench'); import bert_wall_gap as g; g.build('/tmp/b.so')"
    PYTHONPATH=src python3 bench/transformer_libs_ab.py /tmp/a.so /tmp/b.so [--seqs 32,128,384] [--rounds 7] [--threads 1]
    PYTHONPATH=src python3 bench/transformer_libs_ab.py /tmp/g1.so /tmp/g2.so --model gpt2_decode --seqs 128,1023

The CPU model is printed first; a shared VM's timings are noisy: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import statistics
import time

from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.loader import load
from cuvil.testing.hf_models import BERT_BASE, GPT2_SMALL, bert_model, gpt2_decode_model, text_feeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=["bert", "gpt2_decode"], default="bert")
    a = ap.parse_args(argv)
    model = bert_model(**BERT_BASE) if a.model == "bert" else gpt2_decode_model(**GPT2_SMALL)
    libs = {"A": load(a.a, num_threads=a.threads), "B": load(a.b, num_threads=a.threads)}
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    print(f"{cpu_label()} | {a.threads} thread(s) | A {a.a} | B {a.b}")
    for s in (int(x) for x in a.seqs.split(",")):
        feeds = text_feeds(model, 1, s)
        feeds = {k: v for k, v in feeds.items() if k in {x.name for x in libs["A"].inputs}}
        outs = {k: lib.run(**feeds) for k, lib in libs.items()}
        same = all(x.tobytes() == y.tobytes() for x, y in zip(outs["A"], outs["B"]))
        times = {"A": [], "B": []}
        n = max(1, 300 // s) if a.model == "bert" else 20       # runs per round
        for r in range(a.rounds):
            for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
                t0 = clock()
                for _ in range(n):
                    libs[k].run(**feeds)
                times[k].append(1e3 * (clock() - t0) / n)
        ta, tb = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"{'S' if a.model == 'bert' else 'past'} = {s:4d}: A {ta:8.2f} ms  B {tb:8.2f} ms  B/A {tb / ta:.3f}  bits {'same' if same else 'DIFFER'}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
