"""A GPT-2 decode step with a KV cache on x86, Cuvil beside onnxruntime in one process: per token at each
past length (one library per length, batch 1, ``--fix``), 1 and 2 threads, alternating blocks; the process's
CPU time (on a shared, loaded machine the wall time counts other processes' turns) and the wall time, p50 of
the blocks, the ratio, the CPU model, and the top kernels of the step profile (1 thread) with the profile's
total summed by op and kernel kind.

    PYTHONPATH=src python3 bench/decode_step.py [--model tests/fixtures/exports/gpt2_decode.torchscript.onnx]
        [--past 128,1023] [--threads 1,2] [--calls 200] [--blocks 7] [--top 6] [--one-library] [--roofline]
        [--precision fp16 [--every | --input-range -8:8]] [--half-model]

``--precision``: Cuvil's build narrowed by the precision policy over ``--input-range`` (the past keys/values'
declared range), or with ``--every`` every constant-weight MatMul / Gemm narrowed by hand (x86 fp16: float16
weight panels, float32 sums). ``--half-model``: the model converted to float16 first (onnxconverter_common,
every tensor), both engines running that model.

``--one-library``: one library for batch 1..8, past 1..max (as bench/run_all.py --section transformer builds
it) instead of one per past length. ``--roofline``: the memory bound of a step: the bytes a token must move
(every weight read once, except the embedding tables of which one row is read; the past keys/values read and
the presents written) over this machine's bandwidth per CPU-second (a 256 MiB array streamed: read by a dot
product, copied by memcpy), and each engine's step CPU time as a multiple of that bound.

Any model with the Hugging Face decode I/O (``input_ids`` [batch, 1], ``attention_mask`` [batch,
total_sequence], ``past_key_values.{i}.key/value`` [batch, heads, past_sequence, head_size]) fits, e.g. the
full-size one of ``cuvil.testing.hf_models.gpt2_decode_model()`` (``--model gpt2-124m`` builds it). The issue's
figure in one command: ``bench/decode_step.py --model gpt2-124m --past 128,1023 --one-library --roofline``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

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
            et = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            out[i.name] = rng.standard_normal(dims).astype(et)
    return out


def step_bytes(model: onnx.ModelProto, feeds: dict, past: int) -> dict:
    """The bytes one decode step must move at ``past``: ``weights`` (every initializer read once; one row of a
    table read by Gather, e.g. the token and position embeddings), ``cache_read`` (the past keys/values),
    ``cache_write`` (the presents, one row longer), for the inputs ``feeds``."""
    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    weights = 0
    for t in model.graph.initializer:
        n = int(np.prod(t.dims)) if t.dims else 1
        item = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        weights += (n // t.dims[0] if t.name in gathered and t.dims else n) * item
    read = sum(x.nbytes for k, x in feeds.items() if k.startswith("past_key_values"))
    cache = {"read": read, "write": read * (past + 1) // past}
    return {"weights": weights, "cache_read": cache["read"], "cache_write": cache["write"]}


def bandwidth(mib: int = 256, reps: int = 5) -> dict:
    """GB per CPU-second of this machine streaming a ``mib`` MiB float32 array (larger than any cache):
    ``read`` (a dot product: the bytes read), ``copy`` (memcpy into another array: bytes read + written).
    Best of ``reps``; CPU time of the process (on a shared VM the wall time counts other processes' turns; a
    BLAS that splits the dot over threads counts each thread's time), so a step's CPU time compares with it."""
    import time
    n = mib * 2 ** 20 // 4
    a, c = np.ones(n, np.float32), np.empty(n, np.float32)
    np.copyto(c, a)
    out = {}
    for name, f, nbytes in (("read", lambda: float(np.dot(a, a)), 4 * n), ("copy", lambda: np.copyto(c, a), 8 * n)):
        best = float("inf")
        for _ in range(reps):
            t = time.process_time()
            f()
            best = min(best, time.process_time() - t)
        out[name] = nbytes / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tests/fixtures/exports/gpt2_decode.torchscript.onnx",
                    help="an ONNX decode step, or gpt2-124m: GPT-2 124M built by cuvil.testing.hf_models")
    ap.add_argument("--past", default="128,1023")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--one-library", action="store_true",
                    help="one library for batch 1..8, past 1..max (bench/run_all.py's), not one per past")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16", "auto"),
                    help="Cuvil's build: --precision (the policy, on --input-range's box) or, with --every, every "
                         "MatMul / Gemm with constant weights narrowed directly")
    ap.add_argument("--input-range", default="-8:8",
                    help="the declared range of the past keys / values (the policy's box; ids and mask as they are)")
    ap.add_argument("--every", action="store_true",
                    help="narrow every MatMul / Gemm with a constant weight to --precision, not only the certified ones")
    ap.add_argument("--half-model", action="store_true",
                    help="convert the model to float16 first (every tensor; onnxconverter_common) and run that")
    ap.add_argument("--roofline", action="store_true",
                    help="each step's memory bound (bytes per token over this core's streaming bandwidth)")
    a = ap.parse_args()
    if a.model == "gpt2-124m":     # built here (cuvil.testing.hf_models), saved for onnxruntime beside it
        import atexit
        import shutil
        import tempfile
        from cuvil.testing.hf_models import gpt2_decode_model
        tmp = tempfile.mkdtemp(prefix="decode_step-")
        atexit.register(shutil.rmtree, tmp, True)      # 650 MB of weights
        path = os.path.join(tmp, "gpt2_decode.onnx")
        onnx.save_model(gpt2_decode_model(), path, save_as_external_data=True, location="gpt2_decode.onnx.data")
        a.model = path
    model = onnx.load(a.model)
    if a.half_model:       # the model itself in float16, as users convert it (both engines run that model)
        import warnings
        from onnxconverter_common import float16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = float16.convert_float_to_float16(model, keep_io_types=False)
        a.model_bytes = model.SerializeToString()
        print("the model converted to float16 (onnxconverter_common): both engines run it")
    pasts = [int(p) for p in a.past.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    print(f"CPU: {cpu_label()}; {a.model}; per token, p50 of {a.blocks} alternating blocks of {a.calls} calls")
    bw = bandwidth() if a.roofline else {}
    if bw:
        print(f"bandwidth: read {bw['read']:.1f} GB/s, copy {bw['copy']:.1f} GB/s (256 MiB streamed, per CPU-second)")
    lo, hi = (float(v) for v in a.input_range.split(":"))
    narrow = {}
    if a.precision != "fp32" and not a.every:
        narrow = {"precision": a.precision,
                  "input_ranges": {i.name: (lo, hi) for i in model.graph.input if i.name.startswith("past_key_values")}}

    def pipeline():
        p = Pipeline.from_onnx(model)
        if a.every and a.precision != "fp32":
            p = p.optimize()
            for n in p.graph.nodes:
                if n.op in ("MatMul", "Gemm") and len(n.inputs) > 1 and n.inputs[1] is not None and n.inputs[1].is_const:
                    n.precision = a.precision
        return p

    one = None
    if a.one_library:
        top = max(pasts)
        one = pipeline().compile(shape_profiles={
            "batch": (1, 1, 8), "past_sequence": (1, min(128, top), top),
            "total_sequence": (2, min(128, top) + 1, top + 1)}, **narrow)
    for past in pasts:
        art = one or pipeline().compile(fixed={"batch": 1, "past_sequence": past,
                                               "total_sequence": past + 1}, **narrow)
        if a.precision != "fp32":
            counts = Counter(s.get("precision", "fp32") for s in art.manifest.get("steps", []) if s.get("kernel") == "gemm")
            print(f"past {past:5d} Cuvil {a.precision}{' (every constant-weight product)' if a.every else ''}: "
                  f"product steps by format {dict(counts)}; policy counts "
                  f"{art.manifest.get('precision', {}).get('counts', {})}")
        feeds = feeds_for(model, past)
        if a.roofline:
            sb = step_bytes(model, feeds, past)
            total = sum(sb.values())
            print(f"past {past:5d} bytes per token: weights {sb['weights'] / 1e6:.1f} MB, cache read "
                  f"{sb['cache_read'] / 1e6:.1f} MB, cache write {sb['cache_write'] / 1e6:.1f} MB, total "
                  f"{total / 1e6:.1f} MB")
        for th in threads:
            m = load(art.path, num_threads=th)
            xs = [feeds[d.name] for d in m.inputs]
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = th, 1
            s = ort.InferenceSession(getattr(a, "model_bytes", a.model), opts, providers=["CPUExecutionProvider"])
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
            if a.roofline:
                # the bound: the weights and the past read at the read bandwidth, the presents written
                # (a write is a read for ownership plus a write back: copy-rate bytes)
                bound = (sb["weights"] + sb["cache_read"]) / (bw["read"] * 1e9) + \
                    2 * sb["cache_write"] / (bw["copy"] * 1e9)
                print(f"    memory bound {bound * 1e6:9.1f} us: cuvil {cu[0] * 1e-6 / bound:.2f}x it, onnxruntime "
                      f"{ot[0] * 1e-6 / bound:.2f}x it (cpu time)")
            if th == 1 and a.top:
                p = m.profile(*xs, runs=max(5, a.calls // 4))
                steps = m.manifest.get("steps", [])
                total = sum(p)
                for i in sorted(range(len(p)), key=lambda i: -p[i])[:a.top]:
                    st = steps[i] if i < len(steps) else {}
                    print(f"    {100 * p[i] / total:5.1f}%  {st.get('op', '?'):<15} {st.get('kernel', '?'):<10} "
                          f"{st.get('stage', i)}")
                by_op = {}
                for i, t in enumerate(p):
                    st = steps[i] if i < len(steps) else {}
                    key = f"{st.get('op', '?')}/{st.get('kernel', '?')}"
                    by_op[key] = by_op.get(key, 0) + t
                top = sorted(by_op.items(), key=lambda kv: -kv[1])[:a.top]
                print(f"    kernels {total * 1e3:.1f} ms; by op/kernel: " +
                      ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in top))
            m.close()


if __name__ == "__main__":
    main()
