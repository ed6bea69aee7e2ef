"""bf16 against float32 on x86, side by side in one process: ResNet-50 (seeded random weights,
cuvil.testing.light_model) and a BERT-base-like encoder (bench/attention.py's ``bert_like``: hidden 768, 12
heads, ffn 3072) at batch 1, Cuvil float32, Cuvil bf16 (its Conv / MatMul / Gemm nodes narrowed: AMX tiles
where the CPU has AMX-BF16, cuvil.targets.x86.amx, with the vdpbf16ps build beside them as "cuvil bf16
avx512_bf16"; else vdpbf16ps micro-kernels, cuvil.targets.x86.gemm_bf16), onnxruntime (float32) and, where installed, OpenVINO with its
default precision (bf16 where the CPU has it) and with f32.

    PYTHONPATH=src python3 bench/precision_speed.py                        # resnet50 and bert, 1 and 2 threads
    PYTHONPATH=src python3 bench/precision_speed.py resnet50 --threads 1 --runs 20
    PYTHONPATH=src python3 bench/precision_speed.py bert --seq 128 --layers 12
    PYTHONPATH=src python3 bench/precision_speed.py bert --threads 1 --steps  # and where each build's time goes

Every engine runs the same inputs; runs alternate (order reversed every other run) after an idle pause so
machine noise hits them alike; p50 and min milliseconds, and each one's ratio to Cuvil float32; with one
thread also the calling thread's CPU time (Cuvil and onnxruntime compute on it: the steadier ratio on a
machine shared with other jobs). Errors are each
output's max |difference| to Cuvil float32 relative to that output's max |value|. Narrowing: with
``Pipeline.compile(precision="bf16")`` where the precision policy exists, else every Conv / MatMul / Gemm
node's ``precision`` set to "bf16" directly (``--every``: what the policy does where it certifies them all).
The policy certifies from the inputs' declared ranges, here the ranges of the inputs timed. Prints the CPU
(``cpu_label()``) and one markdown row per model and thread count for bench/PRECISION.md.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label, host_cpu  # noqa: E402
from cuvil.targets.x86.amx import has_amx  # noqa: E402
from cuvil.targets.x86.gemm_bf16 import BF16_OPS, narrow_formats  # noqa: E402
from cuvil.targets.x86.gemm_fp16 import FP16_OPS  # noqa: E402
from cuvil.targets.x86.tuning import X86Tuning  # noqa: E402
from cuvil.testing import light_model  # noqa: E402


def compile_at(model, precision: str, feeds=None, every=False, **kw):
    """Cuvil's library of ``model`` at ``precision`` ("fp32" or "bf16"): through the precision policy, the
    inputs declared within the ranges of ``feeds`` (what the policy certifies from), or with ``every`` every
    Conv / MatMul / Gemm node narrowed directly (what the policy does where it certifies them all)."""
    p = Pipeline.from_onnx(model).optimize()
    if precision == "fp32":
        return p.compile(**kw)
    if not every and "precision" in inspect.signature(Pipeline.compile).parameters:
        ranges = {k: (float(v.min()), float(v.max())) for k, v in (feeds or {}).items()}
        return p.compile(precision=precision, input_ranges=ranges, **kw)
    for n in p.graph.nodes:
        if n.op in (FP16_OPS if precision == "fp16" else BF16_OPS):
            n.precision = precision
    return p.compile(**kw)


def openvino_runners(model, threads: int):
    """{label: run(feeds)} for OpenVINO's default precision and f32; {} where it is not installed."""
    try:
        import openvino as ov
    except ImportError:
        return {}
    core = ov.Core()
    m = core.read_model(model.SerializeToString(), b"")
    out = {}
    for label, cfg in (("openvino", {}), ("openvino f32", {"INFERENCE_PRECISION_HINT": "f32"})):
        c = core.compile_model(m, "CPU", {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
                                          "NUM_STREAMS": 1, **cfg})
        req = c.create_infer_request()
        prec = c.get_property("INFERENCE_PRECISION_HINT")
        prec = getattr(prec, "to_string", lambda: str(prec))()
        out[f"{label} ({prec})" if label == "openvino" else label] = \
            lambda f, req=req: [req.infer(f)[o] for o in req.model_outputs]
    return out


def timings(runners, feeds, runs: int, pause_ms: float):
    """Per runner: p50 and min wall ms, and p50 CPU ms of the calling thread (``time.thread_time``: with one
    thread Cuvil and onnxruntime compute on it, so time the machine's other jobs took is left out)."""
    for r in runners.values():
        r(feeds)
    wall = {k: [] for k in runners}
    cpu = {k: [] for k in runners}
    for i in range(runs):
        items = list(runners.items())
        for k, r in (items if i % 2 == 0 else items[::-1]):
            time.sleep(pause_ms / 1e3)
            c0, t0 = time.thread_time(), time.perf_counter()
            r(feeds)
            wall[k].append((time.perf_counter() - t0) * 1e3)
            cpu[k].append((time.thread_time() - c0) * 1e3)
    return ({k: float(np.median(v)) for k, v in wall.items()}, {k: float(np.min(v)) for k, v in wall.items()},
            {k: float(np.median(v)) for k, v in cpu.items()})


