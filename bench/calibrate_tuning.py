"""Fit the x86 cost model's weights (``X86Tuning.weight_cost``, ``channel_tile_cost``) and the register tiles it
offers (``conv_tiles``, ``channel_tiles``) to the per-layer
measurements ``--tune`` left in its cache, for the CPU they were measured on: for each weight pair, the
schedule the cost model would pick on every measured layer and the time that loses against the fastest
measured candidate; prints the pairs by total time lost (issue 20: a cost model calibrated per
microarchitecture, the calibrated entry going to ``cuvil.targets.x86.tuning.CALIBRATED``).

    PYTHONPATH=src python3 bench/tune_models.py                    # fills $CUVIL_CACHE_DIR/tune
    PYTHONPATH=src python3 bench/calibrate_tuning.py [--cache DIR]

A pair whose pick on some layer is a candidate the tuner did not build (pruned: padded work over 1.3x the
least) is charged that layer's slowest measured time.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import sys

from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tune import ConvLayer, default_label, tune_cache_dir
from cuvil.targets.x86.tuning import DEFAULT_TUNING, X86Tuning

# position-lane tiles offered, as (rows, position vectors) (None: 12x2, 8x3, 6x4), and channel-lane ones
CONV_TILES = (None, ((8, 3), (6, 4)), ((12, 2), (6, 4)), ((12, 2), (8, 3)), ((6, 4),), ((8, 3),))
CHANNEL_TILES = (DEFAULT_TUNING.channel_tiles, (), ((2, 7),), ((4, 6),), ((4, 6), (2, 7)))
DESC = re.compile(r"conv (\d+)x(\d+)/(\d+)x(\d+) (\d+)->(\d+)(?: group (\d+))? (\d+)x(\d+)->(\d+)x(\d+)")


def layer_of(desc: str) -> ConvLayer:
    kh, kw, sh, sw, c, k, g, h, w, oh, ow = DESC.fullmatch(desc).groups()
    g = int(g or 1)
    attrs = (("group", g), ("strides", (int(sh), int(sw))))
    return ConvLayer((1, int(c), int(h), int(w)), (int(k), int(c) // g, int(kh), int(kw)), True, attrs,
                     (int(oh), int(ow)))


def lost(entries, tuning: X86Tuning, bits: int) -> tuple:
    """(ms lost against the fastest, layers picked right, layers) for ``tuning``'s cost model."""
    total, right = 0.0, 0
    for layer, seconds in entries:
        pick = default_label(layer, bits, tuning)
        best = min(seconds.values())
        t = seconds.get(pick, max(seconds.values()))
        total += (t - best) * 1e3
        right += t == best
    return total, right, len(entries)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=tune_cache_dir())
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    entries = {}
    for path in glob.glob(os.path.join(a.cache, "*.json")):
        with open(path, encoding="utf-8") as f:
            e = json.load(f)
        if e.get("threads", a.threads) == a.threads and "seconds" in e:
            entries[e["layer"]] = (layer_of(e["layer"]), e["seconds"])   # one per layer shape
    entries = list(entries.values())
    bits = host_cpu().vector_bits
    print(f"{cpu_label()}: {len(entries)} measured layers in {a.cache}")
    base = lost(entries, DEFAULT_TUNING, bits)
    print(f"shipped (weight_cost {DEFAULT_TUNING.weight_cost}, channel_tile_cost {DEFAULT_TUNING.channel_tile_cost}): "
          f"{base[0]:.3f} ms lost, {base[1]}/{base[2]} layers picked right")
    grid = []
    for wc, ctc, conv, chan in itertools.product((4.0, 8.0, 16.0, 24.0, 32.0, 64.0), (0.9, 1.0, 1.1, 1.2, 1.5),
                                                 CONV_TILES, CHANNEL_TILES):
        t = X86Tuning(weight_cost=wc, channel_tile_cost=ctc, conv_tiles=conv, channel_tiles=chan)
        grid.append((lost(entries, t, bits), t))
    shipped = DEFAULT_TUNING
    grid.sort(key=lambda r: (round(r[0][0], 3), -r[0][1], r[1].conv_tiles is not None,
                             r[1].channel_tiles != shipped.channel_tiles,
                             abs(r[1].weight_cost - 16) + abs(r[1].channel_tile_cost - 1.1)))
    for (ms, right, n), t in grid[:12]:
        print(f"weight_cost {t.weight_cost:5.1f} channel_tile_cost {t.channel_tile_cost:4.2f} conv_tiles "
              f"{t.conv_tiles} channel_tiles {t.channel_tiles}: {ms:.3f} ms lost, {right}/{n} right")
    for layer, seconds in entries:
        pick = default_label(layer, bits, DEFAULT_TUNING)
        best = min(seconds, key=seconds.get)
        if pick != best:
            print(f"  {layer.describe()}: shipped {pick} {seconds.get(pick, float('nan')) * 1e3:.3f} ms, "
                  f"fastest {best} {seconds[best] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
