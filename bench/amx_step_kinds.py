"""Two ResNet-50 libraries' in-kernel time per step kind (GEMM steps by kernel, K and output size; pads, pools
and the rest by kernel), the step profiler alternated between them for ROUNDS rounds (5 runs each), 1 thread:
median of the rounds, or with --min the best round. A/B of a kernel change where amx_resnet_ab.py --steps (GEMM
steps only) leaves out the non-GEMM steps.

    PYTHONPATH=src python3 bench/amx_step_kinds.py A.so B.so ROUNDS [--min]
"""
import json, sys, numpy as np
from collections import defaultdict
from cuvil.targets.x86.loader import load
paths = sys.argv[1:3]; rounds = int(sys.argv[3])
libs = {k: load(p, num_threads=1) for k, p in zip("AB", paths)}
x = np.random.default_rng(0).standard_normal(libs["A"].inputs[0].shape).astype(np.float32)
prof = {k: [] for k in libs}
for i in range(rounds):
    for k, m in (list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]):
        prof[k].append(m.profile(x, runs=5, num_threads=1))
for k, p in zip("AB", paths):
    man = json.load(open(p[:-3] + ".manifest.json"))["steps"]
    med = np.median(np.array(prof[k]), 0) if "--min" not in sys.argv else np.array(prof[k]).min(0)
    g = defaultdict(float)
    for i, st in enumerate(man):
        kind = st["kernel"]
        if kind == "gemm":
            K = st.get("flops", 0) // max(1, 2 * int(np.prod(st["shape"][1:])))
            kind = ("3x3" if K % 9 == 0 else "stem" if K == 147 else "1x1") + f" K={K} {st['shape'][2] if len(st['shape']) > 2 else ''}"
        g[kind] += 1e3 * med[i]
    prof[k + "g"] = g
keys = sorted(set(prof["Ag"]) | set(prof["Bg"]), key=lambda s: -prof["Ag"].get(s, 0))
for s in keys:
    a, b = prof["Ag"].get(s, 0), prof["Bg"].get(s, 0)
    print(f"{s:24} {a:8.3f} {b:8.3f} {b / a if a else 0:6.3f}")
print(f"{'total':24} {sum(prof['Ag'].values()):8.3f} {sum(prof['Bg'].values()):8.3f}")
