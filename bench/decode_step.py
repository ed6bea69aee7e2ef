"""A GPT-2 decode step with a KV cache on x86, Cuvil beside onnxruntime in one process: per token at each
past length (one library per length, batch 1, ``--fix``), 1 and 2 threads, alternating blocks; the process's
CPU time (on a shared, loaded machine the wall time counts other processes' turns) and the wall time, p50 of
the blocks, the ratio, the CPU model, and the top kernels of the step profile (1 thread).

    PYTHONPATH=src python3 bench/decode_step.py [--model tests/fixtures/exports/gpt2_decode.torchscript.onnx]
        [--past 128,1024] [--threads 1,2] [--calls 200] [--blocks 7] [--top 6]

Any model with the Hugging Face decode I/O (``input_ids`` [batch, 1], ``attention_mask`` [batch,
total_sequence], ``past_key_values.{i}.key/value`` [batch, heads, past_sequence, head_size]) fits, e.g. the
full-size one of ``cuvil.testing.hf_models.gpt2_decode_model()`` saved with external data.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from call_overhead import timed  # noqa: E402  (CPU and wall seconds per call, as bench/call_overhead.py times)


def feeds_for(model: onnx.ModelProto, past: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.dim_value else {"batch": 1, "past_sequence": past,
                                                  "total_sequence": past + 1}[d.dim_param]
                for d in i.type.tensor_type.shape.dim]
        if i.name == "input_ids":
            out[i.name] = np.full(dims, 5, np.int64)
        elif i.name == "attention_mask":
            out[i.name] = np.ones(dims, np.int64)
        else:
            out[i.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/fixtures/exports/gpt2_decode.torchscript.onnx")
    ap.add_argument("--past", default="128,1024")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    model = onnx.load(a.model)
    print(f"CPU: {cpu_label()}; {a.model}; per token, p50 of {a.blocks} alternating blocks of {a.calls} calls")
    for past in (int(p) for p in a.past.split(",")):
        art = Pipeline.from_onnx(model).compile(fixed={"batch": 1, "past_sequence": past,
                                                       "total_sequence": past + 1})
        feeds = feeds_for(model, past)
        for th in (int(t) for t in a.threads.split(",")):
            m = load(art.path, num_threads=th)
            xs = [feeds[d.name] for d in m.inputs]
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = th, 1
            s = ort.InferenceSession(a.model, opts, providers=["CPUExecutionProvider"])
            ref, got = s.run(None, feeds), m.run(*xs)
            err = max(float(np.max(np.abs(r - g))) for r, g in zip(ref, got))
            res = {"cuvil": [], "ort": []}
            for _ in range(a.blocks):
                res["cuvil"].append(timed(lambda: m.run(*xs), a.calls))
                res["ort"].append(timed(lambda: s.run(None, feeds), a.calls))
            cu = np.median(np.array(res["cuvil"]), axis=0) * 1e6
            ot = np.median(np.array(res["ort"]), axis=0) * 1e6
            print(f"past {past:5d} {th} thr  cuvil cpu {cu[0]:9.1f} us wall {cu[1]:9.1f} us | onnxruntime cpu "
                  f"{ot[0]:9.1f} us wall {ot[1]:9.1f} us | ratio cpu {cu[0] / ot[0]:.2f} wall {cu[1] / ot[1]:.2f} | "
                  f"max abs diff {err:.1e}")
            if th == 1 and a.top:
                p = m.profile(*xs, runs=max(5, a.calls // 4))
                steps = m.manifest.get("steps", [])
                total = sum(p)
                for i in sorted(range(len(p)), key=lambda i: -p[i])[:a.top]:
                    st = steps[i] if i < len(steps) else {}
                    print(f"    {100 * p[i] / total:5.1f}%  {st.get('op', '?'):<15} {st.get('kernel', '?'):<10} "
                          f"{st.get('stage', i)}")
            m.close()


if __name__ == "__main__":
    main()
