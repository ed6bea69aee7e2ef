"""Cuvil's float32 vector math (exp, erf, tanh, log; Sigmoid through exp) against libm: errors in ULPs over
every STRIDE-th float32 bit pattern, and speed over 1M floats at 1 thread.

    PYTHONPATH=src python bench/vecmath.py                 # every 64th float32, every float32 in 0.5 <= |x| < 8
    PYTHONPATH=src python bench/vecmath.py --stride 4099 --dense 0   # a quick look (1M values per function)
    PYTHONPATH=src python bench/vecmath.py --block 128       # + a BERT-base encoder block at S = 128

Each function is a one-node ONNX model compiled for this CPU twice: ``math="vector"`` (the inline polynomials
of src/cuvil/targets/llvm/vecmath.py, the default) and ``math="libm"`` (one glibc call per element, the path
before them), run over two sets of points: every STRIDE-th float32 bit pattern (the whole float line,
67M values at 64), and every float32 with 0.5 <= |x| < 2^DENSE (67M at 3: the binades where the reductions
and the polynomials' seams put the largest errors; a stride misses points, the maximum of every 64th
differed from every 4099th). Errors are against the float64 result (numpy's, Python's math.erf), in float32 ULPs at that
result (0.5 = correctly rounded), over the points where the result is a finite float32; every other point
(inf, NaN) must match exactly and the count of mismatches is printed. The speed table times ``run`` of the
1M-element model (median of 30 runs, after 3 warm-ups; elements per ns) and numpy's float32 function on
the same array. ``--block S``: one BERT-base encoder block (hidden 768, 12 heads, ffn 3072, erf GELU, Softmax,
LayerNormalization; cuvil.testing.transformer_block) at batch 1, sequence S, built both ways and run beside
onnxruntime, all at 1 thread, runs alternating with a pause before each: p50 of each.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time
import warnings

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86.loader import load
from cuvil.testing.models import transformer_block
from cuvil.testing.ulp import REFERENCES, float32_sweep, mismatched_non_finite, ulp_errors, unary_model

OPS = ("Exp", "Erf", "Tanh", "Log", "Sigmoid")
NUMPY = {"Exp": np.exp, "Tanh": np.tanh, "Log": np.log, "Sigmoid": lambda x: 1 / (1 + np.exp(-x))}
CHUNK = 1 << 22
SPEED_N = 1 << 20
# inputs of the speed table: where each function does real work (not the saturated ends)
SPEED_RANGE = {"Exp": (-80, 80), "Erf": (-4, 4), "Tanh": (-9, 9), "Log": (1e-30, 1e30), "Sigmoid": (-80, 80)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def library(op: str, n: int, math: str):
    art = Pipeline.from_onnx(unary_model(op, n)).optimize().compile(math=math)
    return load(art.path, num_threads=1)


def dense_points(top: int) -> np.ndarray:
    """Every float32 with 0.5 <= |x| < 2^top."""
    lo, hi = np.array([0.5, 2.0 ** top], np.float32).view(np.uint32)
    pos = np.arange(lo, hi, dtype=np.uint32).view(np.float32)
    return np.concatenate([pos, -pos])


def sweep(op: str, math: str, x_all: np.ndarray):
    """(largest error in ULPs, the x where it occurs, non-finite mismatches) over the points ``x_all``."""
    lib = library(op, CHUNK, math)
    worst, worst_x, bad = 0.0, None, 0
    for start in range(0, x_all.size, CHUNK):
        x = x_all[start:start + CHUNK]
        n = x.size
        if n < CHUNK:
            x = np.concatenate([x, np.zeros(CHUNK - n, np.float32)])
        y = lib.run(x)[0][:n]
        x = x[:n]
        with np.errstate(all="ignore"):
            ref = REFERENCES[op](x.astype(np.float64))
        err, non_finite = ulp_errors(y, ref)
        if op == "Sigmoid":   # 1 / (1 + exp(-x)) is 0 once exp(-x) overflows: ULPs counted where it is normal
            err = np.where(ref[~non_finite] >= 2.0 ** -126, err, 0.0)
        bad += len(mismatched_non_finite(y, ref))
        if err.size and err.max() > worst:
            i = int(np.argmax(err))
            worst, worst_x = float(err[i]), float(x[~non_finite][i])
    return worst, worst_x, bad


def per_element_ns(fn, runs: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / SPEED_N * 1e9


def end_to_end(seq: int, runs: int = 40, pause_s: float = 0.05):
    """p50 (ms) of the BERT-base block at sequence ``seq``: Cuvil vector math, Cuvil libm, onnxruntime."""
    import onnxruntime as ort   # the oracle: a bench extra, not a dependency of Cuvil

    model = transformer_block(d_model=768, heads=12, d_ff=3072, batch=1, seq=seq, seed=0)
    p = Pipeline.from_onnx(model).optimize()
    engines = {m: load(p.compile(math=m).path, num_threads=1) for m in ("vector", "libm")}
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((1, seq, 768)).astype(np.float32)
    name = sess.get_inputs()[0].name
    runners = {"Cuvil vector": lambda: engines["vector"].run(x), "Cuvil libm": lambda: engines["libm"].run(x),
               "onnxruntime": lambda: sess.run(None, {name: x})}
    got = engines["vector"].run(x)[0]
    want = sess.run(None, {name: x})[0]
    times = {k: [] for k in runners}
    for f in runners.values():
        for _ in range(3):
            f()
    for i in range(runs):
        order = list(runners.items()) if i % 2 == 0 else list(runners.items())[::-1]
        for k, f in order:
            time.sleep(pause_s)
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}, float(np.max(np.abs(got - want)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stride", type=int, default=64, help="every STRIDE-th float32 bit pattern (default 64)")
    ap.add_argument("--dense", type=int, default=3, help="every float32 in 0.5 <= |x| < 2^DENSE (default 3; "
                                                           "0: none)")
    ap.add_argument("--block", type=int, nargs="*", default=[], metavar="S",
                    help="also time a BERT-base encoder block at these sequence lengths")
    ap.add_argument("--runs", type=int, default=40, help="runs of each engine for --block (default 40)")
    ap.add_argument("ops", nargs="*", default=list(OPS), help=f"functions (default: {' '.join(OPS)})")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    print(f"# {cpu_model()}, {datetime.date.today().isoformat()}, 1 thread")
    sets = [(f"every {args.stride}th float32", float32_sweep(args.stride))]
    if args.dense:
        sets.append((f"every float32 in 0.5 <= |x| < {2 ** args.dense}", dense_points(args.dense)))
    print("\n## errors (ULPs against float64; 0.5 = correctly rounded)\n")
    print("| function | points | vector max ULP (at x) | libm max ULP (at x) | non-finite mismatches vector / libm |")
    print("|---|---|---|---|---|")
    for op in args.ops:
        for name, x in sets:
            v, m = sweep(op, "vector", x), sweep(op, "libm", x)
            print(f"| {op} | {name} ({x.size:,}) | {v[0]:.3f} ({v[1]:.9g}) | {m[0]:.3f} ({m[1]:.9g}) | "
                  f"{v[2]} / {m[2]} |", flush=True)
    print(f"\n## speed over {SPEED_N:,} floats (elements per ns, median of 30 runs; higher is faster)\n")
    print("| function | Cuvil vector | Cuvil libm | numpy | vector speed-up over libm |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for op in args.ops:
        lo, hi = SPEED_RANGE[op]
        x = (np.exp(rng.uniform(np.log(lo), np.log(hi), SPEED_N)) if op == "Log"
             else rng.uniform(lo, hi, SPEED_N)).astype(np.float32)
        vec, lm = library(op, SPEED_N, "vector"), library(op, SPEED_N, "libm")
        t_vec = per_element_ns(lambda: vec.run(x))
        t_libm = per_element_ns(lambda: lm.run(x))
        t_np = per_element_ns(lambda: NUMPY[op](x)) if op in NUMPY else None
        np_col = f"{1 / t_np:.2f}" if t_np is not None else "n/a (numpy has no erf)"
        print(f"| {op} | {1 / t_vec:.2f} | {1 / t_libm:.3f} | {np_col} | {t_libm / t_vec:.1f}x |", flush=True)

    for seq in args.block:
        p50, err = end_to_end(seq, args.runs)
        if seq == args.block[0]:
            print("\n## BERT-base encoder block, batch 1, 1 thread (p50 ms)\n")
            print("| S | Cuvil vector | Cuvil libm | onnxruntime | vector / onnxruntime | libm / onnxruntime | "
                  "max abs difference to onnxruntime |")
            print("|---|---|---|---|---|---|---|")
        v, m, o = p50["Cuvil vector"], p50["Cuvil libm"], p50["onnxruntime"]
        print(f"| {seq} | {v:.2f} | {m:.2f} | {o:.2f} | {v / o:.2f} | {m / o:.2f} | {err:.2e} |", flush=True)


if __name__ == "__main__":
    main()
