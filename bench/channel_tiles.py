"""A/B of AVX-512's channel-lane register tiles (cuvil.kernels.contraction.choose_tile): the figures behind them.

    python3 bench/channel_tiles.py layers [--runs 20] [--tiles 3x7 4x6 2x7 4x7]   # each tile forced in turn
    python3 bench/channel_tiles.py model resnet50 [--threads 1]  # a whole model, with and without them

``layers``: the conv3x3 / conv1x1 layers of bench/x86_layers.py, direct (no Winograd), compiled once with the
position-lane tiles only ("off") and once per channel-lane tile forced wherever it is offered ("32x7" ...;
``--tiles`` as vectors x positions, e.g. 4x7, the 64x7 tile that spilled registers), printing the gemm steps'
GFLOP/s. ``model``: the model compiled with the default tile set and with channel-lane tiles and the
Winograd weight cost off (the rest of the tile cost model as it is now), alternating twice, printing
the step profiler's total and the kernels whose time changed most. Timings on a shared 2-core machine are
noisy: compare within one run.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86.tuning import DEFAULT_TUNING, X86Tuning
from cuvil.testing import light_model

from x86_layers import cases   # bench/ is the script's own directory

DEFAULT = DEFAULT_TUNING.channel_tiles


def _profile(model, runs, threads, repeats=3):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(d.shape).astype(d.dtype) for d in model.inputs]
    return np.array([model.profile(*xs, runs=runs, num_threads=threads) for _ in range(repeats)]).min(0)


def layers(a):
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles] if a.tiles else DEFAULT
    sets = {"off": ()}
    sets.update({f"{nv * 16}x{cols}": ((nv, cols),) for nv, cols in tiles})
    print(f"{'layer':32}" + "".join(f"{name:>9}" for name in sets) + "   (gemm GFLOP/s, 1 thread)")
    for kind, name, m in cases(np.random.default_rng(0)):
        if kind not in ("conv3x3", "conv1x1"):
            continue
        line = f"{name:32}"
        for tiles in sets.values():
            # a channel-lane tile weighted 0.5: forced wherever it is offered
            tuning = X86Tuning(channel_tiles=tiles, channel_tile_cost=0.5) if tiles else X86Tuning(channel_tiles=())
            art = Pipeline.from_onnx(m).optimize().compile(cache=False, winograd=False, tuning=tuning)
            t = _profile(art.model(), a.runs, a.threads)
            steps = art.manifest["steps"]
            gi = [i for i, s in enumerate(steps) if s["kernel"] == "gemm"]
            line += f"{sum(steps[i]['flops'] for i in gi) / sum(t[i] for i in gi) / 1e9:9.0f}"
        print(line, flush=True)


def model(a):
    src = light_model(a.name, seed=0)
    configs = {"off": X86Tuning(channel_tiles=(), weight_cost=0.0), "on": DEFAULT_TUNING}
    totals, groups = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for _ in range(2):
        for name, tuning in configs.items():
            art = Pipeline.from_onnx(src).optimize().compile(cache=False, tuning=tuning)
            t = _profile(art.model(), a.runs, a.threads)
            totals[name].append(t.sum())
            for s, ts in zip(art.manifest["steps"], t):
                groups[(s["kernel"], str(s["shape"]))][name].append(ts)
            print(f"{a.name} {a.threads} thread(s), channel-lane tiles {name}: {t.sum() * 1e3:.2f} ms in kernels",
                  flush=True)
    mean = {k: {n: sum(v) / 2 for n, v in g.items()} for k, g in groups.items()}
    diff = sorted(mean, key=lambda k: -abs(mean[k].get("on", 0) - mean[k].get("off", 0)))
    print(f"\n{'kernel':12} {'shape':24} {'off us':>9} {'on us':>9}")
    for k in diff[:a.top]:
        print(f"{k[0]:12} {k[1]:24} {mean[k].get('off', 0) * 1e6:9.1f} {mean[k].get('on', 0) * 1e6:9.1f}")
    print(f"\nmean: off {np.mean(totals['off']) * 1e3:.2f} ms, on {np.mean(totals['on']) * 1e3:.2f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    pl = sub.add_parser("layers")
    pl.add_argument("--tiles", nargs="+", metavar="VxP",
                    help="channel-lane tiles to force, as vectors of 16 channels x positions (default: the shipped ones)")
    pm = sub.add_parser("model")
    pm.add_argument("name", nargs="?", default="resnet50")
    pm.add_argument("--top", type=int, default=15)
    for p in (pl, pm):
        p.add_argument("--runs", type=int, default=20)
        p.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    layers(a) if a.what == "layers" else model(a)


if __name__ == "__main__":
    main()
