"""One 3x3 convolution forced through Winograd, timed step by step at several map sizes: how the input
transform, the GEMM and the output transform scale with the map, where the transformed tensors' planes can fall
in one L1 set (M's rows are pitched there: ``cuvil.kernels.contraction.winograd_m_row``; V is stored channel-major:
``winograd_interleaved``). Checks each build against onnxruntime and 1 against 2 threads.

    PYTHONPATH=src python3 bench/winograd_alias.py --precision bf16 --tile 2 --sizes 54 56 58 [--channels 64]

Prints per size: each step's fastest time (us) over 5 rounds of 20 runs at 1 thread, the error against
onnxruntime and whether 1 and 2 threads gave the same bits. ``bf16`` narrows the convolution by hand (the CPU
needs AVX512_BF16)."""
from __future__ import annotations

import argparse

import numpy as np

from cuvil import Pipeline
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.conv_models import winograd_conv_model
from cuvil.testing.oracles import normwise_error, ort_run, random_feeds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--tile", type=int, choices=(2, 4), default=2)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[54, 56, 58])
    a = ap.parse_args(argv)
    for hw in a.sizes:
        m = winograd_conv_model(a.channels, a.channels, hw, hw, [1, 1, 1, 1], bias=True, residual=True)
        p = Pipeline.from_onnx(m).optimize()
        if a.precision == "bf16":
            for n in p.graph.nodes:
                if n.op == "Conv":
                    n.precision = "bf16"
        art = p.compile(cache=False, tuning=X86Tuning(winograd_tile=a.tile))
        model = art.model()
        f = random_feeds(m, 3)
        got = art.run(f, num_threads=1)["y"]
        same = np.array_equal(got, art.run(f, num_threads=2)["y"])
        xs = [f[d.name] for d in model.inputs]
        ts = np.array([model.profile(*xs, runs=20, num_threads=1) for _ in range(5)]).min(axis=0)
        steps = ", ".join(f"{s['kernel']} {t * 1e6:.1f}" for s, t in zip(art.manifest["steps"], ts))
        print(f"{hw}x{hw}: {steps} us; error {normwise_error(got, ort_run(m, f)):.1e}; 1 / 2 threads same bits: {same}")


if __name__ == "__main__":
    main()
