"""Block copies (cuvil.targets.x86.copy) on and off, side by side in one process: two libraries of one model,
one built with the copies and one with every piece on the generic loop nest (``MIN_RUN_BYTES`` raised past any
run), 1 thread, alternating blocks, the calling thread's CPU time (steady on a loaded machine), p50; the two
outputs compared bit for bit. numpy's concatenate beside the lone Concat.

    PYTHONPATH=src python3 bench/copy_ab.py concat [--past 1023] [--blocks 9]      # present = Concat(past, new)
    PYTHONPATH=src python3 bench/copy_ab.py decode [--past 1023] [--blocks 11]     # GPT-2 124M decode step
    PYTHONPATH=src python3 bench/copy_ab.py squeezenet|inception_v1|densenet121 [--blocks 15]
    PYTHONPATH=src python3 bench/copy_ab.py decode --streams     # streamed vs cached stores of large copies

``--streams``: the two libraries are instead the block copies with cached stores (``STREAM_BYTES`` None) and
with the default, streaming stores for a stage of ``STREAM_BYTES`` or more.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from onnx import TensorProto, helper

import cuvil.targets.x86.copy as copy_mod
from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import feeds_for  # noqa: E402


def concat_model(past: int):
    g = helper.make_graph([helper.make_node("Concat", ["p", "n"], ["y"], axis=2)], "g",
                          [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 12, past, 64]),
                           helper.make_tensor_value_info("n", TensorProto.FLOAT, [1, 12, 1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12, past + 1, 64])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="concat, decode, or a CNN of cuvil.testing.models.light_model")
    ap.add_argument("--past", type=int, default=1023)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="calls per block")
    ap.add_argument("--streams", action="store_true", help="cached vs streaming stores instead of loop vs copies")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    options = {}
    if a.case == "concat":
        model = concat_model(a.past)
        feeds = [rng.standard_normal((1, 12, a.past, 64)).astype(np.float32),
                 rng.standard_normal((1, 12, 1, 64)).astype(np.float32)]
    elif a.case == "decode":
        from cuvil.testing.hf_models import gpt2_decode_model
        model = gpt2_decode_model()
        options["fixed"] = {"batch": 1, "past_sequence": a.past, "total_sequence": a.past + 1}
        named = feeds_for(model, a.past)
        feeds = [named[i.name] for i in model.graph.input]
    else:
        from cuvil.testing.models import light_model
        model = light_model(a.case)
        feeds = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32)]
    new = Pipeline.from_onnx(model).compile(cache=False, **options)
    knob, off = ("STREAM_BYTES", None) if a.streams else ("MIN_RUN_BYTES", 1 << 62)
    keep = getattr(copy_mod, knob)
    setattr(copy_mod, knob, off)
    try:
        old = Pipeline.from_onnx(model).compile(cache=False, **options)
    finally:
        setattr(copy_mod, knob, keep)
    names = ("cached stores", "streaming stores") if a.streams else ("loop nest", "block copies")
    libs = {names[0]: load(old.path, num_threads=1), names[1]: load(new.path, num_threads=1)}
    runs = {k: (lambda m=m: m.run(*feeds)) for k, m in libs.items()}
    if a.case == "concat":
        out = np.empty((1, 12, a.past + 1, 64), np.float32)
        runs["numpy"] = lambda: np.concatenate(feeds, 2, out=out)
    got = [m.run(*feeds) for m in libs.values()]
    same = all(x.tobytes() == y.tobytes() for x, y in zip(*got))
    res = {k: [] for k in runs}
    for _ in range(a.blocks):
        for k, f in runs.items():
            t = time.thread_time()
            for _ in range(a.calls):
                f()
            res[k].append((time.thread_time() - t) / a.calls * 1e3)
    med = {k: float(np.median(v)) for k, v in res.items()}
    load_avg = os.getloadavg()[0]
    print(f"CPU: {cpu_label()}; {a.case}" + (f" past {a.past}" if a.case in ("concat", "decode") else "") +
          f"; 1 thread, thread CPU ms, p50 of {a.blocks} alternating blocks of {a.calls}; load {load_avg:.1f}")
    print("  " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()) +
          f"; {names[1]} / {names[0]} {med[names[1]] / med[names[0]]:.3f}; outputs bit-identical: {same}")


if __name__ == "__main__":
    main()
