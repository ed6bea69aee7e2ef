"""Cuvil beside onnxruntime and OpenVINO (float32; when ``openvino`` is installed) at 1 and 2 threads: five
light CNN architectures (seeded random weights), through the same functions as ``cuvil bench --vs onnxruntime``,
and the transformers of issue 20 (BERT-base at S = 32/128/384 from one library for B = 1..8, S = 1..512; the
GPT-2 decode step with a KV cache at a past of 128 and 1,023, per token; bench/transformer_section.py). Writes
a Markdown report labelled with the CPU and date it comes from: a new file bench/results/YYYY-MM-DD-<cpu>.md,
or bench/RESULTS.md (the figures the README quotes) with ``--update``.

    python3 bench/run_all.py                                   # CNNs and transformers, 1 and 2 threads
    python3 bench/run_all.py --section cnn --update            # the five CNNs, replacing bench/RESULTS.md
    python3 bench/run_all.py --section transformer             # BERT-base and GPT-2 decode only
    python3 bench/run_all.py --section transformer --bert-model bert.torchscript.onnx --gpt2-model gpt2_decode.torchscript.onnx
    python3 bench/run_all.py --models squeezenet --runs 5 --out /tmp/R.md

The transformers are exported by torch.onnx where given (``--bert-model``, ``--gpt2-model``: made by
bench/models/export_transformers.py on a machine with torch and transformers), else built at full size without
torch by ``cuvil.testing.hf_models`` (same inputs, outputs, dims, compute ops and FLOPs).

Per model: a fresh O3 compile (a temporary CUVIL_CACHE_DIR: nothing cached is reused) timed from import to
library; then, per thread count, p50/p99 of both engines alternating run by run, Cuvil's p99/p50, GFLOP/s
(the model's Conv/Gemm/MatMul FLOPs from ``Pipeline.stats().flops`` / p50) and its share of an assumed
per-core fp32 peak, cold start and peak RSS in fresh processes; then Cuvil alone for its own p99/p50, and
beside it the machine's floor: bench/jitter_floor.c (a program that cannot be slow) of the same length,
threads, runs and pauses. Then the geometric mean of the p50 ratios and the goals, each MET or NOT MET with
the measured value. Shared machines are noisy: read ratios.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import llvmlite
import numpy as np
import onnx
import onnxruntime

import cuvil
from cuvil import Pipeline
from cuvil.bench import BenchOptions, host_info, run_benchmark
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import LIGHT_MODELS, light_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformer_section  # noqa: E402 - bench/ is no package
from engines import OPENVINO_MISSING, openvino_peer, openvino_version  # noqa: E402

MODELS = ("resnet50", "squeezenet", "shufflenet", "densenet121", "inception_v1")
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
RESULTS_DIR = os.path.join(HERE, "results")


def dated_report_path(label: str, day: datetime.date, folder: str = RESULTS_DIR) -> str:
    """bench/results/YYYY-MM-DD-<cpu>.md (``-2``, ``-3``... when a run of that day and CPU is there already), so
    a run never overwrites figures measured elsewhere or earlier."""
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "cpu"
    path, k = os.path.join(folder, f"{day.isoformat()}-{slug}.md"), 2
    while os.path.exists(path):
        path, k = os.path.join(folder, f"{day.isoformat()}-{slug}-{k}.md"), k + 1
    return path

# The goals (issue table): name, target text, how the measured value is read, comparison.
GOAL_GEOMEAN = 0.85
GOAL_TAIL = 1.15
GOAL_COLD = 1 / 10
GOAL_RSS = 1 / 3
GOAL_COMPILE_S = 60.0
GOAL_PEAK_PCT = 90.0
GOAL_CNN_ISSUE20 = 0.9     # issue 20: each CNN, 1 and 2 threads, on whatever CPU the run lands on


def fresh_compile(onnx_path: str, so_path: str, opt_level: int):
    """Import + optimize + compile with an empty artifact/proof cache; the library is saved to ``so_path``.
    Returns (pipeline, seconds, manifest)."""
    old = os.environ.get("CUVIL_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="cuvil-fresh-cache-") as cache:
        os.environ["CUVIL_CACHE_DIR"] = cache
        try:
            t0 = time.perf_counter()
            p = Pipeline.from_onnx(onnx_path).optimize()
            art = p.compile(opt_level=opt_level)
            secs = time.perf_counter() - t0
            art.save(so_path)
        finally:
            if old is None:
                os.environ.pop("CUVIL_CACHE_DIR", None)
            else:
                os.environ["CUVIL_CACHE_DIR"] = old
    return p, secs, {**art.manifest, **(art.timings or {})}   # compile_seconds: the artifact's timings


def fmt(x, spec=".2f", unit=""):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    return f"{x:{spec}}{unit}"


def verdict(ok) -> str:
    return "not measured" if ok is None else "MET" if ok else "NOT MET"


def goals(rows, compiles, peak_per_core):
    """(goal, target, measured, verdict) rows."""
    out = []
    ok_rows = [r for r in rows if "error" not in r]
    for model in dict.fromkeys(r["model"] for r in ok_rows):
        mine = [r for r in ok_rows if r["model"] == model]
        worst = max(mine, key=lambda r: r["ratio_p50"])
        out.append((f"{model}: p50 no slower than onnxruntime", "ratio ≤ 1.0 at every thread count",
                    f"{worst['ratio_p50']:.2f} (worst, {worst['threads']} thr)", verdict(worst["ratio_p50"] <= 1.0)))
    for model in dict.fromkeys(r["model"] for r in ok_rows):
        mine = [r for r in ok_rows if r["model"] == model]
        worst = max(mine, key=lambda r: r["ratio_p50"])
        vals = " / ".join(f"{r['ratio_p50']:.2f}" for r in mine)
        ov = " / ".join(fmt(r.get("ratio_ov")) for r in mine)
        out.append((f"issue 20: {model} ≤ {GOAL_CNN_ISSUE20} onnxruntime", f"each thread count "
                    f"({', '.join(str(r['threads']) for r in mine)})", f"{vals} (Cuvil/OV {ov})",
                    verdict(worst["ratio_p50"] <= GOAL_CNN_ISSUE20)))
    ratios = [r["ratio_p50"] for r in ok_rows if r["ratio_p50"] > 0]
    gm = statistics.geometric_mean(ratios) if ratios else math.nan
    out.append(("geometric mean of p50 ratios", f"≤ {GOAL_GEOMEAN}", fmt(gm),
                verdict(None if math.isnan(gm) else gm <= GOAL_GEOMEAN)))

    def worst_of(key, goal, label, target, spec=".2f", lowest=False, rows=None):
        vals = [(r[key], r) for r in (ok_rows if rows is None else rows)
                if r.get(key) is not None and not math.isnan(r[key])]
        if not vals:
            out.append((label, target, "-", verdict(None)))
            return
        v, r = (min if lowest else max)(vals, key=lambda t: t[0])
        ok = v >= goal if lowest else v <= goal
        out.append((label, target, f"{v:{spec}} ({'lowest' if lowest else 'worst'}: {r['model']}, {r['threads']} thr)",
                    verdict(ok)))

    worst_of("tail_alone", GOAL_TAIL, "Cuvil p99 / p50 (Cuvil alone in the process)", f"≤ {GOAL_TAIL}")
    worst_of("tail", GOAL_TAIL, "Cuvil p99 / p50 beside onnxruntime (alternating runs)", f"≤ {GOAL_TAIL}")
    vals = [(r["tail_floor"], r) for r in ok_rows if r.get("tail_floor") is not None]
    if vals:
        v, r = max(vals, key=lambda t: t[0])
        out.append(("the machine's floor: p99 / p50 of bench/jitter_floor.c, same length, threads, runs and pauses",
                    "reported", f"{v:.2f} (worst: {r['model']}, {r['threads']} thr)", "-"))
    worst_of("ratio_cold", GOAL_COLD, "cold start ratio (Cuvil / onnxruntime)", "≤ 1/10 (0.10)", ".3f")
    worst_of("ratio_rss", GOAL_RSS, "peak RSS ratio (Cuvil / onnxruntime)", "≤ 1/3 (0.33)", ".3f")
    if "resnet50" in compiles and "seconds" in compiles["resnet50"]:
        s = compiles["resnet50"]["seconds"]
        out.append(("ResNet-50 compile at O3 (fresh)", f"≤ {GOAL_COMPILE_S:.0f} s", f"{s:.1f} s",
                    verdict(s <= GOAL_COMPILE_S)))
    else:
        out.append(("ResNet-50 compile at O3 (fresh)", f"≤ {GOAL_COMPILE_S:.0f} s", "-", verdict(None)))
    # the issue's figure: ResNet-50 in direct-convolution FLOPs per second against the fp32 ceiling; every
    # model's is in the latency table (and its lowest in the row after, for information)
    worst_of("pct_peak", GOAL_PEAK_PCT, f"ResNet-50: direct-convolution FLOP/s as % of fp32 peak ({peak_per_core:g} GFLOP/s per core)",
             f"≥ {GOAL_PEAK_PCT:.0f}%", ".1f", lowest=True, rows=[r for r in ok_rows if r["model"] == "resnet50"])
    vals = [(r["pct_peak"], r) for r in ok_rows if r.get("pct_peak") is not None and not math.isnan(r["pct_peak"])]
    if vals:
        v, r = min(vals, key=lambda t: t[0])
        out.append(("every model: % of fp32 peak", "reported", f"{v:.1f} (lowest: {r['model']}, {r['threads']} thr)", "-"))
    return out, gm


_PEAK_C = r"""
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
typedef float v __attribute__((vector_size(64)));
#define W 16
#else
typedef float v __attribute__((vector_size(32)));
#define W 8
#endif
int main(void) {
  v a[12], b, c;
  for (int i = 0; i < W; ++i) { b[i] = 1.0000001f; c[i] = 1e-8f; }
  for (int k = 0; k < 12; ++k) for (int i = 0; i < W; ++i) a[k][i] = (float)k;
  struct timespec t0, t1;
  long n = 50000000;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long r = 0; r < n; ++r)
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = a[k] * b + c;   /* 12 independent FMA chains */
  clock_gettime(CLOCK_MONOTONIC, &t1);
  float s = 0;
  for (int k = 0; k < 12; ++k) s += a[k][0];
  double sec = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%.2f %g\n", n * 12.0 * 2 * W / sec / 1e9, s);
  return 0;
}
"""


def measure_peak() -> float:
    """Single-core fp32 FMA throughput (GFLOP/s) of this machine: 12 independent vector FMA chains,
    compiled with cc -O3 -march=native (AVX-512 where the CPU has it); best of 3."""
    with tempfile.TemporaryDirectory(prefix="cuvil-peak-") as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(_PEAK_C)
        subprocess.run(["cc", "-O3", "-march=native", "-ffp-contract=fast", src, "-o", exe], check=True)
        return max(float(subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split()[0])
                   for _ in range(3))


JITTER_FLOOR_C = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jitter_floor.c")


def build_jitter_floor(tmp: str) -> str:
    """bench/jitter_floor.c compiled (cc -O2 -march=native): the machine's own p99/p50 for a program that
    cannot be slow (register-only FMA work plus a streamed buffer, chunks claimed from one counter)."""
    exe = os.path.join(tmp, "jitter_floor")
    subprocess.run(["cc", "-O2", "-march=native", "-pthread", JITTER_FLOOR_C, "-o", exe], check=True)
    return exe


def jitter_floor(exe: str, work_ms: float, stream_mb: float, threads: int, runs: int, pause_ms: float) -> dict:
    out = subprocess.run([exe, f"{work_ms:.3f}", f"{stream_mb:.4f}", str(threads), str(runs), f"{pause_ms:g}"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def peak_note(peak: float, host: dict, measured: bool = False) -> str:
    fpc = 64 if host["simd"] == "avx512f" else 32 if host["simd"] == "avx2" and host["fma"] else None
    zen4 = fpc == 64 and "AMD" in host["label"] and "family 25," in host["label"]
    if zen4:    # Zen 4 runs a 512-bit FMA on its two 256-bit pipes: one a cycle (bench RESULTS, session 33)
        fpc = 32
    if measured:
        note = (f"fp32 peak: {peak:.1f} GFLOP/s per core, measured (12 independent FMA chains, cc -O3 "
                f"-march=native); the issue's 117 GFLOP/s is a 3.66 GHz Zen 4")
    else:
        note = f"assumed fp32 peak: {peak:g} GFLOP/s per core (`--peak-gflops-per-core`)"
    if fpc:
        note += (f"; this CPU has {'AVX-512' if fpc == 64 or zen4 else 'AVX2'} + FMA: {fpc} FLOP/cycle with two "
                 f"{'256-bit ' if zen4 else ''}FMA pipes, "
                 f"i.e. {peak / fpc:.2f} GHz")
    return note


def kernel_profile(so_path: str, manifest: dict, peak: float, runs: int = 5) -> dict:
    """Where one thread's time goes: the runtime's step profiler (``cuvil_profile``) summed by kernel kind,
    with GFLOP/s, and the three slowest steps."""
    from cuvil.targets.x86.loader import load
    model = load(so_path)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(d.shape).astype(d.dtype) for d in model.inputs]
    times = model.profile(*xs, runs=runs, num_threads=1)
    model.close()
    steps = manifest["steps"]
    kinds = {}
    for st, t in zip(steps, times):
        k = kinds.setdefault(st["kernel"], {"ms": 0.0, "flops": 0, "count": 0})
        k["ms"] += 1e3 * t
        k["flops"] += st["flops"]
        k["count"] += 1
    top = sorted(zip(times, steps), key=lambda ts: -ts[0])[:3]
    return {"total_ms": 1e3 * sum(times), "kinds": kinds,
            "top": [(1e3 * t, st["kernel"], f"{st['op']} {st['stage']} {st['shape']}",
                     st["flops"] / t / 1e9 if st["flops"] and t else None) for t, st in top], "peak": peak}


def render(args, host, rows, compiles, failures, started, tf=None) -> str:
    L = []
    ov = openvino_version() if not args.no_openvino else None
    L.append(f"# Cuvil vs onnxruntime{' and OpenVINO' if ov else ''}: batch-1 CPU results on {host['label']}, "
             f"{started[:10]}")
    L.append("")
    L.append(f"Generated by `python3 bench/run_all.py {' '.join(sys.argv[1:])}`".rstrip() + f" on {started}.")
    if args.note:
        L.append("")
        L.append(f"Note: {args.note}")
    L.append("")
    L.append("| | |")
    L.append("|---|---|")
    L.append(f"| CPU | {host['label']} ({host['simd']}{', fma' if host['fma'] else ''}) |")
    L.append(f"| cores | {host['cores']} |")
    for name, v in (("cuvil", cuvil.__version__), ("onnxruntime", onnxruntime.__version__),
                    ("openvino", ov or ("left out" if args.no_openvino else OPENVINO_MISSING)),
                    ("llvmlite", llvmlite.__version__), ("numpy", np.__version__), ("onnx", onnx.__version__),
                    ("python", platform.python_version())):
        L.append(f"| {name} | {v} |")
    if args.peak_gflops_per_core:
        L.append(f"| peak | {peak_note(args.peak_gflops_per_core, host, args.peak_measured)} |")
    if args.section in ("cnn", "all"):
        L.append("")
        L += render_cnn(args, rows, compiles)
    gl, gm = goals(rows, compiles, args.peak_gflops_per_core) if args.section in ("cnn", "all") else ([], math.nan)
    if tf is not None:
        L.append("")
        L += transformer_section.render(tf, args)
        gl = transformer_section.goals(tf, args.threads) + gl
        failures = failures + tf["failures"]
    if args.section in ("cnn", "all"):
        L.append("")
        L.append(f"## Geometric mean of CNN p50 ratios (Cuvil / onnxruntime): {fmt(gm)}")
    L.append("")
    L.append("## Goals")
    L.append("")
    L.append("| goal | target | measured | verdict |")
    L.append("|---|---|---|---|")
    for g in gl:
        L.append("| " + " | ".join(g) + " |")
    if failures:
        L.append("")
        L.append("## Failures")
        L.append("")
        for m, msg in failures:
            L.append(f"- {m}: {msg}")
    return "\n".join(L) + "\n"


def render_cnn(args, rows, compiles) -> list:
    L = []
    L.append("## CNNs")
    L.append("")
    L.append("Light ONNX architectures with seeded random weights; inputs seeded random; both engines in one "
             f"process, alternating run by run{f' ({args.pause_ms:g} ms pause after each)' if args.pause_ms else ''}; "
             f"{args.warmup} warm-up then {args.runs} timed runs per engine; "
             f"cold start and peak RSS from {args.cold_runs} fresh process(es) per engine (median time, "
             "largest RSS). Then, per thread count, Cuvil alone: "
             f"{args.alone_runs} timed runs with the same pauses after the onnxruntime session is gone "
             "(onnxruntime's spinning intra-op threads otherwise share the second core with Cuvil's worker: "
             "`python3 bench/tail_interference.py`). Shared machines are noisy: read ratios, not absolutes. "
             "OpenVINO (float32), where installed, runs in the same alternating loop as a third engine.")
    L.append("")
    L.append("### Latency")
    L.append("")
    L.append("| model | threads | Cuvil p50 (ms) | Cuvil p99 (ms) | ORT p50 (ms) | ORT p99 (ms) | p50 ratio "
             "(Cuvil/ORT) | OV p50 (ms) | Cuvil/OV | Cuvil p99/p50 | Cuvil alone p50 / p99 (ms) | Cuvil alone p99/p50 | "
             "machine floor p99/p50 | GFLOP/s | % of peak |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            continue
        L.append(f"| {r['model']} | {r['threads']} | {fmt(r['c50'])} | {fmt(r['c99'])} | {fmt(r['o50'])} | "
                 f"{fmt(r['o99'])} | {fmt(r['ratio_p50'])} | {fmt(r.get('v50'))} | {fmt(r.get('ratio_ov'))} | "
                 f"{fmt(r['tail'])} | "
                 f"{fmt(r.get('c50_alone'))} / {fmt(r.get('c99_alone'))} | {fmt(r.get('tail_alone'))} | "
                 f"{fmt(r.get('tail_floor'))} | {fmt(r['gflops'], '.1f')} | "
                 f"{fmt(r['pct_peak'], '.1f', '%')} |")
    L.append("")
    L.append("Machine floor: `bench/jitter_floor.c` right after Cuvil alone, a program that cannot be slow "
             "(register-only FMA work plus a read of a buffer the size of the weights, in 16 chunks per thread claimed "
             "from one counter: no faults, no allocation, the best any scheduler can do) with Cuvil alone's p50 as its "
             "length and the same threads, runs and pauses. Its p99/p50 is the time this VM's vCPUs did not run, "
             "or ran slow, during such a series.")
    L.append("")
    L.append("GFLOP/s: the model's FLOPs (`Pipeline.stats().flops`: 2 x MACs of Conv/Gemm/MatMul) / Cuvil p50; "
             "% of peak: GFLOP/s / (per-core peak x threads). These are direct-convolution FLOPs: where 3x3 "
             "convolutions run as Winograd (fewer multiplications), the figure is an effective rate.")
    L.append("")
    L.append("### Cold start and peak RSS")
    L.append("")
    L.append("Cold start: a fresh process's dlopen + session create + first run (Cuvil, through a minimal ctypes "
             "path) vs `InferenceSession` create + first run (onnxruntime). Peak RSS: that process's peak resident "
             "set (VmHWM), interpreter and numpy included.")
    L.append("")
    L.append("| model | threads | Cuvil cold start (ms) | ORT cold start (ms) | ratio | Cuvil peak RSS (MiB) | "
             "ORT peak RSS (MiB) | ratio |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for r in rows:
        if "error" in r:
            continue
        base = r.get("baseline_rss") or base
        L.append(f"| {r['model']} | {r['threads']} | {fmt(r['cold_c'])} | {fmt(r['cold_o'])} | "
                 f"{fmt(r['ratio_cold'], '.3f')} | {fmt(r['rss_c'], '.1f')} | {fmt(r['rss_o'], '.1f')} | "
                 f"{fmt(r['ratio_rss'], '.3f')} |")
    if base:
        L.append("")
        L.append(f"A bare `python -c 'import ctypes, numpy'` process: {base:.1f} MiB.")
    L.append("")
    L.append("### Compile time (O3, empty cache)")
    L.append("")
    L.append("| model | import + optimize + compile (s) | codegen + link (s) | kernels | library size | GFLOPs "
             "per inference |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for m, c in compiles.items():
        if "seconds" not in c:
            continue
        L.append(f"| {m} | {c['seconds']:.1f} | {fmt(c.get('compile_seconds'), '.1f')} | {c.get('kernels', '-')} | "
                 f"{c['bytes'] / 1e6:.1f} MB | {fmt(c['flops'] / 1e9 if c.get('flops') else None, '.2f')} |")
    L.append("")
    L.append("### Where the time goes (1 thread, the runtime's step profiler)")
    L.append("")
    L.append("Kernel kinds: `gemm` = packed-GEMM convolution micro-kernels, `dwconv` / `maxpool` = row kernels, "
             "`loop` = generic loop nests (padding copies, pools, elementwise, concatenation slices, Gemm). "
             "GFLOP/s counts multiply-adds of convolutions and matrix products only.")
    L.append("")
    L.append("| model | kernels ms | by kind: ms (share), GFLOP/s, % of peak | three slowest steps |")
    L.append("|---|---:|---|---|")
    for m, c in compiles.items():
        pr = c.get("profile")
        if not pr:
            continue
        kinds = "; ".join(
            f"{k} x{v['count']}: {v['ms']:.1f} ({100 * v['ms'] / pr['total_ms']:.0f}%)"
            + (f", {v['flops'] / v['ms'] / 1e6:.0f} GFLOP/s ({100 * v['flops'] / v['ms'] / 1e6 / pr['peak']:.0f}%)"
               if v["flops"] else "")
            for k, v in sorted(pr["kinds"].items(), key=lambda kv: -kv[1]["ms"]))
        top = "; ".join(f"{ms:.2f} ms {kind} {what}" + (f" ({gf:.0f} GFLOP/s)" if gf else "")
                        for ms, kind, what, gf in pr["top"])
        L.append(f"| {m} | {pr['total_ms']:.1f} | {kinds} | {top} |")
    return L


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"from {', '.join(LIGHT_MODELS)}")
    ap.add_argument("--runs", type=int, default=40, help="timed runs per engine (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs per engine first (default 3)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cold-runs", type=int, default=3, help="fresh processes per engine for cold start/RSS")
    ap.add_argument("--opt-level", type=int, default=3)
    ap.add_argument("--pause-ms", type=float, default=150.0,
                    help="untimed sleep after each timed run, so each engine starts on an idle machine (default "
                         "150: onnxruntime's intra-op workers spin 50-100 ms after a run, and back to back they "
                         "took the second core from Cuvil's 2-thread runs: ResNet-50 121 ms vs 78 ms with 100 ms "
                         "pauses; bench/pause_effect.py measures it)")
    ap.add_argument("--alone-runs", type=int, default=200,
                    help="then Cuvil alone in the process, this many timed runs with the same pauses, for its own "
                         "p99/p50 (default 200: from 40 runs a p99 is the largest one, a single hiccup of the "
                         "host; 0 = skip)")
    ap.add_argument("--peak-gflops-per-core", type=float, default=None,
                    help="fp32 peak per core for '%% of peak' (default: measured with a C FMA loop)")
    ap.add_argument("--update", action="store_true",
                    help="write bench/RESULTS.md (the figures the README quotes) instead of a new dated file")
    ap.add_argument("--out", default=None,
                    help="the Markdown report (default: a new bench/results/YYYY-MM-DD-<cpu>.md)")
    ap.add_argument("--section", choices=("cnn", "transformer", "all"), default="all",
                    help="the five CNNs, the transformers (BERT-base, GPT-2 decode), or both (default)")
    ap.add_argument("--no-openvino", action="store_true", help="leave the OpenVINO column out")
    ap.add_argument("--note", default="", help="a line for the report's head (e.g. what else ran on the machine)")
    tf = ap.add_argument_group("transformer section")
    tf.add_argument("--bert-model", metavar="PATH", help="BERT exported by torch.onnx (default: built at full size "
                                                         "by cuvil.testing.hf_models)")
    tf.add_argument("--gpt2-model", metavar="PATH", help="GPT-2 decode step exported by torch.onnx (default: built)")
    tf.add_argument("--transformers", nargs="+", choices=("bert", "gpt2_decode"), default=["bert", "gpt2_decode"])
    tf.add_argument("--seqs", type=int, nargs="+", default=[32, 128, 384], help="BERT sequence lengths (B = 1)")
    tf.add_argument("--pasts", type=int, nargs="+", default=[128, 1023],
                    help="GPT-2 past lengths (default 128 1023: GPT-2 has 1,024 positions)")
    tf.add_argument("--tf-runs", type=int, default=20, help="timed runs per engine and point (default 20)")
    tf.add_argument("--transformer-size", choices=("full", "tiny"), default="full",
                    help="built models: BERT-base / GPT-2 124M, or one small layer (a test of the section)")
    args = ap.parse_args(argv)
    bad = [s for s in args.seqs if not 1 <= s <= 512] + [p for p in args.pasts if not 1 <= p <= 1023]
    if bad:
        ap.error(f"--seqs take 1..512 and --pasts 1..1023 (the libraries' profiles), got {bad}")
    for flag, path in (("--bert-model", args.bert_model), ("--gpt2-model", args.gpt2_model)):
        if path and not os.path.isfile(path):
            ap.error(f"{flag} {path}: no such file (export one with bench/models/export_transformers.py, or leave "
                     f"{flag} out to build the model)")
    # "densenet121,inception_v1" as well as "densenet121 inception_v1"
    args.models = [m for arg in args.models for m in arg.split(",") if m]
    unknown = [m for m in args.models if m not in LIGHT_MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(LIGHT_MODELS)}")
    host = dict(host_info(), label=cpu_label())
    if args.update and args.out:
        ap.error("--update writes bench/RESULTS.md: give either --update or --out")
    args.out = args.out or (RESULTS_MD if args.update else dated_report_path(host["label"], datetime.date.today()))
    args.peak_measured = args.peak_gflops_per_core is None
    if args.peak_measured:          # (the transformer section's roofline columns read it too)
        args.peak_gflops_per_core = measure_peak()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    ov = openvino_version() if not args.no_openvino else None
    print(f"{host['label']}, {host['cores']} cores; OpenVINO: {ov or OPENVINO_MISSING if not args.no_openvino else 'left out'}",
          flush=True)
    rows, compiles, failures = [], {}, []
    tf = None
    if args.section in ("transformer", "all"):
        tf = transformer_section.run_transformers(args, lambda msg: print(msg, flush=True))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(render(args, host, rows, compiles, failures, started, tf))
    if args.section == "transformer":
        args.models = []
    else:
        print(peak_note(args.peak_gflops_per_core, host, args.peak_measured), flush=True)
        print(f"{'model':14} {'thr':>3} {'cuvil p50':>10} {'p99':>9} {'ort p50':>9} {'p99':>9} {'ratio':>6} "
              f"{'ov p50':>9} {'c/ov':>5} {'p99/p50':>7} {'GFLOP/s':>8} {'%peak':>6} {'cold':>6} {'rss':>6}", flush=True)
    with tempfile.TemporaryDirectory(prefix="cuvil-run-all-") as tmp:
        floor_exe = build_jitter_floor(tmp) if args.alone_runs > 0 and args.models else None
        for name in args.models:
            onnx_path = os.path.join(tmp, f"{name}.onnx")
            so_path = os.path.join(tmp, f"lib{name}.so")
            try:
                onnx.save(light_model(name, seed=0), onnx_path)
                p, secs, manifest = fresh_compile(onnx_path, so_path, args.opt_level)
                flops = p.stats().flops
                flops = flops if isinstance(flops, int) else None
                compiles[name] = {"seconds": secs, "compile_seconds": manifest.get("compile_seconds"),
                                  "kernels": manifest.get("kernels"), "bytes": os.path.getsize(so_path),
                                  "flops": flops}
                print(f"{name}: compiled at O{args.opt_level} in {secs:.1f} s (fresh cache)", flush=True)
                compiles[name]["profile"] = kernel_profile(so_path, manifest, args.peak_gflops_per_core)
            except Exception as e:  # noqa: BLE001 - one model's failure is reported, the others still run
                failures.append((name, f"compile failed: {type(e).__name__}: {e}"))
                traceback.print_exc()
                continue
            for t in args.threads:
                try:
                    res = run_benchmark(BenchOptions(so_path, onnx=onnx_path, vs="onnxruntime", threads=t,
                                                     runs=args.runs, warmup=args.warmup, cold_runs=args.cold_runs,
                                                     pause_ms=args.pause_ms,
                                                     peers={"openvino": openvino_peer} if ov else None))
                except Exception as e:  # noqa: BLE001
                    failures.append((name, f"{t} thread(s): {type(e).__name__}: {e}"))
                    traceback.print_exc()
                    continue
                c, o, rt = res["cuvil"], res["onnxruntime"], res["ratios"]
                gflops = flops / (c["p50_ms"] / 1e3) / 1e9 if flops and c["p50_ms"] else None
                row = {"model": name, "threads": t, "c50": c["p50_ms"], "c99": c["p99_ms"], "o50": o["p50_ms"],
                       "o99": o["p99_ms"], "ratio_p50": rt["p50"], "tail": c["p99_ms"] / c["p50_ms"],
                       "gflops": gflops,
                       "pct_peak": 100 * gflops / (args.peak_gflops_per_core * t) if gflops else None,
                       "cold_c": c.get("cold_start_ms"), "cold_o": o.get("cold_start_ms"),
                       "ratio_cold": rt["cold_start"], "rss_c": c.get("peak_rss_mb"), "rss_o": o.get("peak_rss_mb"),
                       "ratio_rss": rt["peak_rss"], "baseline_rss": res.get("baseline_rss_mb")}
                if "openvino" in res:
                    row.update(v50=res["openvino"]["p50_ms"], v99=res["openvino"]["p99_ms"],
                               ratio_ov=res["peer_ratios"]["openvino"]["p50"])
                if args.alone_runs > 0:
                    gc.collect()      # the onnxruntime session (and its thread pool) of the run above
                    alone = run_benchmark(BenchOptions(so_path, threads=t, runs=args.alone_runs, warmup=args.warmup,
                                                       cold_runs=0, pause_ms=args.pause_ms))["cuvil"]
                    row.update(c50_alone=alone["p50_ms"], c99_alone=alone["p99_ms"],
                               tail_alone=alone["p99_ms"] / alone["p50_ms"])
                    try:
                        floor = jitter_floor(floor_exe, alone["p50_ms"], manifest.get("weights_bytes", 0) / 2 ** 20,
                                             t, args.alone_runs, args.pause_ms)
                        row.update(tail_floor=floor["p99_over_p50"])
                    except Exception as e:  # noqa: BLE001 - the floor is context, the model's row still counts
                        failures.append((name, f"{t} thread(s): bench/jitter_floor.c failed: {e}"))
                if not res["agreement"]["agree"]:
                    err = res["agreement"]["max_rel_err"]
                    failures.append((name, f"{t} thread(s): outputs disagree with onnxruntime (max rel error {err:.3g})"))
                rows.append(row)
                print(f"{name:14} {t:>3} {fmt(row['c50'], '.2f', 'ms'):>10} {fmt(row['c99'], '.1f', 'ms'):>9} "
                      f"{fmt(row['o50'], '.2f', 'ms'):>9} {fmt(row['o99'], '.1f', 'ms'):>9} "
                      f"{fmt(row['ratio_p50']):>6} {fmt(row.get('v50'), '.2f', 'ms'):>9} {fmt(row.get('ratio_ov')):>5} "
                      f"{fmt(row['tail']):>7} {fmt(gflops, '.1f'):>8} "
                      f"{fmt(row['pct_peak'], '.1f', '%'):>6} {fmt(row['ratio_cold'], '.3f'):>6} "
                      f"{fmt(row['ratio_rss'], '.3f'):>6}", flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:  # after each model: partial results survive
                f.write(render(args, host, rows, compiles, failures, started, tf))
    report = render(args, host, rows, compiles, failures, started, tf)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(report)
    print(report[report.index("## Geometric mean" if "## Geometric mean" in report else "## Goals"):], end="")
    print(f"wrote {args.out}")
    return 1 if failures or (tf and tf["failures"]) else 0


if __name__ == "__main__":
    sys.exit(main())