def step_kind(step: dict) -> str:
    """A manifest step's kind: its kernel and the op it ends in (a contraction's ``gemm`` ends in its fused
    bias Add or GELU's Mul), the format it computes in and the kernel path (amx_bf16, avx512_bf16)."""
    kind = f"{step.get('kernel', '?')} ({step['op']})"
    return f"{kind} {step.get('precision') or 'fp32'}" + (f" {step['path']}" if step.get("path") else "")


def print_steps(steps) -> None:
    """Where the time goes: per build, the in-kernel milliseconds (each step's fastest of 5) summed by
    :func:`step_kind`, largest first, and each kind's share of the build's total."""
    for name, (t, art) in steps.items():
        total = float(t.sum())
        kinds = {}
        for s, ms in zip(art.manifest["steps"], t):
            kinds[step_kind(s)] = kinds.get(step_kind(s), 0.0) + float(ms)
        print(f"\n{name} in kernels by kind of step (1 thread, fastest of 5 per step), {total:.2f} ms:")
        print("| kind of step | ms | share |")
        print("|---|---|---|")
        for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
            if ms >= 0.0005 * total:
                print(f"| {k} | {ms:.2f} | {100 * ms / total:.1f}% |")


def rel_err(got, want) -> float:
    return max(float(np.abs(np.asarray(g, np.float64) - w).max()) / max(float(np.abs(w).max()), 1e-30)
               for g, w in zip(got, want))


