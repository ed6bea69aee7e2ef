"""``--tune`` side by side (issue 20, per-CPU tile choices): each model compiled by Cuvil with the cost model's
choices ("default") and with ``tune=True`` ("tuned"), beside onnxruntime (float32, same thread count), at 1
and 2 threads; prints a Markdown table of p50 times and ratios to onnxruntime, with the CPU and the load.

    PYTHONPATH=src python3 bench/tune_models.py                                # ResNet-50, SqueezeNet
    PYTHONPATH=src python3 bench/tune_models.py --models shufflenet,densenet121,inception_v1 --rounds 9
    PYTHONPATH=src python3 bench/tune_models.py --budget 300 --json bench/results/tune.json

The tuner's choices are cached in ``$CUVIL_CACHE_DIR/tune`` (run it twice: the second compile measures
nothing); its compile time is reported as measured in this run (0 s of measuring on a warm cache). Timing:
per thread count, rounds of one block per engine (about ``--block-ms`` of runs each), engines in order and
reverse on alternate rounds, p50 over the rounds of each block's mean; beside the wall time, the calling
thread's CPU time (``time.thread_time``) per run. Shared machines are noisy: read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing import light_model
from cuvil.testing.oracles import max_rel_error, ort_session


def _blocks(engines: dict, x: dict, rounds: int, block_s: float) -> dict:
    """{engine: (p50 wall ms, p50 thread-CPU ms)} over ``rounds`` interleaved blocks."""
    reps = {}
    for name, fn in engines.items():
        fn(x)
        t0 = time.perf_counter()
        fn(x)
        reps[name] = max(1, int(block_s / max(time.perf_counter() - t0, 1e-6)))
    wall = {n: [] for n in engines}
    cpu = {n: [] for n in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn, k = engines[name], reps[name]
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(k):
                fn(x)
            wall[name].append((time.perf_counter() - w0) / k * 1e3)
            cpu[name].append((time.thread_time() - c0) / k * 1e3)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,squeezenet")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block-ms", type=float, default=200.0)
    ap.add_argument("--budget", type=float, default=None, help="--tune-budget seconds (default: the compiler's)")
    ap.add_argument("--json", default="", help="write the raw figures here")
    ap.add_argument("--shipped", action="store_true",
                    help="add Cuvil with the shipped (Zen 5-fitted) X86Tuning() beside the CPU's calibrated default")
    ap.add_argument("--no-tune", action="store_true", help="leave out the tuned build (an A/B of the defaults)")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    print(f"# --tune side by side, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{cpu_label()}; "
          f"load average {os.getloadavg()[0]:.2f} at start; p50 of {a.rounds} interleaved blocks; float32, batch 1; "
          "tuned at 1 thread\n", flush=True)
    raw = {"cpu": cpu_label(), "rounds": a.rounds, "models": {}}
    rows = []
    for name in a.models.split(","):
        model = light_model(name)
        p = Pipeline.from_onnx(model).optimize()
        t0 = time.perf_counter()
        default = p.compile(cache=False)
        t_default = time.perf_counter() - t0
        shipped = p.compile(cache=False, tuning=X86Tuning()) if a.shipped else None
        t0 = time.perf_counter()
        tuned = None if a.no_tune else p.compile(cache=False, tune=True, tune_budget=a.budget)
        t_tuned = time.perf_counter() - t0
        inp = model.graph.input[0]
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        x = {inp.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        report = tuned.manifest["tune"] if tuned else {"layers": []}
        changed = [r for r in report["layers"] if "ms" in r and r["choice"] != r["default"]]
        print(f"## {name}: compile {t_default:.1f} s default, {t_tuned:.1f} s tuned; "
              f"{len(changed)} of {len(report['layers'])} layers take another schedule than the cost model's",
              flush=True)
        for r in changed:
            print(f"- {r['layer']}: {r['default']} -> {r['choice']} "
                  f"({r['ms'][r['default']]:.3f} -> {r['ms'][r['choice']]:.3f} ms alone)"
                  if r["default"] in r["ms"] else f"- {r['layer']}: {r['default']} -> {r['choice']}")
        entry = {"compile_s": {"default": t_default, "tuned": t_tuned}, "tune": report, "threads": {}}
        for t in threads:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = t, 1
            sess = ort_session(model, opts)
            md = load(default.path, num_threads=t)
            mt = load(tuned.path, num_threads=t) if tuned else md
            ref = sess.run(None, x)[0]
            arr = x[inp.name]
            err = max_rel_error(mt.run(arr)[0], ref)
            engines = {"cuvil default": lambda v: md.run(v[inp.name])}
            if tuned:
                engines["cuvil tuned"] = lambda v: mt.run(v[inp.name])
            if shipped:
                ms = load(shipped.path, num_threads=t)
                engines["cuvil shipped"] = lambda v: ms.run(v[inp.name])
            engines["onnxruntime"] = lambda v: sess.run(None, v)
            res = _blocks(engines, x, a.rounds, a.block_ms / 1e3)
            ort_ms = res["onnxruntime"][0]
            load_avg = os.getloadavg()[0]
            entry["threads"][t] = {"ms": res, "load": load_avg, "tuned_rel_err": err}
            rows.append((name, t, res, ort_ms, load_avg))
            res.setdefault("cuvil tuned", res["cuvil default"])
            print(f"  {t} thread(s): " + ", ".join(f"{k} {v[0]:.2f} ms ({v[0] / ort_ms:.2f}x, CPU {v[1]:.2f})"
                                                   for k, v in res.items())
                  + f"; tuned vs onnxruntime max rel err {err:.1e}; load {load_avg:.2f}", flush=True)
        raw["models"][name] = entry
    print("\n| model | threads | Cuvil default (ms) | Cuvil tuned (ms) | onnxruntime (ms) | default / ort | "
          "tuned / ort | tuned / default | thread CPU default / tuned / ort (ms) | CPU ratios default, tuned / ort "
          "| shipped (ms, / ort, CPU / ort CPU) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, t, res, ort_ms, load_avg in rows:
        d, u, o = res["cuvil default"], res["cuvil tuned"], res["onnxruntime"]
        sh = res.get("cuvil shipped")
        shipped_cell = f"{sh[0]:.2f}, {sh[0] / ort_ms:.2f}, {sh[1] / o[1]:.2f}" if sh else "-"
        print(f"| {name} | {t} | {d[0]:.2f} | {u[0]:.2f} | {o[0]:.2f} | {d[0] / ort_ms:.2f} | {u[0] / ort_ms:.2f} | "
              f"{u[0] / d[0]:.2f} | {d[1]:.2f} / {u[1]:.2f} / {o[1]:.2f} | {d[1] / o[1]:.2f}, {u[1] / o[1]:.2f} | "
              f"{shipped_cell} | {load_avg:.2f} |")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
