"""Where the time goes: per-kernel time, share and GFLOP/s of a model's native library.

    python3 bench/x86_profile.py resnet50 [--threads 1] [--runs 10] [--top 25]
    python3 bench/x86_profile.py path/to/model.onnx
    python3 bench/x86_profile.py transformer_block --fix B=1 --fix S=128   # cuvil.testing's encoder block
    python3 bench/x86_profile.py bert --fix sequence=32 --op LayerNormalization   # BERT-base, fixed shapes

Uses the runtime's step profiler (``<prefix>_profile``, see docs/c-abi.md) and the manifest's per-step
FLOPs (2 x multiply-adds of convolutions/matrix products; other work is not counted). ``gemm`` kernels
are register-blocked micro-kernels, ``loop`` kernels the generic loop nests.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from cuvil import Pipeline
from cuvil.testing import LIGHT_MODELS, light_model
from cuvil.testing.hf_models import bert_model, text_feeds
from cuvil.testing.models import transformer_block


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help=f"one of {', '.join(LIGHT_MODELS)}, transformer_block (d_model 256, 8 heads, "
                    "d_ff 1024), bert (BERT-base, cuvil.testing.hf_models, token inputs) or an .onnx path")
    ap.add_argument("--fix", action="append", default=[], metavar="NAME=INT",
                    help="a symbolic dim's value (default: each symbol's opt, else min)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-winograd", action="store_true", help="keep 3x3 convolutions direct")
    ap.add_argument("--tune", action="store_true", help="the --tune build (choices from $CUVIL_CACHE_DIR/tune)")
    ap.add_argument("--no-fused-attention", action="store_true",
                    help="keep attention as MatMul / Softmax / MatMul (no FusedAttention kernel)")
    ap.add_argument("--op", default=None, help="also list every step of this ONNX op (e.g. LayerNormalization)")
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="per-core fp32 peak for the %%-of-peak column (default: not shown)")
    a = ap.parse_args(argv)
    if os.path.exists(a.model):
        src = a.model
    elif a.model == "transformer_block":
        src = transformer_block(d_model=256, heads=8, d_ff=1024)
    elif a.model == "bert":
        src = bert_model()
    else:
        src = light_model(a.model, seed=0)
    p = Pipeline.from_onnx(src).optimize()
    fixed = {k: int(v) for k, v in (f.split("=", 1) for f in a.fix)}
    fixed = p.resolve_shapes(fixed)[0]      # input.axis names (x.2=640) to the symbols they stand for
    fixed.update({name: sym.tuned for name, sym in p.graph.symbols.items() if name not in fixed})
    art = p.compile(fixed=fixed, winograd=not a.no_winograd, fused_attention=not a.no_fused_attention,
                    **({"tune": True} if a.tune else {}))
    model = art.model()
    if a.model == "bert":        # token ids, masks and types in range
        feeds = text_feeds(src, fixed["batch"], fixed["sequence"])
        times = model.profile(runs=a.runs, num_threads=a.threads, **feeds)
    else:
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal(d.shape).astype(d.dtype) for d in model.inputs]
        times = model.profile(*xs, runs=a.runs, num_threads=a.threads)
    steps = art.manifest["steps"]
    total = sum(times)
    flops = sum(s["flops"] for s in steps)
    print(f"{a.model}: {len(steps)} kernels, {total * 1e3:.2f} ms per run in kernels, "
          f"{flops / 1e9:.2f} GFLOP, {flops / total / 1e9:.1f} GFLOP/s overall ({a.threads} thread(s))")
    by_kind = {}
    for s, t in zip(steps, times):
        by_kind.setdefault(s["kernel"], [0.0, 0])
        by_kind[s["kernel"]][0] += t
        by_kind[s["kernel"]][1] += s["flops"]
    for k, (t, f) in sorted(by_kind.items()):
        print(f"  {k:5}: {t * 1e3:8.2f} ms ({100 * t / total:4.1f}%), {f / max(t, 1e-12) / 1e9:6.1f} GFLOP/s")
    peak = a.peak_gflops * a.threads if a.peak_gflops else None
    print(f"\n{'ms':>8} {'%':>5} {'GFLOP/s':>8} {'%peak' if peak else '':>6} kernel  stage  shape")
    order = sorted(range(len(steps)), key=lambda k: -times[k])[:a.top]
    for k in order:
        s, t = steps[k], times[k]
        gf = s["flops"] / t / 1e9 if s["flops"] and t > 0 else 0.0
        pk = f"{100 * gf / peak:5.0f}%" if peak and gf else ""
        print(f"{t * 1e3:8.3f} {100 * t / total:5.1f} {gf:8.1f} {pk:>6} {s['kernel']:5}  {s.get('op', '')}:{s['stage']}  {s['shape']}")
    if a.op:
        mine = [(s, t) for s, t in zip(steps, times) if s.get("op") == a.op]
        print(f"\n{a.op}: {len(mine)} steps, {sum(t for _, t in mine) * 1e3:.3f} ms in all")
        for s, t in mine:
            print(f"{t * 1e6:9.1f} us  {s['kernel']:5}  {s['stage']}  {s['shape']}")


if __name__ == "__main__":
    main()
