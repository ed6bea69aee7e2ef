"""Single int8 convolutions (``QLinearConv``, the shapes of ResNet-50's layers): Cuvil's AMX-INT8 tiles, its
AVX512-VNNI kernels (``X86Tuning(amx=False)``) and onnxruntime's int8, side by side in one process, one thread.

    PYTHONPATH=src python3 bench/int8_layers.py [--blocks 7] [--calls 20] [--out bench/results/int8_layers.json]

Each engine runs blocks of ``--calls`` calls in turn; the figure is the median over blocks of the CPU time per call
(process time: on a loaded machine, wall time counts the other processes' turns too), and the GOP/s it implies
(2 x multiply-adds). Cuvil's time includes packing the input's phase planes. On a CPU without AMX-INT8 the AMX
column is left out (and the VNNI one without AVX512-VNNI: the loop nests would be timed, said so).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm_int8 import has_amx_int8, has_vnni512
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.quant_models import qlinear_conv_model, quantized_feeds

LAYERS = {   # name: (input, weights, QLinearConv attributes)
    "conv1 7x7/2 3->64 224": ((1, 3, 224, 224), (64, 3, 7, 7), {"strides": (2, 2), "pads": (3, 3, 3, 3)}),
    "3x3 64->64 56": ((1, 64, 56, 56), (64, 64, 3, 3), {}),
    "1x1 64->256 56": ((1, 64, 56, 56), (256, 64, 1, 1), {"pads": (0, 0, 0, 0)}),
    "3x3/2 128->128 56": ((1, 128, 56, 56), (128, 128, 3, 3), {"strides": (2, 2)}),
    "3x3 256->256 14": ((1, 256, 14, 14), (256, 256, 3, 3), {}),
    "1x1 1024->256 14": ((1, 1024, 14, 14), (256, 1024, 1, 1), {"pads": (0, 0, 0, 0)}),
    "1x1/2 1024->2048 14": ((1, 1024, 14, 14), (2048, 1024, 1, 1), {"pads": (0, 0, 0, 0), "strides": (2, 2)}),
    "1x1 512->2048 7": ((1, 512, 7, 7), (2048, 512, 1, 1), {"pads": (0, 0, 0, 0)}),
    "3x3 512->512 7": ((1, 512, 7, 7), (512, 512, 3, 3), {}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    feats = host_cpu().features
    print(f"CPU: {cpu_label()}; load {os.getloadavg()[0]:.1f}; onnxruntime {ort.__version__}; 1 thread; "
          f"CPU time per call, median of {a.blocks} blocks of {a.calls}")
    if not has_vnni512(feats):
        print("no AVX512-VNNI here: the Cuvil column times the portable loop nests")
    rows = []
    print(f"{'layer':<22} {'Cuvil AMX':>18} {'Cuvil VNNI':>18} {'onnxruntime':>18}  AMX/ORT  AMX/VNNI")
    for name, (xs, ws, kw) in LAYERS.items():
        model = qlinear_conv_model(xs, ws, **kw)
        p = Pipeline.from_onnx(model).optimize()
        builds = {"vnni": p.compile(opt_level=3, tuning=X86Tuning(amx=False))}
        if has_amx_int8(feats):
            builds["amx"] = p.compile(opt_level=3)
        feeds = quantized_feeds(model, 0)
        x = next(iter(feeds.values()))
        libs = {k: load(art.path, num_threads=1) for k, art in builds.items()}
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        engines = {k: (lambda m=m: m.run(x)) for k, m in libs.items()}
        engines["ort"] = lambda: sess.run(None, feeds)
        out_hw = np.prod(libs["vnni"].run(x)[0].shape[2:])
        ops = 2 * int(np.prod(ws)) * int(out_hw)
        for f in engines.values():
            f()
        t = {k: [] for k in engines}
        for _ in range(a.blocks):
            for k, f in engines.items():
                c = time.process_time()
                for _ in range(a.calls):
                    f()
                t[k].append((time.process_time() - c) / a.calls)
        med = {k: float(np.median(v)) for k, v in t.items()}
        row = {"layer": name, "ops": ops, **{f"{k}_us": v * 1e6 for k, v in med.items()}}
        cell = lambda k: f"{med[k] * 1e6:7.0f} us {ops / med[k] / 1e9:5.0f} G" if k in med else f"{'-':>18}"
        ratio = lambda a_, b_: f"{med[a_] / med[b_]:7.2f}" if a_ in med and b_ in med else f"{'-':>7}"
        print(f"{name:<22} {cell('amx'):>18} {cell('vnni'):>18} {cell('ort'):>18}  {ratio('amx', 'ort')}  "
              f"{ratio('amx', 'vnni')}", flush=True)
        rows.append(row)
        for m in libs.values():
            m.close()
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump({"cpu": cpu_label(), "onnxruntime": ort.__version__, "load_end": os.getloadavg()[0],
                       "layers": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
