"""One library per model for a whole shape profile: correctness and latency across the profile, and the
generic kernels vs the ones specialised for the profile's opt point, beside onnxruntime, in one process.

    python3 bench/dynamic_shapes.py                  # writes bench/DYNAMIC.md
    python3 bench/dynamic_shapes.py --runs 10 --out /tmp/d.md

Models: SqueezeNet and DenseNet-121 (the light architectures, seeded random weights) with their batch dim
made symbolic (N = 1:1:8), and the transformer encoder block of ``cuvil.testing.transformer_block``
(d_model 256, 8 heads, d_ff 1024) with symbolic batch and sequence (B = 1:1:4, S = 16:128:256).

Each model is compiled twice, at O3, with one profile: the default library (generic kernels + kernels
specialised for the opt point, chosen at run time) and one with ``opt_kernels=False`` (generic only). At
the opt point the two show what specialisation buys; at the other points every call runs the generic
kernels. Runs alternate between the engines so machine noise hits them alike; p50 over ``--runs`` runs,
one thread. Timings on a shared 2-core machine are noisy: read ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

import cuvil
from cuvil import Pipeline
from cuvil.bench import host_info
from cuvil.testing.models import light_model, transformer_block


def symbolic_batch(m: onnx.ModelProto, name: str = "N") -> onnx.ModelProto:
    """``m`` with dim 0 of its inputs and outputs named ``name`` (inferred shapes dropped)."""
    m = onnx.ModelProto.FromString(m.SerializeToString())
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = name
    del m.graph.value_info[:]
    return m


def cases():
    tb = transformer_block(d_model=256, heads=8, d_ff=1024)
    return [
        ("squeezenet", symbolic_batch(light_model("squeezenet")), {"N": (1, 1, 8)},
         [{"N": 1}, {"N": 2}, {"N": 5}, {"N": 8}]),
        ("densenet121", symbolic_batch(light_model("densenet121")), {"N": (1, 1, 8)},
         [{"N": 1}, {"N": 3}, {"N": 8}]),
        ("transformer_block", tb, {"B": (1, 1, 4), "S": (16, 128, 256)},
         [{"B": 1, "S": 128}, {"B": 1, "S": 16}, {"B": 2, "S": 77}, {"B": 4, "S": 256}]),
    ]


def p50(fn, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_case(name, model, profile, points, runs):
    p = Pipeline.from_onnx(model).optimize()
    t0 = time.perf_counter()
    both = p.compile(shape_profiles=profile, cache=False)
    t_both = time.perf_counter() - t0
    t0 = time.perf_counter()
    generic = p.compile(shape_profiles=profile, cache=False, opt_kernels=False)
    t_generic = time.perf_counter() - t0
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    lib_b, lib_g = cuvil.load(both.path, num_threads=1), cuvil.load(generic.path, num_threads=1)
    inp = model.graph.input[0]
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    opt = {k: v[1] for k, v in profile.items()}
    rows = []
    for env in points:
        shape = [env[d] if isinstance(d, str) else d for d in dims]
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        (ref,) = sess.run(None, {inp.name: x})[:1]
        (yb,) = lib_b.run(x)[:1]
        (yg,) = lib_g.run(x)[:1]
        scale = float(np.abs(ref).max()) or 1.0
        err = max(float(np.abs(yb - ref).max()), float(np.abs(yg - ref).max())) / scale
        tb, tg, to = [], [], []
        for _ in range(runs):   # alternate
            tb.append(p50(lambda: lib_b.run(x), 1))
            tg.append(p50(lambda: lib_g.run(x), 1))
            to.append(p50(lambda: sess.run(None, {inp.name: x}), 1))
        rows.append({"point": env, "at_opt": env == opt, "rel_err": err, "lib_ms": 1e3 * statistics.median(tb),
                     "generic_ms": 1e3 * statistics.median(tg), "ort_ms": 1e3 * statistics.median(to)})
    man = both.manifest
    return {"model": name, "profile": profile, "rows": rows, "compile_s": t_both, "compile_generic_s": t_generic,
            "arena_bytes": man["arena_bytes"], "opt_weights": man.get("opt_weights"),
            "so_bytes": os.path.getsize(both.path), "so_generic_bytes": os.path.getsize(generic.path)}


def fmt_env(env):
    return ", ".join(f"{k}={v}" for k, v in env.items())


def report(results, runs) -> str:
    out = [f"# Dynamic shapes: one library per profile ({datetime.date.today()})", "",
           f"`python3 bench/dynamic_shapes.py --runs {runs}` on {host_info()['cpu']} ({platform.machine()}), "
           f"{os.cpu_count()} cores, 1 thread, O3; onnxruntime {ort.__version__}; p50 over {runs} alternating runs.",
           "", "`lib` is the default library (generic kernels + kernels specialised for the opt point, picked at "
           "run time when the shapes are exactly the opt point); `generic` was compiled with `opt_kernels=False`. "
           "rel err: max |cuvil - onnxruntime| / max |onnxruntime| over both libraries.", ""]
    for r in results:
        prof = ", ".join(f"{k}={a}:{b}:{c}" for k, (a, b, c) in r["profile"].items())
        out += [f"## {r['model']} ({prof})", "",
                f"compile {r['compile_s']:.1f} s (generic only: {r['compile_generic_s']:.1f} s); arena planned for "
                f"the maxima {r['arena_bytes'] / 2**20:.1f} MiB (reserved, touched as used); .so "
                f"{r['so_bytes'] / 2**20:.1f} MiB (generic only {r['so_generic_bytes'] / 2**20:.1f} MiB); "
                f"opt kernels' weights: {r['opt_weights']}", "",
                "| shape | rel err | lib ms | generic ms | onnxruntime ms | lib / ort | generic / ort |",
                "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            tag = " (opt)" if row["at_opt"] else ""
            out.append(f"| {fmt_env(row['point'])}{tag} | {row['rel_err']:.1e} | {row['lib_ms']:.2f} | "
                       f"{row['generic_ms']:.2f} | {row['ort_ms']:.2f} | {row['lib_ms'] / row['ort_ms']:.2f} | "
                       f"{row['generic_ms'] / row['ort_ms']:.2f} |")
        out.append("")
    out += ["## Generic vs opt-specialised kernels at the opt point", "",
            "| model | opt point | generic ms | opt kernels ms | generic / opt |", "|---|---|---|---|---|"]
    for r in results:
        for row in r["rows"]:
            if row["at_opt"]:
                out.append(f"| {r['model']} | {fmt_env(row['point'])} | {row['generic_ms']:.2f} | {row['lib_ms']:.2f} | "
                           f"{row['generic_ms'] / row['lib_ms']:.2f} |")
    out += ["", "The generic kernels read the symbols at run time; the GEMM, MatMul and row micro-kernels keep their "
            "static tile geometry (only the number of tiles or rows is symbolic), so specialising buys little "
            "here: ratios near 1.0 are within this machine's run-to-run noise.", ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "DYNAMIC.md"))
    ap.add_argument("models", nargs="*", help="subset of: squeezenet densenet121 transformer_block")
    args = ap.parse_args()
    results = []
    for name, model, profile, points in cases():
        if args.models and name not in args.models:
            continue
        print(f"{name} ...", flush=True)
        results.append(bench_case(name, model, profile, points, args.runs))
        for row in results[-1]["rows"]:
            print(f"  {fmt_env(row['point'])}: err {row['rel_err']:.1e} lib {row['lib_ms']:.2f} ms "
                  f"generic {row['generic_ms']:.2f} ms ort {row['ort_ms']:.2f} ms", flush=True)
    text = report(results, args.runs)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