def model_and_feeds(name: str, seq: int, layers: int):
    rng = np.random.default_rng(1)
    if name == "bert":
        from attention import bert_like, feeds
        return bert_like(layers), feeds(1, seq, 768), {"shape_profiles": {"B": (1, 1, 1), "S": (1, seq, 512)}}
    m = light_model(name, seed=0)
    f = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
         for vi in m.graph.input}
    return m, f, {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["resnet50", "bert"])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--pause-ms", type=float, default=150.0,
                    help="idle sleep before each timed run (default 150, as bench/run_all.py: onnxruntime's "
                         "intra-op workers spin ~45 ms after a 2-thread run and took the second core from the "
                         "engine after them; at the former 30 ms Cuvil bf16 ran 41.8 ms p50 after onnxruntime "
                         "against 20.7 after a 100 ms pause, ResNet-50 on a Zen 4, session 35)")
    ap.add_argument("--seq", type=int, default=128, help="BERT's sequence length")
    ap.add_argument("--layers", type=int, default=12, help="BERT's encoder layers")
    ap.add_argument("--no-openvino", action="store_true")
    ap.add_argument("--every", action="store_true", help="narrow every Conv/MatMul/Gemm directly, not via the policy")
    ap.add_argument("--fp16", action="store_true",
                    help="also Cuvil fp16: MatMul / Gemm on float16 weight panels, float32 sums (gemm_fp16.py)")
    ap.add_argument("--steps", action="store_true",
                    help="with 1 thread, also where the time goes: in-kernel ms per kind of step, fp32 and bf16")
    a = ap.parse_args(argv)
    if "bf16" not in narrow_formats(host_cpu()):
        raise SystemExit(f"this CPU has no AVX512_BF16: nothing to compare ({cpu_label()})")
    amx = has_amx(host_cpu().features)
    import onnxruntime as ort
    print(f"CPU: {cpu_label()}")
    rows = []
    for name in a.models:
        model, feeds, kw = model_and_feeds(name, a.seq, a.layers)
        t0 = time.perf_counter()
        f32 = compile_at(model, "fp32", **kw)
        t1 = time.perf_counter()
        b16 = compile_at(model, "bf16", feeds, a.every, **kw)
        t2 = time.perf_counter()
        # on a CPU with AMX the default bf16 build runs tdpbf16ps tiles; the vdpbf16ps build beside it
        vdp = compile_at(model, "bf16", feeds, a.every, tuning=X86Tuning(amx=False), **kw) if amx else None
        h16 = compile_at(model, "fp16", feeds, a.every, **kw) if a.fp16 else None
        if h16 is not None:
            h_nodes = h16.manifest.get("precision", {}).get("nodes", {})
            print(f"{name}: fp16 kernels {sum(1 for s in h16.manifest['steps'] if s.get('precision') == 'fp16')}"
                  + (f"; the policy narrowed {sum(1 for v in h_nodes.values() if v.get('format') == 'fp16')} of "
                     f"{sum(1 for v in h_nodes.values() if v.get('op') in FP16_OPS)} MatMul/Gemm nodes" if h_nodes
                     else "; every MatMul/Gemm narrowed directly"), flush=True)
        paths = sorted({s.get("path") for s in b16.manifest["steps"] if s.get("precision")})
        nodes = b16.manifest.get("precision", {}).get("nodes", {})
        policy = (f"; the policy narrowed {sum(1 for v in nodes.values() if v.get('format') == 'bf16')} of "
                  f"{sum(1 for v in nodes.values() if v.get('op') in BF16_OPS)} Conv/MatMul/Gemm nodes" if nodes
                  else "; every Conv/MatMul/Gemm narrowed directly")
        print(f"{name}: compiled fp32 {t1 - t0:.0f} s, bf16 {t2 - t1:.0f} s; bf16 kernels "
              f"{sum(1 for s in b16.manifest['steps'] if s.get('precision'))} ({', '.join(map(str, paths))}){policy}",
              flush=True)
        args = list(feeds.values())
        for threads in a.threads:
            mf, mb = f32.model(), b16.model()
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            runners = {"cuvil fp32": lambda f, m=mf, t=threads: m.run(*args, num_threads=t),
                       "cuvil bf16": lambda f, m=mb, t=threads: m.run(*args, num_threads=t),
                       "onnxruntime": lambda f: sess.run(None, f)}
            if vdp is not None:
                runners["cuvil bf16 avx512_bf16"] = lambda f, m=vdp.model(), t=threads: m.run(*args, num_threads=t)
            if h16 is not None:
                runners["cuvil fp16"] = lambda f, m=h16.model(), t=threads: m.run(*args, num_threads=t)
            if not a.no_openvino:
                runners.update(openvino_runners(model, threads))
            want = [np.asarray(o, np.float64) for o in runners["cuvil fp32"](feeds)]
            errs = {k: rel_err(r(feeds), want) for k, r in runners.items() if k != "cuvil fp32"}
            ms, best, cpu = timings(runners, feeds, a.runs, a.pause_ms)
            base = ms["cuvil fp32"]
            print(f"\n{name}, batch 1{f', S = {a.seq}, {a.layers} layers' if name == 'bert' else ''}, {threads} thread(s)")
            print("| engine | p50 ms | / Cuvil fp32 | min ms | / Cuvil fp32 | thread CPU ms (1 thread) | / Cuvil fp32 | "
                  "rel. error vs Cuvil fp32 |")
            print("|---|---|---|---|---|---|---|---|")
            for k in runners:
                on_thread = threads == 1 and not k.startswith("openvino")   # OpenVINO computes on its own threads
                cc = f"{cpu[k]:.2f} | {cpu[k] / cpu['cuvil fp32']:.2f}" if on_thread else "- | -"
                print(f"| {k} | {ms[k]:.2f} | {ms[k] / base:.2f} | {best[k]:.2f} | {best[k] / best['cuvil fp32']:.2f} | "
                      f"{cc} | {errs.get(k, 0.0):.1e} |", flush=True)
            if threads == 1:     # the step profiler: each step's fastest of 5 runs, summed (noise mostly left out)
                built = (("cuvil fp32", mf, f32), ("cuvil bf16", mb, b16)) + ((("vdp", vdp.model(), vdp),) if vdp else ())
                steps = {k: (1e3 * np.min([m.profile(*args, runs=1, num_threads=1) for _ in range(5)], axis=0), art)
                         for k, m, art in built}
                kern = {k: float(t.sum()) for k, (t, _) in steps.items()}
                if a.steps:
                    print_steps({k: v for k, v in steps.items() if k != "vdp"})
                print(f"in kernels (1 thread, fastest of 5 per step): fp32 {kern['cuvil fp32']:.2f} ms, bf16 "
                      f"{kern['cuvil bf16']:.2f} ms: {kern['cuvil fp32'] / kern['cuvil bf16']:.2f}x"
                      + (f"; bf16 avx512_bf16 {kern['vdp']:.2f} ms: {kern['cuvil fp32'] / kern['vdp']:.2f}x" if vdp else ""),
                      flush=True)
            rows.append((name, threads, ms, best, errs))
    print(f"\nrows for bench/PRECISION.md ({cpu_label()}):")
    print("| model | threads | Cuvil fp32 ms | Cuvil bf16 ms | bf16 speed-up (p50) | speed-up (min) | bf16 rel. error | "
          "onnxruntime ms | OpenVINO default ms | OpenVINO f32 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, threads, ms, best, errs in rows:
        ovd = next((v for k, v in ms.items() if k.startswith("openvino (")), None)
        ovf = ms.get("openvino f32")
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        print(f"| {name} | {threads} | {ms['cuvil fp32']:.2f} | {ms['cuvil bf16']:.2f} | "
              f"{ms['cuvil fp32'] / ms['cuvil bf16']:.2f}x | {best['cuvil fp32'] / best['cuvil bf16']:.2f}x | "
              f"{errs['cuvil bf16']:.1e} | {ms['onnxruntime']:.2f} | "
              f"{fmt(ovd)} | {fmt(ovf)} |")


if __name__ == "__main__":
    main()
