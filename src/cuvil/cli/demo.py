"""``cuvil demo``: Cuvil's main job on a small bundled CNN, start to end, in a few seconds."""
from __future__ import annotations

import os
import time

import numpy as np

from ..ir.dim import evaluate
from ..pipeline import Pipeline
from ..rewrite_rules.proved_rewrite import applied_rules
from ..version import __version__
from .counts import fmt_count
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("demo", help="run Cuvil's main job on a small bundled model",
                        description="Cuvil's main job on a small CNN shipped with it (symbolic batch N), in a few "
                                    "seconds: import the ONNX model, apply the rewrite rules Z3 proved, compile a "
                                    "native library, run it and compare with onnx.reference (and onnxruntime if "
                                    "installed), then one library for a batch range. Exit 0 if every output "
                                    "agrees within 1e-5.")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_demo)


def demo_model_path() -> str:
    """The bundled demo CNN (cuvil/data/demo_cnn.onnx, symbolic batch N)."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "demo_cnn.onnx")


def cmd_demo(args) -> int:
    """Cuvil's main job on a small bundled CNN: import, proved rewrites, native compile, run, compare."""
    path = demo_model_path()
    print(f"cuvil {__version__} demo: {os.path.basename(path)} (bundled)")
    t0 = time.perf_counter()
    src = Pipeline.from_onnx(path)
    t1 = time.perf_counter()
    opt = src.optimize()
    t2 = time.perf_counter()
    before, after = src.stats(), opt.stats()
    print(f"imported   {len(src.graph.nodes):3} nodes in {1e3 * (t1 - t0):4.0f} ms: "
          + ", ".join(f"{k} {v}" for k, v in before.op_histogram.items()))
    print(f"optimized  {len(opt.graph.nodes):3} nodes in {1e3 * (t2 - t1):4.0f} ms: "
          + ", ".join(f"{k} {v}" for k, v in after.op_histogram.items()))
    fired = ", ".join(f"{k} x{r['applied']} (prove {r['obligation']}: {r['verdict']})"
                      for k, r in applied_rules(opt.report).items())
    print(f"rules fired (each checked by Z3 before running; verdict after the colon): {fired}")
    print(f"parameters {after.parameters:,}; {fmt_count(after.flops)} FLOPs per inference")
    batch = 2
    art = opt.compile(fixed={s: batch for s in opt.graph.symbols})
    t3 = time.perf_counter()
    m = art.manifest
    print(f"compiled   {m['kernels']} kernels into {os.path.basename(art.path)} "
          f"({'cached' if art.cached else f'{t3 - t2:.1f} s'}; arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B, "
          f"specialized {m['specialized']}, deps {', '.join(os.path.basename(d) for d in m['dependencies'])})")
    rng = np.random.default_rng(0)
    x = src.graph.inputs[0]
    shape = tuple(evaluate(d, {s: batch for s in x.type.free_symbols}) for d in x.shape)
    feeds = {x.name: rng.standard_normal(shape).astype(np.float32)}
    ref = src.run_reference(feeds)
    native = art.run(feeds)
    t4 = time.perf_counter()
    for _ in range(20):
        art.run(feeds)
    per_run = (time.perf_counter() - t4) / 20
    worst = 0.0
    for name in src.graph.output_names:
        a, b = native[name], ref[name]
        worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)))
        print(f"output {name}: {a.dtype}{list(a.shape)}; native vs onnx.reference of the original: max rel. error {worst:.2e}"
              f" ({1e6 * per_run:.0f} us per run)")
    try:
        import onnxruntime as ort
        sess = ort.InferenceSession(src.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
        o = sess.run(None, feeds)
        err = max(float(np.max(np.abs(o[k] - native[n])) / (np.max(np.abs(o[k])) + 1e-30))
                  for k, n in enumerate(src.graph.output_names))
        print(f"native vs onnxruntime: max rel. error {err:.2e}")
    except ImportError:
        pass
    # dynamic shapes: one library for a whole batch range, checked against the reference at several sizes
    if opt.graph.symbols:
        profile = {s: (1, batch, 8) for s in opt.graph.symbols}
        t5 = time.perf_counter()
        dyn = opt.compile(shape_profiles=profile)
        t6 = time.perf_counter()
        errs = []
        for n in (1, 5, 8):
            shape = tuple(evaluate(d, {s: n for s in x.type.free_symbols}) for d in x.shape)
            f = {x.name: rng.standard_normal(shape).astype(np.float32)}
            r, got = src.run_reference(f), dyn.run(f)
            errs.append(max(float(np.max(np.abs(got[k] - r[k])) / (np.max(np.abs(r[k])) + 1e-30)) for k in r))
        prof = ", ".join(f"{k}={a}:{o}:{b}" for k, (a, o, b) in profile.items())
        print(f"dynamic    one library for {prof} ({'cached' if dyn.cached else f'{t6 - t5:.1f} s'}): batches 1, 5, 8 "
              f"vs onnx.reference: max rel. error {max(errs):.2e}")
        worst = max(worst, max(errs))
    ok = worst <= 1e-5
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
