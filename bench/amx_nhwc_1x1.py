"""Cuvil's AMX 1x1 convolutions (channel-planar NCHW activations, the pair panels packed from the input's
channel rows) beside a plain channels-last kernel (bench/amx_nhwc_1x1.c: NHWC activations as the A tiles, loaded
in place) on the same two layers, the end of ResNet-50's stage-1 bottleneck at 56 x 56: 64 -> 256 (writing a
1.6 MB bf16 map) then 256 -> 64 (reading it), bias + ReLU, bf16 in and out, 1 thread, alternating round by round
in one process (Cuvil's chain starts with a 64 -> 64 layer, so that the measured layers read a fresh bf16
input as in the model). A measurement for the layout question of issue 21 (what channels-last activations would give
the 1x1 layers), not a peer: the C kernel has no partial panels and no residual.

    python3 bench/amx_nhwc_1x1.py [--rounds 15] [--hw 56]

Needs a CPU with AMX-BF16 and gcc. Prints the CPU model, per layer the p50 of each and the ratio."""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from onnx import TensorProto as T, helper as h, numpy_helper as nh  # noqa: E402

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.x86.cpu import cpu_label  # noqa: E402
from cuvil.targets.x86.loader import load  # noqa: E402


def chain(hw: int):
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((64, 64, 1, 1)) * 0.1).astype(np.float32)
    w1 = (rng.standard_normal((256, 64, 1, 1)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((64, 256, 1, 1)) * 0.06).astype(np.float32)
    b1, b2 = (np.arange(256) % 7 * 0.01).astype(np.float32), (np.arange(64) % 5 * 0.01).astype(np.float32)
    # a first 64 -> 64 layer makes the measured layers' input bf16 and fresh, as in the model
    g = h.make_graph([h.make_node("Conv", ["x", "w0"], ["a0"]), h.make_node("Relu", ["a0"], ["t0"]),
                      h.make_node("Conv", ["t0", "w1", "b1"], ["a"]), h.make_node("Relu", ["a"], ["t"]),
                      h.make_node("Conv", ["t", "w2", "b2"], ["c"]), h.make_node("Relu", ["c"], ["y"])], "chain",
                     [h.make_tensor_value_info("x", T.FLOAT, [1, 64, hw, hw])],
                     [h.make_tensor_value_info("y", T.FLOAT, None)],
                     [nh.from_array(w0, "w0"), nh.from_array(w1, "w1"), nh.from_array(w2, "w2"), nh.from_array(b1, "b1"), nh.from_array(b2, "b2")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--hw", type=int, default=56, help="map size (hw * hw a multiple of 32)")
    a = ap.parse_args(argv)
    P = a.hw * a.hw
    if P % 32:
        raise SystemExit(f"--hw {a.hw}: {P} positions, not a multiple of 32 (the C kernel has no partial panels)")
    here = os.path.dirname(os.path.abspath(__file__))
    tmp = tempfile.mkdtemp()
    so = os.path.join(tmp, "nhwc.so")
    subprocess.run(["gcc", "-O2", "-march=sapphirerapids", "-shared", "-fPIC", os.path.join(here, "amx_nhwc_1x1.c"),
                    "-o", so, "-lm"], check=True)
    c = ctypes.CDLL(so)
    dp = ctypes.POINTER(ctypes.c_double)
    c.nhwc_chain.argtypes = [ctypes.c_int, ctypes.c_int, dp, dp, dp]
    art = Pipeline.from_onnx(chain(a.hw)).optimize().compile(precision="bf16", input_ranges={"x": (-3, 3)}, cache=False)
    steps = art.manifest["steps"]
    assert [s.get("path") for s in steps] == ["amx_bf16"] * 3, steps
    lib = load(art.path, num_threads=1)
    x = np.random.default_rng(1).standard_normal((1, 64, a.hw, a.hw)).astype(np.float32)
    runs = 20
    ours, plain = [], []
    for r in range(a.rounds):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            if which == 0:
                ours.append(lib.profile(x, runs=runs, num_threads=1))
            else:
                t1, t2, err = (ctypes.c_double * runs)(), (ctypes.c_double * runs)(), ctypes.c_double()
                if c.nhwc_chain(P, runs, t1, t2, ctypes.byref(err)) != 0:
                    raise SystemExit("Linux refused the AMX tile state")
                if err.value > 1e-2:
                    raise SystemExit(f"the NHWC kernel disagrees with its scalar reference: {err.value:.2e}")
                plain.append([np.median(t1[:]), np.median(t2[:])])
    ours, plain = 1e3 * np.median(np.array(ours), 0)[1:], 1e3 * np.median(np.array(plain), 0)
    print(f"{cpu_label()} | load {os.getloadavg()} | {a.hw}x{a.hw}, 1 thread, p50 of {a.rounds} rounds of {runs} runs")
    print(f"{'layer':24} {'Cuvil NCHW ms':>14} {'plain NHWC ms':>14} {'NHWC / Cuvil':>13}")
    for i, name in enumerate(("1x1 64 -> 256", "1x1 256 -> 64")):
        print(f"{name:24} {ours[i]:14.3f} {plain[i]:14.3f} {plain[i] / ours[i]:13.2f}")


if __name__ == "__main__":
    main()
