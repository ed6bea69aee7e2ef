"""The transformer section of bench/run_all.py (issue 20's goals): BERT-base at S = 32/128/384, B = 1, from ONE
library compiled for B = 1..8, S = 1..512, and the GPT-2 (124M) decode step with a KV cache at a past of 128
and 1,023 tokens (one library for a past of 1..1,023: GPT-2 has 1,024 positions, so the token after a past of
1,023 is the last one it can place), per token, each at 1 and 2 threads, Cuvil beside onnxruntime and
OpenVINO (float32) in one process, alternating run by run with a pause after each.

The models: an ONNX file exported by torch.onnx when given (``--bert-model``, ``--gpt2-model``; made by
``bench/models/export_transformers.py``), else the same architectures built without torch
(:mod:`cuvil.testing.hf_models`), full size with seeded random weights (``--transformer-size tiny``: one small
layer, for tests).
"""
from __future__ import annotations

import gc
import math
import os
import statistics
import tempfile
import time
import traceback
from typing import Dict, List

import numpy as np
import onnx

from cuvil import Pipeline
from cuvil.ir.dim import SymExpr, evaluate
from cuvil.targets.x86.loader import load
from cuvil.testing.hf_models import (BERT_BASE, BERT_PROFILE, GPT2_DECODE_PROFILE, GPT2_SMALL, bert_model,
                                     gpt2_decode_model, text_feeds)
from cuvil.testing.oracles import max_rel_error

from engines import OPENVINO_MISSING, openvino_compiled, openvino_runner, openvino_version, ort_runner, ort_session

#: A config small enough for a test to compile in seconds (same graph structure).
TINY_BERT = dict(vocab=512, hidden=64, layers=1, heads=4, ffn=128, max_pos=512, type_vocab=2)
TINY_GPT2 = dict(vocab=512, hidden=64, layers=1, heads=4, ffn=128, max_pos=1024)
GOAL_TRANSFORMER = 0.8
AGREE_RTOL = 1e-3


def _save(model: onnx.ModelProto, path: str) -> str:
    """Weights over 2 GB cannot sit in one protobuf; these stay under it, but large ones go to a side file."""
    big = model.ByteSize() > 1_500_000_000
    onnx.save_model(model, path, save_as_external_data=big, location=os.path.basename(path) + ".data")
    return path


def _model(kind: str, given: str | None, size: str, tmp: str, log) -> tuple[str, onnx.ModelProto, str]:
    """(path, model, where it came from)."""
    if given:
        return given, onnx.load(given), f"exported: `{os.path.basename(given)}`"
    if kind == "bert":
        cfg = BERT_BASE if size == "full" else TINY_BERT
        m = bert_model(**cfg)
    else:
        cfg = GPT2_SMALL if size == "full" else TINY_GPT2
        m = gpt2_decode_model(**cfg)
    path = _save(m, os.path.join(tmp, f"{kind}.onnx"))
    cfg_text = ", ".join(f"{k} {v}" for k, v in cfg.items())
    log(f"{kind}: built with cuvil.testing.hf_models ({cfg_text})")
    return path, m, f"built by `cuvil.testing.hf_models` ({cfg_text}; seeded random weights)"


