"""A/B of two builds of the every-contraction-bf16 ResNet-50 (e.g. before / after a change to the AMX
kernels) in one process, with OpenVINO's default (bf16 on a CPU with AMX) beside them, 1 thread.

    # the library of the current tree (every Conv / MatMul / Gemm narrowed, as precision_speed.py --every):
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/new.so
    # the same with float32 activations between the bf16 convolutions (X86Tuning(bf16_storage=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/f32act.so --fp32-activations
    # ... and with the skip path in bfloat16 too (a new rounding: X86Tuning(bf16_residual=True))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/resid.so --bf16-residual
    # through the precision policy (--precision bf16, the input declared over the feed's range): the plan
    # decides the skip path's storage; --no-bf16-residual opts out (X86Tuning(bf16_residual=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/policy.so --policy
    # ... with the classifier's Gemm narrowed too (the policy keeps the output layer float32 by default)
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/narrow-head.so --policy --narrow-head
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/policy-f32skip.so --policy --no-bf16-residual
    # the same without the AMX epilogues' prefetch of the next panel (X86Tuning(next_panel_prefetch=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/nopf.so --no-next-panel-prefetch
    # the same with the large 1x1 convolutions in panel order, not swept per channel block (X86Tuning(channel_sweep=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/nosweep.so --policy --no-channel-sweep
    # the same with producers writing into their 3x3 reader's padded buffer, no copies (X86Tuning(pad_in_place=True))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/inplace.so --policy --pad-in-place
    # the same with im2col pair panels packed per 32 positions, not pair planes (X86Tuning(bf16_planes=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/panels.so --policy --no-planes --no-channels-last
    # the same with the channel-planar convolutions (pair planes, packed panels), not the channels-last ones
    # that are the default on AMX (X86Tuning(channels_last=False))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/planar.so --policy --no-channels-last
    # the same with each bottleneck's last convolution and its projection shortcut as two convolutions, not one
    # over both inputs' channels (X86Tuning(conv_sum=False); rules/conv_sum.rule)
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/unfused.so --policy --no-conv-sum
    # the same with the 3x3 readers' rows written in place by their producers (X86Tuning(rows_in_place=True))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/inplace-rows.so --policy --rows-in-place
    # the vdpbf16ps kernels (a CPU with AVX512_BF16 and no AMX), with and without the planes
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/dp.so --policy --no-amx [--planes]
    # ... with the 3x3 convolutions direct, or every one as Winograd F(2x2) (X86Tuning(bf16_winograd=False / True))
    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/dp-direct.so --policy --no-amx --no-bf16-winograd
    # the same from an older tree (git archive OLD | tar -x -C /tmp/old; cd /tmp/old; ... --build /tmp/old.so)
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so [--blocks 3 --runs 15]
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so --steps 40   # GEMM steps by kind
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so --steps 9 --prep-in   # with input prep
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so --steps 15 --cold   # one run after a pause
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so --steps 21 --cold --by-stage   # and per stage
    PYTHONPATH=src python3 bench/amx_resnet_ab.py /tmp/old.so /tmp/new.so --error-inputs 16   # error only

Default: wall p50 / min and calling-thread CPU p50 per block (runs alternated, a pause before each; OpenVINO
computes on its own thread, so its CPU column is not comparable); ``--threads N`` times every engine with N
threads (default 1). ``--steps R``: R alternating rounds of the
step profiler; the GEMM steps summed by kind (3x3 / stem / 1x1 by their K), the others by kernel (pad
copies, pools: each library's own steps), median and best round, B/A.
The CPU model is printed first; timings on a shared VM are noisy: read the ratios, repeat in both orders.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from precision_speed import compile_at, model_and_feeds, openvino_runners, rel_err, timings  # noqa: E402


def cpu_model() -> str:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return platform.processor()
    return f"{info.get('model name')} (family {info.get('cpu family')}, model {info.get('model')}, stepping {info.get('stepping')})"


#: the --build flags that change one X86Tuning field from its default: (flag, field, value, what it builds)
TUNING_FLAGS = [
    ("--fp32-activations", "bf16_storage", False,
     "float32 activations between the bf16 convolutions (the A of the bf16-activations A/B)"),
    ("--bf16-residual", "bf16_residual", True, "the residual (skip) path stored as bfloat16 too"),
    ("--no-bf16-residual", "bf16_residual", False, "the skip path float32 whatever the plan says"),
    ("--no-next-panel-prefetch", "next_panel_prefetch", False, "no prefetch of the next panel in the AMX epilogues"),
    ("--no-channel-sweep", "channel_sweep", False, "the large AMX 1x1 convolutions in panel order"),
    ("--pad-in-place", "pad_in_place", True,
     "producers write into their 3x3 reader's padded buffer, no padded copies"),
    ("--no-planes", "bf16_planes", False,
     "the AMX convolutions pack im2col pair panels instead of reading pair planes"),
    ("--planes", "bf16_planes", True, "pair planes on every bf16 path, vdpbf16ps included"),
    ("--no-amx", "amx", False,
     "the vdpbf16ps kernels even on a CPU with AMX, what a CPU with AVX512_BF16 and no AMX runs"),
    ("--no-channels-last", "channels_last", False,
     "the channel-planar AMX convolutions (pair planes, packed panels), not the channels-last ones"),
    ("--no-conv-sum", "conv_sum", False,
     "a bottleneck's last convolution and its projection shortcut as two convolutions, not one over both inputs' "
     "channels"),
    ("--no-bf16-winograd", "bf16_winograd", False,
     "the vdpbf16ps 3x3 convolutions direct, never Winograd F(2x2) (the default takes it where the cost model says)"),
    ("--bf16-winograd", "bf16_winograd", True, "every vdpbf16ps stride-1 3x3 convolution as Winograd F(2x2)"),
    ("--rows-in-place", "rows_in_place", True,
     "a 3x3 reader's rows written in place by its producer, the copy writing only the zeros around them"),
]


def steps(a: str, b: str, rounds: int, prep_in: bool = False, cold_pause: float = 0.0, by_stage: bool = False) -> None:
    from cuvil.targets.x86.loader import load
    libs = {"A": load(a, num_threads=1), "B": load(b, num_threads=1)}
    xs = [np.random.default_rng(0).standard_normal(d.shape).astype(d.dtype) for d in libs["A"].inputs]
    prof = {k: [] for k in libs}
    for m in libs.values():
        m.run(*xs, num_threads=1)
    for i in range(rounds):
        for k, m in (list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]):
            if cold_pause:       # one run after a pause, no warm-up: what --blocks' runs see
                time.sleep(cold_pause)
                prof[k].append(m.profile(*xs, runs=1, num_threads=1, warm_up=False))
            else:
                prof[k].append(m.profile(*xs, runs=5, num_threads=1))
    med = {k: np.median(np.array(v), 0) for k, v in prof.items()}
    best = {k: np.array(v).min(0) for k, v in prof.items()}
    # each library's own manifest: a change may add or remove steps (B's stem pool reads no padded copy)
    g = defaultdict(lambda: np.zeros(4))
    for col, (lab, path) in enumerate((("A", a), ("B", b))):
        with open(path[:-3] + ".manifest.json") as f:
            manifest = json.load(f)["steps"]
        held = np.zeros(2)       # --prep-in: a pad copy's or planes pass's time, added to the next step's
        for i, st in enumerate(manifest):
            if prep_in and st["kernel"] in ("pad", "bf16_planes"):
                held += 1e3 * np.array([med[lab][i], best[lab][i]])
                continue
            if st["kernel"] in ("gemm", "bf16_planes_amx", "bf16_planes_dp", "bf16_nhwc_amx"):
                k = st.get("flops", 0) // max(1, 2 * int(np.prod(st["shape"][1:])))
                kind = ("3x3" if k % 9 == 0 else "stem 7x7" if k == 147 else "1x1/fc") + f" K={k}"
                if prep_in:
                    kind += f" {st['shape'][-1]}"
            else:
                kind = f"({st['kernel']})"     # the other steps by kernel: pad copies, pools, ...
            g[kind][col] += 1e3 * med[lab][i] + held[0]
            g[kind][2 + col] += 1e3 * best[lab][i] + held[1]
            held = np.zeros(2)
    print(f"{'steps (ms)':20} {'A med':>8} {'B med':>8} {'B/A':>6} {'A min':>8} {'B min':>8} {'B/A':>6}")
    gemm = [kv for kv in g.items() if not kv[0].startswith("(")]
    rows = (sorted(gemm, key=lambda kv: -kv[1][0]) + [("all GEMM", sum(v for _, v in gemm))]
            + sorted((kv for kv in g.items() if kv[0].startswith("(")), key=lambda kv: -kv[1][0])
            + [("all steps", sum(g.values()))])
    for kind, v in rows:
        r = lambda x, y: f"{y / x:6.3f}" if x else f"{'-':>6}"
        print(f"{kind:20} {v[0]:8.3f} {v[1]:8.3f} {r(v[0], v[1])} {v[2]:8.3f} {v[3]:8.3f} {r(v[2], v[3])}")
    if by_stage:         # each stage by its name (a value's), in B's order, then A's stages that B does not have
        names = {}
        for lab, path in (("A", a), ("B", b)):
            with open(path[:-3] + ".manifest.json") as f:
                names[lab] = {st["stage"]: (i, st) for i, st in enumerate(json.load(f)["steps"])}
        print(f"\n{'stage (ms, median)':28} {'A':>8} {'B':>8}  kernel (B's, else A's), op, shape")
        for name in list(names["B"]) + [n for n in names["A"] if n not in names["B"]]:
            t = {lab: 1e3 * med[lab][names[lab][name][0]] if name in names[lab] else None for lab in "AB"}
            st = (names["B"].get(name) or names["A"][name])[1]
            cell = lambda v: f"{v:8.3f}" if v is not None else f"{'-':>8}"
            print(f"{name:28} {cell(t['A'])} {cell(t['B'])}  {st['kernel']}, {st['op']}, {st['shape']}")


def errors(paths, model, feeds, n: int) -> None:
    import onnxruntime as ort
    from cuvil.targets.x86.loader import load
    name, x0 = next(iter(feeds.items()))
    runners = {lab: (lambda x, lib=load(p, num_threads=1): lib.run(x, num_threads=1)) for lab, p in zip("AB", paths)}
    ov = {k: v for k, v in openvino_runners(model, 1).items() if "f32" not in k}
    runners.update({k: (lambda x, r=r: r({name: x})) for k, r in ov.items()})
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    errs = defaultdict(list)
    for i in range(n):
        x = x0 if i == 0 else np.clip(rng.standard_normal(x0.shape), x0.min(), x0.max()).astype(np.float32)
        ref = [np.asarray(o, np.float64) for o in sess.run(None, {name: x})]
        for k, r in runners.items():
            errs[k].append(rel_err(r(x), ref))
    print(f"rel. error vs onnxruntime fp32 over {n} inputs (the first the bench's feed): "
          + "; ".join(f"{k} median {np.median(v):.2e} max {max(v):.2e}" for k, v in errs.items()))
    for k in ("A", "B"):
        o = next(iter(ov), None)
        if o:
            print(f"  {k} <= {o} on {sum(e <= f for e, f in zip(errs[k], errs[o]))} of {n} inputs")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="*", help="two libraries: A (before) and B (after)")
    ap.add_argument("--build", metavar="PATH", help="compile the every-bf16 ResNet-50 of this tree to PATH")
    ap.add_argument("--policy", action="store_true",
                    help="with --build: through the precision policy (--precision bf16, the input declared over "
                         "the feed's range), not every Conv/MatMul/Gemm narrowed by hand")
    ap.add_argument("--narrow-head", action="store_true",
                    help="with --build --policy: the classifier's Gemm narrowed too (keep_fp32=[]); by default the "
                         "policy keeps the model's output layer float32 (cuvil.precision.heads)")
    for flag, field, value, what in TUNING_FLAGS:
        ap.add_argument(flag, action="store_true", help=f"with --build: {what} (X86Tuning({field}={value}))")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--pause-ms", type=float, default=30)
    ap.add_argument("--steps", type=int, default=0, metavar="R")
    ap.add_argument("--cold", action="store_true",
                    help="with --steps: each round profiles one run after a pause of --pause-ms, no warm-up (the "
                         "caches as a request after idle time sees them; default: 5 runs after a warm-up)")
    ap.add_argument("--by-stage", action="store_true",
                    help="with --steps: also each stage by name, A beside B (a stage one build lacks shows '-')")
    ap.add_argument("--prep-in", action="store_true",
                    help="with --steps: each pad copy or planes pass counted in the next convolution's time, and the "
                         "kinds split by output width (what a layer costs with its input's preparation)")
    ap.add_argument("--threads", type=int, default=1, help="threads of every engine in the timed blocks (default 1)")
    ap.add_argument("--error-inputs", type=int, default=0, metavar="N",
                    help="only the relative error vs onnxruntime fp32 over N more inputs (standard normal, clipped "
                         "to the feed's range the policy build declared): per engine median and max, and on how "
                         "many inputs B's is at or below OpenVINO's")
    a = ap.parse_args(argv)
    model, feeds, _ = model_and_feeds("resnet50", 128, 12)
    if a.build:
        fields = {}
        for flag, field, value, _ in TUNING_FLAGS:
            if getattr(a, flag[2:].replace("-", "_")):
                if fields.get(field, value) != value:
                    ap.error(f"{flag} contradicts another flag setting X86Tuning.{field}")
                fields[field] = value
        kw = {}
        if fields:
            from cuvil.targets.x86.tuning import X86Tuning
            kw["tuning"] = X86Tuning(**fields)
        if a.narrow_head:
            if not a.policy:
                ap.error("--narrow-head is a choice of the precision policy: give --policy too")
            kw["keep_fp32"] = []
        lib = compile_at(model, "bf16", feeds=feeds, every=not a.policy, **kw)
        shutil.copy(lib.path, a.build)
        shutil.copy(lib.path[:-3] + ".manifest.json", a.build[:-3] + ".manifest.json")
        print(a.build)
        return
    if len(a.libs) != 2:
        raise SystemExit("give two libraries (A B), or --build PATH to make one")
    print(cpu_model(), "| load", os.getloadavg())
    if a.steps:
        steps(*a.libs, a.steps, a.prep_in, a.pause_ms / 1e3 if a.cold else 0.0, a.by_stage)
        return
    if a.error_inputs:
        errors(a.libs, model, feeds, a.error_inputs)
        return
    from cuvil.targets.x86.loader import load
    x = next(iter(feeds.values()))
    runners = {}
    for label, path in zip(("A", "B"), a.libs):
        lib = load(path, num_threads=a.threads)
        runners[label] = lambda f, lib=lib: lib.run(x, num_threads=a.threads)
    runners.update({k: v for k, v in openvino_runners(model, a.threads).items() if "f32" not in k})
    print(f"{a.threads} thread(s)")
    try:                 # each engine's relative error against onnxruntime's float32 (max |diff| / max |ref|)
        import onnxruntime as ort
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = [np.asarray(o, np.float64) for o in sess.run(None, feeds)]
        print("rel. error vs onnxruntime fp32: " + "; ".join(f"{k} {rel_err(r(feeds), ref):.2e}" for k, r in runners.items()))
    except ImportError:
        pass
    for blk in range(a.blocks):
        p50, mn, cpu = timings(runners, feeds, a.runs, a.pause_ms)
        ov = next((k for k in runners if k.startswith("openvino")), None)
        extra = f"; B/{ov} p50 {p50['B'] / p50[ov]:.3f}" if ov else ""
        print(f"block {blk}: " + "; ".join(f"{k} p50 {p50[k]:.1f} min {mn[k]:.1f} cpu {cpu[k]:.1f}" for k in runners)
              + f"; B/A p50 {p50['B'] / p50['A']:.3f} cpu {cpu['B'] / cpu['A']:.3f}{extra}", flush=True)
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
