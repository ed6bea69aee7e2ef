"""Fused attention on x86: a BERT-base-like encoder with the attention chain torch's torchscript exporter writes
(Q and Kt each scaled by d**-0.25, additive -inf mask from attention_mask, Softmax, Where(IsNaN), MatMul),
compiled twice from the same graph (FusedAttention on / off: ``fused_attention=``), both as ONE library for
B = 1..8, S = 1..512, timed against onnxruntime, p50 of alternating runs with an idle pause before each.

    PYTHONPATH=src python3 bench/attention.py [--layers 2] [--seqs 32,128,384] [--threads 1,2] [--runs 20]
    PYTHONPATH=src python3 bench/attention.py --save bert_base.onnx      # only write the model
    PYTHONPATH=src python3 bench/attention.py --attention-only           # the attention alone
    PYTHONPATH=src python3 bench/attention.py --decode 128,1024          # one query against past + 1 keys

``--profile``: then the time in kernels at each S (1 thread, the step profiler's mean over 5 runs) and the
fused kernel's share, with its FLOPs (4 B H S^2 D per layer: Q·Kt and P·V) as GFLOP/s and as a share of one
core's peak (``--peak-gflops``; by default 64 float32 FLOP per cycle, two AVX-512 FMA pipes, at the clock
/proc/cpuinfo reports: an assumption, printed with the figures).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.testing.oracles import ort_session

PROFILE = {"B": (1, 1, 8), "S": (1, 128, 512)}


def bert_like(layers: int = 2, hidden: int = 768, heads: int = 12, ffn: int = 3072, seed: int = 0) -> onnx.ModelProto:
    """``x[B, S, hidden]``, ``attention_mask[B, S]`` (int64, 1 = keep) -> ``y[B, S, hidden]``: post-norm BERT
    layers (erf GELU, LayerNormalization), attention as torch's scaled_dot_product_attention exports."""
    rng = np.random.default_rng(seed)
    dh = hidden // heads
    inits, nodes = [], []

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def dense(x, name, d_in, d_out):
        w = init(f"{name}_w", (rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32))
        return node("Add", [node("MatMul", [x, w], f"{name}_mm"),
                            init(f"{name}_b", (0.1 * rng.standard_normal(d_out)).astype(np.float32))], name)

    def norm(x, name):
        gamma = init(f"{name}_g", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        beta = init(f"{name}_beta", (0.1 * rng.standard_normal(hidden)).astype(np.float32))
        return node("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=1e-12)

    init("split", np.array([0, 0, heads, dh], np.int64))
    init("merge", np.array([0, 0, hidden], np.int64))
    init("root_scale", np.float32(dh ** -0.25))
    init("zero", np.float32(0))
    init("neg_inf", np.float32(-np.inf))
    init("axes", np.array([1, 2], np.int64))
    keep = node("Cast", ["attention_mask"], "keep", to=TensorProto.BOOL)
    mask = node("Where", [node("Unsqueeze", [keep, "axes"], "keep4"), "zero", "neg_inf"], "mask")
    x = "x"
    for i in range(layers):
        def heads_of(n, perm):
            return node("Transpose", [node("Reshape", [dense(x, f"l{i}_{n}", hidden, hidden), "split"], f"l{i}_{n}_h")],
                        f"l{i}_{n}_t", perm=perm)
        q = node("Mul", [heads_of("q", [0, 2, 1, 3]), "root_scale"], f"l{i}_qs")
        kt = node("Mul", [heads_of("k", [0, 2, 3, 1]), "root_scale"], f"l{i}_ks")
        v = heads_of("v", [0, 2, 1, 3])
        s = node("Add", [node("MatMul", [q, kt], f"l{i}_qk"), mask], f"l{i}_scores")
        p = node("Softmax", [s], f"l{i}_p", axis=-1)
        p = node("Where", [node("IsNaN", [p], f"l{i}_nan"), "zero", p], f"l{i}_pg")
        ctx = node("Transpose", [node("MatMul", [p, v], f"l{i}_ctx_h")], f"l{i}_ctx_t", perm=[0, 2, 1, 3])
        ctx = node("Reshape", [ctx, "merge"], f"l{i}_ctx")
        x = norm(node("Add", [x, dense(ctx, f"l{i}_o", hidden, hidden)], f"l{i}_res1"), f"l{i}_ln1")
        f = dense(x, f"l{i}_ff1", hidden, ffn)
        gelu = node("Mul", [node("Mul", [f, init(f"l{i}_half", np.float32(0.5))], f"l{i}_fh"),
                            node("Add", [node("Erf", [node("Mul", [f, init(f"l{i}_is2", np.float32(2 ** -0.5))],
                                                           f"l{i}_fs")], f"l{i}_erf"),
                                         init(f"l{i}_one", np.float32(1))], f"l{i}_f1")], f"l{i}_gelu")
        x = norm(node("Add", [x, dense(gelu, f"l{i}_ff2", ffn, hidden)], f"l{i}_res2"), f"l{i}_ln2")
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    g = helper.make_graph(nodes, "bert_like",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", hidden]),
                           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", hidden])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def attention_only(heads: int = 12, dh: int = 64, decode: bool = False) -> onnx.ModelProto:
    """One attention as the torchscript exporter writes it, over inputs ``q, k, v[B, H, S, dh]`` and
    ``attention_mask[B, S]``: the kernel alone, against the unfused ops and onnxruntime. ``decode``: one query,
    ``q[B, H, 1, dh]`` (a decode step against a KV cache of S keys)."""
    root = np.float32(dh ** -0.25)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["q", "root"], ["qs"]), helper.make_node("Mul", ["kt", "root"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["s"]),
             helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]),
             helper.make_node("Where", ["keep4", "zero", "neg_inf"], ["m"]),
             helper.make_node("Add", ["s", "m"], ["sm"]), helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["pg"]),
             helper.make_node("MatMul", ["pg", "v"], ["y"])]
    inits = [numpy_helper.from_array(root, "root"), numpy_helper.from_array(np.float32(0), "zero"),
             numpy_helper.from_array(np.float32(-np.inf), "neg_inf"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "axes")]
    rows = 1 if decode else "S"
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", heads, rows if n == "q" else "S", dh])
           for n in "qkv"]
    ins.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"]))
    g = helper.make_graph(nodes, "attention", ins,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", heads, rows, dh])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def feeds(batch: int, seq: int, hidden: int, only_attention: bool = False, decode: bool = False):
    mask = np.ones((batch, seq), np.int64)
    if not decode:
        mask[:, max(1, seq - seq // 8):] = 0       # an eighth of the keys padded
    rng = np.random.default_rng(1)
    if only_attention or decode:
        return {**{n: rng.standard_normal((batch, 12, 1 if decode and n == "q" else seq, 64)).astype(np.float32)
                   for n in "qkv"}, "attention_mask": mask}
    return {"x": rng.standard_normal((batch, seq, hidden)).astype(np.float32), "attention_mask": mask}


def p50s(runners, f, runs: int, pause_ms: float):
    for r in runners.values():
        for _ in range(2):
            r(f)
    times = {k: [] for k in runners}
    for i in range(runs):
        for k, r in (list(runners.items()) if i % 2 == 0 else list(runners.items())[::-1]):
            time.sleep(pause_ms / 1e3)
            t0 = time.perf_counter()
            r(f)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", default="32,128,384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--pause-ms", type=float, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="one core's float32 peak for --profile's %% of peak (default: 64 FLOP/cycle x cpu MHz)")
    ap.add_argument("--save", metavar="PATH")
    ap.add_argument("--attention-only", action="store_true",
                    help="one attention (12 heads of 64) over inputs q, k, v instead of the encoder")
    ap.add_argument("--decode", metavar="PASTS",
                    help="one attention of one query against past + 1 keys, for each past (e.g. 128,1024)")
    a = ap.parse_args(argv)
    decode = a.decode is not None
    model = attention_only(decode=decode) if a.attention_only or decode else bert_like(a.layers)
    if a.save:
        onnx.save(model, a.save)
        return
    hidden = 768
    p = Pipeline.from_onnx(model).optimize()
    arts = {}
    seqs = [int(s) + 1 for s in a.decode.split(",")] if decode else [int(s) for s in a.seqs.split(",")]
    profile = {"B": (1, 1, 8), "S": (1, 129, max(seqs))} if decode else PROFILE
    for name, fused in (("fused", True), ("unfused", False)):
        t0 = time.perf_counter()
        arts[name] = p.compile(shape_profiles=profile, fused_attention=fused)
        rules = sorted(arts[name].manifest["rules_applied"])
        print(f"{name}: compiled in {time.perf_counter() - t0:.0f} s, rules {rules}")
    print(f"\n| S | threads | Cuvil fused (ms) | Cuvil unfused (ms) | onnxruntime (ms) | fused/ort | unfused/ort |")
    print("|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort_session(model, so)
        models = {k: art.model() for k, art in arts.items()}
        runners = {"fused": lambda f: models["fused"].run(f, num_threads=threads),
                   "unfused": lambda f: models["unfused"].run(f, num_threads=threads),
                   "ort": lambda f: sess.run(None, f)}
        for s in seqs:
            t = p50s(runners, feeds(1, s, hidden, a.attention_only, decode), a.runs, a.pause_ms)
            print(f"| {s} | {threads} | {t['fused']:.2f} | {t['unfused']:.2f} | {t['ort']:.2f} | "
                  f"{t['fused'] / t['ort']:.2f} | {t['unfused'] / t['ort']:.2f} |", flush=True)
    if a.profile:
        from cuvil.targets.x86.cpu import cpu_label
        peak = a.peak_gflops or 64 * _cpu_mhz() / 1e3
        print(f"\n{cpu_label()}; peak assumed {peak:.0f} GFLOP/s per core"
              + ("" if a.peak_gflops else " (2 AVX-512 FMA pipes x 16 lanes x 2 FLOP at the clock /proc/cpuinfo"
                                          " reports)"))
        for s in seqs:
            for name, art in arts.items():
                sym = {"B": 1, "S": s}
                prof = art.model().profile(**feeds(1, s, hidden, a.attention_only, decode), runs=5, num_threads=1)
                steps = art.manifest["steps"]
                attn = [(st, t) for st, t in zip(steps, prof) if "FusedAttention" in st.get("op", "")]
                total = sum(prof)
                line = f"S={s} {name}: {1e3 * total:.2f} ms in kernels"
                if attn:
                    ta = sum(t for _, t in attn)     # the kernel's steps: Kt / V copies, the rows, the output
                    # a library with a profile lists its kernels twice (generic, and specialised for the opt
                    # point): only those that ran count
                    # (the sequential form's row stage, or the tiled kernel's output stage)
                    layers = sum(st["stage"].endswith(("_rows", "_out")) and t > 0 for st, t in attn)
                    flops = 4 * 12 * (1 if decode else s) * s * 64 * layers
                    line += (f"; FusedAttention {1e3 * ta:.2f} ms ({100 * ta / total:.0f}%), "
                             f"{flops / ta / 1e9:.1f} GFLOP/s ({100 * flops / ta / 1e9 / peak:.0f}% of peak)")
                print(line, sym)


def _cpu_mhz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            return max(float(line.split(":")[1]) for line in f if line.startswith("cpu MHz"))
    except (OSError, ValueError):
        return 3000.0


if __name__ == "__main__":
    main()