def _alternate(runners: Dict[str, callable], runs: int, warmup: int, pause_ms: float) -> Dict[str, List[float]]:
    """Each engine once per round, the order reversed every other round, an idle pause after each run."""
    for r in runners.values():
        for _ in range(warmup):
            r()
    names = list(runners)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for i in range(runs):
        for k in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            runners[k]()
            times[k].append(1e3 * (time.perf_counter() - t0))
            if pause_ms:
                time.sleep(pause_ms / 1e3)
    return times


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def _profile(so: str, manifest: dict, feeds: Dict[str, np.ndarray], names, runs: int = 3) -> dict:
    """One thread's time in kernels by kind (the runtime's step profiler; a library with a profile lists
    kernels for the generic and the opt-point schedule: only those that ran count) and the slowest steps."""
    m = load(so, num_threads=1)
    try:
        times = m.profile(runs=runs, num_threads=1, **{k: v for k, v in feeds.items() if k in names})
    finally:
        m.close()
    kinds: Dict[str, dict] = {}
    ran = [(t, st) for t, st in zip(times, manifest["steps"]) if t > 0]
    for t, st in ran:
        k = kinds.setdefault(st["kernel"], {"ms": 0.0, "count": 0})
        k["ms"] += 1e3 * t
        k["count"] += 1
    top = sorted(ran, key=lambda ts: -ts[0])[:5]
    ops: Dict[str, float] = {}
    for t, st in ran:
        ops[st["op"]] = ops.get(st["op"], 0.0) + 1e3 * t
    return {"total_ms": 1e3 * sum(t for t, _ in ran), "kinds": kinds, "ops": ops,
            "top": [(1e3 * t, st["kernel"], f"{st['op']} {st['stage']}") for t, st in top]}


