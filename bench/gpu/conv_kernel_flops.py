"""Per-convolution times and TFLOP/s of ResNet-50 on the GPU, from ``tensor_cores.py``'s JSON (its
``all_kernels``, CUDA events around each launch in eager mode: each includes the host's 5-7 µs launch gap, so
small kernels read slow) joined with each convolution's size and tile plan, computed here without a GPU.

    python3 bench/gpu/conv_kernel_flops.py RESULTS.json [--batch 32] [--modes fp16 fp16_base] [--peak 990]

Prints one row per convolution stage: geometry, plan (tile, window copy width ``vec``, stages, split-K) of
the first mode, milliseconds per mode, TFLOP/s of the first mode and its share of ``--peak`` (the H200's dense
float16 tensor-core peak, TFLOP/s, datasheet), then sums per kind of convolution.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)


def conv_stages(batch: int):
    """stage name -> (label, flops, plan) for ResNet-50 in float16 at ``batch`` (the default tuning)."""
    import attrs
    from cuvil import Pipeline
    from cuvil.rewrite_rules.precision import to_half
    from cuvil.targets.ptx.codegen import PtxKernelModule, gpu_schedule, target_machine, widen_half_reductions
    from cuvil.kernels.kernel_rules import rewrite_stages, select_kernel_rules
    from cuvil.targets.ptx.conv import conv_node
    from cuvil.testing import with_batch
    from tensor_cores import build_model
    model, _ = build_model("resnet50")
    g, _ = to_half(Pipeline.from_onnx(with_batch(model, batch)).optimize().graph)
    s = gpu_schedule(g)
    km = PtxKernelModule("t", target_machine(), scratch_offset=s.arena_bytes)
    out = {}
    stages = [attrs.evolve(st, expr=widen_half_reductions(st.expr)) for st in s.stages]
    stages, _ = rewrite_stages(stages, select_kernel_rules(None, fma=True))     # as build_ptx does
    for st in stages:
        node = conv_node(st)
        if node is None:
            continue
        c = node.attr
        p = 1
        for d in c.out_spatial:
            p *= int(d)
        k = "x".join(str(int(x)) for x in c.kernel)
        label = f"{k} s{int(c.strides[0])} {c.cin}->{c.m} @{int(c.x.shape[2])}"
        plan = km.conv_plan(st, node)
        desc = (f"{plan.bm}x{plan.bn} vec{plan.vec} st{plan.stages} split{plan.splits}"
                + (" tap" if plan.tap_major else "") if hasattr(plan, "fmt") else "conv.py")
        out[st.name] = (label, 2 * c.n * c.groups * c.m * p * c.k, desc)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["fp16", "fp16_base"])
    ap.add_argument("--peak", type=float, default=990.0)
    args = ap.parse_args(argv)
    r = json.load(open(args.json))["resnet50"]
    times = []
    for mode in args.modes:
        t = defaultdict(float)
        for k in r[f"cuvil_{mode}_b{args.batch}"]["all_kernels"]:
            t[k["stage"]] += k["ms"]        # a split-K convolution: its kernel and its sum kernel
        times.append(t)
    convs = conv_stages(args.batch)
    print(f"ResNet-50 fp16 batch {args.batch}; ms per mode: {', '.join(args.modes)}")
    print(f"| stage | convolution | plan ({args.modes[0]}) | GFLOP | " + " | ".join(f"{m} ms" for m in args.modes)
          + f" | TFLOP/s ({args.modes[0]}) | of {args.peak:.0f} |")
    print("|---" * (6 + len(args.modes)) + "|")
    kinds = defaultdict(lambda: [0.0] + [0.0] * len(args.modes))
    for name, (label, fl, desc) in convs.items():
        ms = [t.get(name, float("nan")) for t in times]
        tf = fl / (ms[0] * 1e-3) / 1e12
        print(f"| {name} | {label} | {desc} | {fl / 1e9:.2f} | " + " | ".join(f"{x:.4f}" for x in ms)
              + f" | {tf:.0f} | {100 * tf / args.peak:.0f}% |")
        kind = label.split(" @")[0].split(" ")[0] + " " + label.split(" ")[1]
        kinds[kind][0] += fl
        for i, x in enumerate(ms):
            kinds[kind][1 + i] += x
    print()
    print("| kind | GFLOP | " + " | ".join(f"{m} ms" for m in args.modes) + f" | TFLOP/s ({args.modes[0]}) |")
    print("|---" * (3 + len(args.modes)) + "|")
    for kind, (fl, *ms) in sorted(kinds.items()):
        print(f"| {kind} | {fl / 1e9:.1f} | " + " | ".join(f"{x:.3f}" for x in ms)
              + f" | {fl / (ms[0] * 1e-3) / 1e12:.0f} |")
    tot = [sum(t.values()) for t in times]
    print("\nall kernels: " + ", ".join(f"{m} {x:.3f} ms" for m, x in zip(args.modes, tot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
