"""Cuvil's recurrent kernels (LSTM, GRU, RNN) on the GPU against onnxruntime on the CPU.

    python3 bench/gpu/check_recurrent.py

Each model of the list (tests/test_recurrent.py's builders: directions, both layouts, sequence lengths with
padding, initial states, peepholes, clip, input_forget, both GRU reset forms, non-default activations, one
LSTM of hidden size 128) is compiled to a bundle at several fixed (seq, batch) shapes, run on the GPU by
graph replay and eagerly (the two must agree bit for bit), and compared with onnxruntime (layout 1 through
the layout-0 model, as the test does). Prints one line per (model, shape): the normwise error
max|gpu - ref| / max|ref| over the outputs, which passes below 1e-4.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.ptx.runtime import load_bundle  # noqa: E402
from test_recurrent import _feeds, _model, _reference, _spec  # noqa: E402

CASES = [
    ("lstm_bidirectional",
     [_spec("LSTM", "bidirectional", init_h=True, init_c=True, peepholes=True, clip=2.0)], 0, True),
    ("lstm_reverse_layout1", [_spec("LSTM", "reverse", init_h=True, init_c=True, peepholes=True, input_forget=1)], 1,
     True),
    ("gru_both_resets", [_spec("GRU", "bidirectional", init_h=True, linear_before_reset=0),
                         _spec("GRU", "forward", linear_before_reset=1)], 0, True),
    ("rnn_layout1", [_spec("RNN", "bidirectional", init_h=True, activations=["Relu", "Tanh"])], 1, True),
    ("lstm_hidden128", [_spec("LSTM", "bidirectional", hidden=128)], 0, False),
]
SHAPES = [(7, 3), (1, 1), (40, 5)]


def main() -> int:
    failed = 0
    out_dir = tempfile.mkdtemp(prefix="cuvil_recurrent_")
    for name, layers, layout, lens in CASES:
        m = _model(layers, layout, lens=lens)
        names = [o.name for o in m.graph.output]
        for T, N in SHAPES:
            t0 = time.perf_counter()
            try:
                b = Pipeline.from_onnx(m).compile("nvptx64-nvidia-cuda", arch="sm_90", fixed={"T": T, "N": N},
                                                  cache=False)
                path = b.save(os.path.join(out_dir, f"{name}_{T}_{N}.cuvil"))
                feeds = _feeds(m, layout, T, N, seed=T)
                want = _reference(m, layout, feeds)
                args = [feeds[i.name] for i in m.graph.input]
                with load_bundle(path) as g:
                    got = list(g.run(*args))
                    eager = list(g.run(*args, mode="eager"))
                err = max(float(np.abs(x - want[k]).max() / (np.abs(want[k]).max() + 1e-30))
                          for x, k in zip(got, names))
                same = all(np.array_equal(a, c) for a, c in zip(got, eager))
                ok = err < 1e-4 and same
                failed += not ok
                print(f"{name:24s} T={T:<3d} N={N:<2d} rel err {err:.2e}  graph==eager {same}  "
                      f"{'ok' if ok else 'FAIL'}  {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - reported per case
                failed += 1
                traceback.print_exc()
                print(f"{name:24s} T={T:<3d} N={N:<2d} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