def run_transformers(args, log) -> dict:
    """Compiles each model once, then per thread count and point: agreement, and the timed alternation.
    Returns {"rows", "compiles", "failures", "openvino"}."""
    ov = openvino_version() if not args.no_openvino else None
    rows, compiles, failures = [], {}, []
    if not ov:
        log("OpenVINO column: " + ("left out (--no-openvino)" if args.no_openvino else OPENVINO_MISSING))
    plan = [("bert", args.bert_model, BERT_PROFILE, args.seqs, "S"),
            ("gpt2_decode", args.gpt2_model, GPT2_DECODE_PROFILE, args.pasts, "past")]
    with tempfile.TemporaryDirectory(prefix="cuvil-run-all-tf-") as tmp:
        for kind, given, profile, points, axis in plan:
            if kind not in args.transformers:
                continue
            so = os.path.join(tmp, f"lib{kind}.so")
            try:
                path, model, origin = _model(kind, given, args.transformer_size, tmp, log)
                old = os.environ.get("CUVIL_CACHE_DIR")
                cache = tempfile.mkdtemp(prefix="cuvil-fresh-cache-", dir=tmp)
                os.environ["CUVIL_CACHE_DIR"] = cache
                try:
                    t0 = time.perf_counter()
                    p0 = Pipeline.from_onnx(path)
                    p = p0.optimize()
                    prof = {k: v for k, v in profile.items() if k in p.graph.symbols}
                    art = p.compile(opt_level=args.opt_level, shape_profiles=prof)
                    secs = time.perf_counter() - t0
                    flops = _flops_counter(p0) if kind == "bert" else None
                    del p0
                    art.save(so)
                finally:
                    if old is None:
                        os.environ.pop("CUVIL_CACHE_DIR", None)
                    else:
                        os.environ["CUVIL_CACHE_DIR"] = old
                manifest = art.manifest
                compiles[kind] = {"seconds": secs, "origin": origin, "profile": prof,
                                  "tiny": not given and args.transformer_size == "tiny",
                                  "symbols": sorted(p.graph.symbols), "bytes": os.path.getsize(so),
                                  "kernels": manifest.get("kernels"),
                                  "fused_attention": any(st.get("op") == "FusedAttention"
                                                         for st in manifest.get("steps", []))}
                log(f"{kind}: one library for " + ", ".join(f"{k} {v[0]}..{v[2]}" for k, v in prof.items())
                    + f", compiled at O{args.opt_level} in {secs:.1f} s (fresh cache)")
                del p, art
            except Exception as e:  # noqa: BLE001 - reported; the other model still runs
                failures.append((kind, f"compile failed: {type(e).__name__}: {e}"))
                traceback.print_exc()
                continue
            # BERT at its middle S; the decode step at each past (what grows with the cache)
            at = [points[len(points) // 2]] if kind == "bert" else list(points)
            compiles[kind]["kernel_profiles"] = []
            for point in at:
                try:
                    pr = _profile(so, manifest, text_feeds(model, 1, point), set(
                        d["name"] for d in manifest.get("inputs", []) if isinstance(d, dict)))
                    pr["at"] = f"{axis} = {point}"
                    compiles[kind]["kernel_profiles"].append(pr)
                except Exception as e:  # noqa: BLE001 - context, not a figure of the goals
                    failures.append((kind, f"step profile failed: {type(e).__name__}: {e}"))
            for t in args.threads:
                lib = load(so, num_threads=t)
                sess = ort_session(model, t)
                compiled = None
                if ov:
                    try:
                        compiled = openvino_compiled(path, t)
                    except Exception as e:  # noqa: BLE001 - OpenVINO's failure loses its column only
                        failures.append((kind, f"{t} thr: OpenVINO: {type(e).__name__}: {e}"))
                lib_inputs = {d.name for d in lib.inputs}
                for point in points:
                    feeds = text_feeds(model, 1, point)
                    mine = {k: v for k, v in feeds.items() if k in lib_inputs}
                    row = {"model": kind, "axis": axis, "point": point, "threads": t}
                    try:
                        if flops is not None:
                            row["gflop"] = flops(feeds) / 1e9
                        runners = {"cuvil": lambda f=mine: lib.run(**f), "onnxruntime": ort_runner(sess, feeds)}
                        if compiled is not None:
                            runners["openvino"] = openvino_runner(compiled, feeds)
                        outs = {k: r() for k, r in runners.items()}
                        want = outs["onnxruntime"]
                        for k in ("cuvil", "openvino"):
                            if k in outs:
                                err = max(max_rel_error(g, w) for g, w in zip(outs[k], want))
                                row[f"err_{k}"] = err
                                if not err <= AGREE_RTOL:
                                    failures.append((kind, f"{axis}={point}, {t} thr: {k} disagrees with "
                                                           f"onnxruntime (max rel error {err:.3g})"))
                        del outs
                        times = _alternate(runners, args.tf_runs, args.warmup, args.pause_ms)
                    except Exception as e:  # noqa: BLE001
                        failures.append((kind, f"{axis}={point}, {t} thr: {type(e).__name__}: {e}"))
                        traceback.print_exc()
                        continue
                    for k, xs in times.items():
                        row[f"{k}_p50"] = statistics.median(xs)
                        row[f"{k}_p99"] = _pct(xs, 99)
                    row["ratio_ort"] = row["cuvil_p50"] / row["onnxruntime_p50"]
                    row["ratio_ov"] = row["cuvil_p50"] / row["openvino_p50"] if "openvino_p50" in row else None
                    rows.append(row)
                    log(f"{kind:12} {axis}={point:<5} {t} thr: Cuvil {row['cuvil_p50']:.2f} ms, onnxruntime "
                        f"{row['onnxruntime_p50']:.2f} ms ({row['ratio_ort']:.2f})"
                        + (f", OpenVINO {row['openvino_p50']:.2f} ms ({row['ratio_ov']:.2f})" if row["ratio_ov"]
                           else ""))
                    del runners
                    gc.collect()
                lib.close()
                del sess, compiled
                gc.collect()
    return {"rows": rows, "compiles": compiles, "failures": failures, "openvino": ov}


def _flops_counter(p: Pipeline):
    """feeds -> the model's FLOPs at the feeds' shapes: its products' and convolutions' multiply-adds x 2
    (``Pipeline.stats()`` of the graph as imported, a polynomial in its symbols: BERT-base's
    169,869,312 S + 36,864 S^2 + 1,179,648 at B = 1), other ops not counted; None where the graph's statistics
    fail (the roofline is left out, the timings stand)."""
    g = p.graph
    try:
        total = p.stats().flops
    except Exception:  # noqa: BLE001 - a column of context, not a figure of the goals
        traceback.print_exc()
        return None

    def at(feeds) -> float:
        env = {}
        for v in g.inputs:
            if v.name in feeds and v.shape is not None:
                for d, got in zip(v.shape, np.shape(feeds[v.name])):
                    if isinstance(d, SymExpr) and len(d.free_symbols) == 1 and str(d) in g.symbols:
                        env[g.symbols[str(d)].name] = got
        return float(evaluate(total, env))
    return at


def roofline(row: dict, peak_per_core) -> dict:
    """A BERT row's compute roofline: each engine's GFLOP/s and share of the fp32 FMA peak of the threads it
    ran on, and the lowest Cuvil / onnxruntime ratio that peak allows (Cuvil at 100% of it against
    onnxruntime's measured p50). Empty without a peak."""
    if not peak_per_core or not row.get("gflop"):
        return {}
    peak = peak_per_core * row["threads"]
    out = {"bound_ms": 1e3 * row["gflop"] / peak}
    for k in ("cuvil", "onnxruntime"):
        out[f"{k}_gflops"] = row["gflop"] / (row[f"{k}_p50"] / 1e3)
        out[f"{k}_pct"] = 100 * out[f"{k}_gflops"] / peak
    out["ratio_at_peak"] = out["bound_ms"] / row["onnxruntime_p50"]
    return out


def _f(x, spec=".2f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}"


def goals(res: dict, threads: List[int]) -> list:
    """(goal, target, measured, verdict): BERT each point <= 0.8 onnxruntime, GPT-2 decode likewise."""
    out = []
    tiny = {k for k, c in res["compiles"].items() if c.get("tiny")}
    for kind, label in (("bert", "BERT-base, B = 1, each S and thread count, one library for B 1..8, S 1..512"),
                        ("gpt2_decode", "GPT-2 (124M) decode step with a KV cache, per token, each past and "
                                        "thread count")):
        if kind in tiny:
            label = f"{kind} (TINY config, a test of the section: not the goal's model)"
        rows = [r for r in res["rows"] if r["model"] == kind]
        if not rows:
            out.append((label, f"Cuvil / onnxruntime ≤ {GOAL_TRANSFORMER}", "-", "not measured"))
            continue
        worst = max(rows, key=lambda r: r["ratio_ort"])
        vals = ", ".join(f"{r['axis']} {r['point']} {r['threads']}t {r['ratio_ort']:.2f}" for r in rows)
        out.append((label, f"Cuvil / onnxruntime ≤ {GOAL_TRANSFORMER}",
                    f"worst {worst['ratio_ort']:.2f} ({worst['axis']} {worst['point']}, {worst['threads']} thr); "
                    f"all: {vals}", "MET" if worst["ratio_ort"] <= GOAL_TRANSFORMER else "NOT MET"))
    return out


def render(res: dict, args) -> List[str]:
    """The report's transformer section (Markdown lines)."""
    L = ["## Transformers (issue 20)", ""]
    ov = res["openvino"]
    L.append(f"Batch 1; Cuvil, onnxruntime{' and OpenVINO ' + ov + ' (float32: INFERENCE_PRECISION_HINT=f32, LATENCY)' if ov else ''} "
             f"in one process, alternating run by run (order reversed every other round), "
             f"{args.pause_ms:g} ms pause after each run, {args.warmup} warm-up then {args.tf_runs} timed runs per "
             "engine and point; all tokens real (masks of ones). Each model is compiled ONCE (fresh cache) for its "
             "whole profile and that one library serves every point. GPT-2's figure is one decode step (one new "
             "token after `past` cached tokens: ids [1, 1], the past keys/values in, logits and the presents "
             "out), i.e. per token." + ("" if ov else f" OpenVINO column: {OPENVINO_MISSING if not args.no_openvino else 'left out'}."))
    L.append("")
    for kind, c in res["compiles"].items():
        prof = ", ".join(f"{k} {v[0]}..{v[2]} (opt {v[1]})" for k, v in c["profile"].items())
        L.append(f"- **{kind}**: {c['origin']}; one library for {prof}; compiled in {c['seconds']:.1f} s, "
                 f"{c['bytes'] / 1e6:.0f} MB, {c.get('kernels', '-')} kernels; attention fused (FusedAttention): "
                 f"{'yes' if c['fused_attention'] else 'NO'}.")
    L.append("")
    L.append("| model | point | threads | Cuvil p50 (ms) | ORT p50 (ms) | OV p50 (ms) | Cuvil / ORT | Cuvil / OV | "
             "Cuvil p99 | ORT p99 | OV p99 | max rel err vs ORT (Cuvil; OV) |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in res["rows"]:
        L.append(f"| {r['model']} | {r['axis']} = {r['point']} | {r['threads']} | {_f(r['cuvil_p50'])} | "
                 f"{_f(r['onnxruntime_p50'])} | {_f(r.get('openvino_p50'))} | **{_f(r['ratio_ort'])}** | "
                 f"{_f(r['ratio_ov'])} | {_f(r['cuvil_p99'])} | {_f(r['onnxruntime_p99'])} | "
                 f"{_f(r.get('openvino_p99'))} | {_f(r.get('err_cuvil'), '.1e')}; {_f(r.get('err_openvino'), '.1e')} |")
    peak = getattr(args, "peak_gflops_per_core", None)
    bert = [(r, roofline(r, peak)) for r in res["rows"] if r["model"] == "bert"]
    if peak and bert:
        L += ["", f"BERT's compute roofline: FLOPs = the products' multiply-adds x 2 at the point (`Pipeline.stats()`"
              f", other ops not counted) over the p50; % of the fp32 FMA peak of the threads used ({peak:.1f} "
              "GFLOP/s per core, measured as the report's peak row says); the floor: the Cuvil / onnxruntime ratio "
              "Cuvil would reach at 100% of that peak against onnxruntime's measured p50 (a goal below it cannot "
              "be met in float32 on this CPU).", "",
              "| point | threads | GFLOP | Cuvil GFLOP/s (% of peak) | ORT GFLOP/s (% of peak) | time at peak (ms) | "
              "floor of Cuvil / ORT | measured |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r, rf in bert:
            L.append(f"| S = {r['point']} | {r['threads']} | {r['gflop']:.4g} | {rf['cuvil_gflops']:.1f} "
                     f"({rf['cuvil_pct']:.0f}%) | {rf['onnxruntime_gflops']:.1f} ({rf['onnxruntime_pct']:.0f}%) | "
                     f"{rf['bound_ms']:.4g} | {rf['ratio_at_peak']:.2f} | {r['ratio_ort']:.2f} |")
    profs = [(k, pr) for k, c in res["compiles"].items() for pr in c.get("kernel_profiles", [])]
    if profs:
        L += ["", "Where Cuvil's time goes (1 thread, the runtime's step profiler, mean of 3 runs):", "",
              "| model | at | kernels ms | by kind: ms (share) | by op (the step's ONNX op): ms (share) | five slowest steps |",
              "|---|---|---:|---|---|---|"]
        for k, pr in profs:
            kinds = "; ".join(f"{n} x{v['count']}: {v['ms']:.2f} ({100 * v['ms'] / pr['total_ms']:.0f}%)"
                              for n, v in sorted(pr["kinds"].items(), key=lambda kv: -kv[1]["ms"]))
            top = "; ".join(f"{ms:.2f} ms {kern} {what}" for ms, kern, what in pr["top"])
            ops = "; ".join(f"{op}: {ms:.2f} ({100 * ms / pr['total_ms']:.0f}%)"
                            for op, ms in sorted(pr["ops"].items(), key=lambda kv: -kv[1])[:6])
            L.append(f"| {k} | {pr['at']} | {pr['total_ms']:.1f} | {kinds} | {ops} | {top} |")
    return L
