"""GPT-2 (124M) decode step with a KV cache on the GPU, per token, batch 1: Cuvil's bundle (CUDA graph replay,
device-resident inputs and outputs) beside torch.compile(mode="reduce-overhead") of the same graph, in one
process (issue 20).

    python3 bench/gpu/gpt2_decode.py --out DIR [--pasts 128 1023] [--variants fp32 fp32_gemv fp16 ...] [--iters 300]
                                     [--layers 12] [--budget 280] [--no-torch]

* The model: :func:`cuvil.testing.hf_models.gpt2_decode_model` (Hugging Face's ``GPT2LMHeadModel`` decode
  step: ``input_ids`` [1, 1], ``attention_mask`` [1, P + 1], ``past_key_values.{i}.key/value`` [1, 12, P, 64]
  -> ``logits`` [1, 1, 50257] and the presents [1, 12, P + 1, 64]; seeded random weights). Cuvil compiles
  one bundle per past length P (``fixed``: batch 1, past P, total P + 1; a GPU profile bundle specialises
  every bucket point and does not pad the past, so a bundle serves only its bucket values: see RESULTS.md).
* The peer: the same graph written in torch below (LayerNorm, ``x @ W + b`` with the ONNX file's own weight
  arrays, tanh GELU, softmax attention with the additive mask, the tied LM head), the past keys/values as
  module buffers (static addresses: reduce-overhead's CUDA graph reads them in place, no copy per call, as a
  static KV cache does), ``torch.compile(mode="reduce-overhead", dynamic=False)``, one compile per past.
  Variants: fp32 (TF32 off), tf32 (``allow_tf32`` on both sides), fp16 (torch: the module and cache in half;
  Cuvil: ``enable_fp16``, float32 inputs/outputs converted in the graph); ``fp32_gemv`` / ``tf32_gemv`` /
  ``fp16_gemv``: the same with ``PtxOptions.gemv`` (the weight GEMVs on ptx/gemv.py's kernel; the default since
  session 16), ``fp32_attn`` / ``tf32_attn`` / ``fp16_attn``: with ``PtxOptions.fused_attention`` (attention as
  one kernel, ptx/attention.py; by default on in float16 only), ``fp32_noattn`` / ...: without it, explicitly, ``fp32_split`` / ...: with ``gemv=False`` (the lane-split kernels before it), Cuvil only,
  compared with the base variant's torch and Cuvil (``ratio_over_<base>``: p50 and kernel sum); list the base
  variant first (``--variants fp32 fp32_gemv fp16 fp16_gemv``). ``fp32_keysN`` / ``fp16_keysN`` (N = 0, 32, 64,
  128): the fused kernel with ``PtxTuning.attention_split_keys = N`` (flash-decoding's split; 0: none);
  ``fp32_views0`` / ``fp16_views0``: ``PtxTuning.inline_views`` off (small views stored by kernels of their own);
  ``*_stage0|1`` / ``*_merge0|1`` / ``*_vec1|4``: ``attention_stage_keys`` / ``attention_fused_merge`` /
  ``element_vec`` set, ``*_all``: the three on together. ``--rounds R``: every
  step timed again in R interleaved rounds at the end (the figures to compare variants by).
* Checked: every output of both engines against onnxruntime (CPU, float32) on the same inputs, normwise
  relative error (max |y - ref| / max |ref|), logits and presents separately.
* Times: host wall clock per token (replay/launch + synchronize), p50 of ``--iters`` after warm-up. Cuvil's
  kernels also each timed with CUDA events (``profile_kernels``); every weight-streaming GEMV and KV-cache
  kernel is given its bytes and GB/s against the H200's 4.8 TB/s, and the step's memory bound (every byte it
  must move once, at 4.8 TB/s) is printed beside both engines.

``--budget`` (seconds since start): steps that would start after it are skipped and listed. Results:
``DIR/gpt2_decode.json``. PyTorch is imported by this script only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)
from resnet50 import timed as _timed  # noqa: E402
from tensor_cores import compile_report  # noqa: E402

TARGET = "nvptx64-nvidia-cuda"
HBM_TBS = 4.8            # the H200's HBM3e bandwidth (NVIDIA's figure), TB/s
VARIANTS = {"fp32": {}, "tf32": {"allow_tf32": True}, "fp16": {"enable_fp16": True},
            # the one-row product kernel (PtxOptions.gemv, ptx/gemv.py; the default since session 16) named, and
            # the lane-split GEMVs it replaced: torch is not run again for these; their ratios are against the
            # base variant's torch and Cuvil runs
            "fp32_gemv": {"gemv": True}, "tf32_gemv": {"allow_tf32": True, "gemv": True},
            "fp16_gemv": {"enable_fp16": True, "gemv": True},
            "fp32_split": {"gemv": False}, "tf32_split": {"allow_tf32": True, "gemv": False},
            "fp16_split": {"enable_fp16": True, "gemv": False},
            # attention as one kernel (PtxOptions.fused_attention, ptx/attention.py), Cuvil only, against the base
            "fp32_attn": {"fused_attention": True}, "tf32_attn": {"allow_tf32": True, "fused_attention": True},
            "fp16_attn": {"enable_fp16": True, "fused_attention": True},
            "fp32_noattn": {"fused_attention": False}, "tf32_noattn": {"allow_tf32": True, "fused_attention": False},
            "fp16_noattn": {"enable_fp16": True, "fused_attention": False},
            # the fused kernel with its keys split over blocks at least N a split (PtxTuning.attention_split_keys;
            # 0: one block per query row, as before session 20), Cuvil only, against the base
            **{f"{base}_keys{n}": dict(opts, fused_attention=True, tuning={"attention_split_keys": n})
               for base, opts in (("fp32", {}), ("fp16", {"enable_fp16": True})) for n in (0, 32, 64, 128)},
            # the split attention's keys staged through shared memory (PtxTuning.attention_stage_keys), its merge
            # by the row's last block (attention_fused_merge), 4 elements a thread in large element stages
            # (element_vec): *_stage1 / *_merge1 / *_vec4 on, *_stage0 / *_merge0 / *_vec1 off, *_all on together (the
            # defaults since session 22), *_none off together
            **{f"{base}_{name}{int(val)}": dict(opts, tuning={field: val})
               for base, opts in (("fp32", {}), ("fp16", {"enable_fp16": True}))
               for name, field, vals in (("stage", "attention_stage_keys", (False, True)),
                                         ("merge", "attention_fused_merge", (False, True)), ("vec", "element_vec", (1, 4)))
               for val in vals},
            **{f"{base}_all": dict(opts, tuning={"attention_stage_keys": True, "attention_fused_merge": True,
                                                 "element_vec": 4})
               for base, opts in (("fp32", {}), ("fp16", {"enable_fp16": True}))},
            # ... and the three off together (the defaults before session 22)
            **{f"{base}_none": dict(opts, tuning={"attention_stage_keys": False, "attention_fused_merge": False,
                                                  "element_vec": 1})
               for base, opts in (("fp32", {}), ("fp16", {"enable_fp16": True}))},
            # small views stored by kernels of their own again (PtxTuning.inline_views off, as before session 20)
            "fp32_views0": {"tuning": {"inline_views": False}},
            "fp16_views0": {"enable_fp16": True, "tuning": {"inline_views": False}}}
R: dict = {"skipped": []}
RUNNERS: dict = {}       # (engine, variant, past) -> one timed step, for --rounds
T0 = time.perf_counter()


def log(*a):
    print(*a, flush=True)


def timed(fn, iters: int) -> dict:
    return _timed(fn, iters, 20)


def normwise(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def errors(ys, ref) -> dict:
    """Normwise error of the logits and the worst of the presents."""
    return {"logits": normwise(ys[0], ref[0]), "presents_max": max(normwise(y, r) for y, r in zip(ys[1:], ref[1:]))}


def over_budget(args, step: str) -> bool:
    if time.perf_counter() - T0 > args.budget:
        R["skipped"].append(step)
        log(f"[skipped {step}: past the --budget of {args.budget} s]")
        return True
    return False


def save(args):
    with open(os.path.join(args.out, "gpt2_decode.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)


# --- Cuvil ---------------------------------------------------------------------------------------------------

def compile_job(job):
    """Worker: one bundle (variant, past) into ``job["out"]``; its compile report or the error."""
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-gpt2-cache")
    try:
        from cuvil import Pipeline
        from cuvil.testing.hf_models import gpt2_decode_model
        t0 = time.perf_counter()
        p = Pipeline.from_onnx(gpt2_decode_model(layers=job["layers"])).optimize()
        past = job["past"]
        opts = dict(VARIANTS[job["variant"]])
        with tuning_override(opts.pop("tuning", None)):
            b = p.compile(TARGET, arch=job["arch"], cache=False, fixed={"batch": 1, "past_sequence": past,
                                                                         "total_sequence": past + 1}, **opts)
        b.save(job["out"])
        return compile_report(job["out"], b.manifest, t0)
    except Exception:  # noqa: BLE001 - reported by the caller
        return {"error": traceback.format_exc()[-1500:]}


class tuning_override:
    """``PtxOptions.tuning`` with these PtxTuning fields changed, for one build in this worker process (a kernel
    setting that PtxOptions does not expose; restored on exit: the pool reuses its workers)."""

    def __init__(self, fields):
        self.fields = fields

    def __enter__(self):
        if self.fields:
            import attrs
            from cuvil.targets.ptx.target import PtxOptions
            self.saved = PtxOptions.tuning
            PtxOptions.tuning = property(lambda o, f=self.fields, t=self.saved: attrs.evolve(t.fget(o), **f))

    def __exit__(self, *exc):
        if self.fields:
            from cuvil.targets.ptx.target import PtxOptions
            PtxOptions.tuning = self.saved


def step_bytes(weights: dict, layers: int, past: int, itemsize: int) -> dict:
    """What one token must move at least: every weight once (the embeddings: one row each; the tied LM head's
    transposed copy whole), the past keys/values read once and the presents written once (float32 I/O)."""
    dense = sum(a.size for n, a in weights.items() if n.endswith(".weight") and (".attn.c_" in n or ".mlp.c_" in n))
    bias_norm = sum(a.size for n, a in weights.items() if n.endswith(".bias") or ".ln_" in n)
    lm = weights["lm_head.weight_t"].size
    cache = 2 * layers * past * 768 * 4
    return {"weights": (dense + lm + bias_norm) * itemsize, "cache_read": cache,
            "cache_write": cache * (past + 1) // past}


def kernel_bytes(stage: str, kind: str, weights: dict, past: int, itemsize: int):
    """Bytes a kernel must move (its weight matrix, or the KV-cache rows it reads / writes), where known:
    ``itemsize`` is the weights' and the cache's inside the graph (2 with enable_fp16: the fp32 past is
    converted on the way in, the presents on the way out)."""
    row = 768          # one cache row of a layer: 12 heads x 64
    names = {".attn.c_attn": ".attn.c_attn.weight", ".res1": ".attn.c_proj.weight", ".gelu": ".mlp.c_fc.weight",
             ".res2": ".mlp.c_proj.weight"}
    if kind in ("split", "gemv") and stage in ("logits", "logits_to_float"):
        return weights["lm_head.weight_t"].size * itemsize, "lm_head GEMV"
    if kind == "attention":        # the fused kernel (ptx/attention.py): the layer's K and V rows, once, in
        # float32 (the float16 pass keeps the cache float32 since session 20: precision.state_nodes)
        return 2 * (past + 1) * row * 4, "attention: fused kernel, K and V read"
    if stage.startswith("transformer.h."):
        layer = ".".join(stage.split(".")[:3])
        for suffix, w in names.items():
            if kind in ("split", "gemv") and (stage.endswith(suffix) or stage.endswith(suffix + "_f32")):
                return weights[layer + w].size * itemsize, w.strip(".").replace(".weight", "") + " GEMV"
        if stage.endswith(".sdpa.scores") or stage.endswith(".sdpa.ctx"):
            return (past + 1) * row * itemsize, "attention: K or V read"
    if stage.startswith("present.") and stage.endswith("_f16"):     # unfused float16: the products' half copy
        return (past + 1) * row * (4 + 2), "presents fp32 -> fp16"
    if stage.startswith("present.") and stage.endswith("_to_float"):
        return (past + 1) * row * (2 + 4), "presents fp16 -> fp32"
    if stage.startswith("present."):
        return (2 * past + 1) * row * 4, "concat past + new (read P, write P + 1 rows)"
    if stage.startswith("past_key_values.") and stage.endswith("_f16"):
        return past * row * (4 + 2), "past fp32 -> fp16"
    return None, ""


def cuvil_part(args, info, feeds, names, ref, weights, variant, past):
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    key = f"{variant}_p{past}"
    r = args.futures[key].result(timeout=600)
    if "error" in r:
        raise RuntimeError(f"compile of {key} failed:\n{r['error']}")
    log(f"  cuvil {key}: {r['kernels']} kernels, compiled in {r['compile_s']} s")
    drv = driver()
    m = load_bundle(r["path"])
    xs = [feeds[n] for n in names]
    ys = m.run(*xs)
    r["error_vs_ort"] = errors(ys, ref)
    d_in = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(x.nbytes, 1)))) for x in xs]
    d_out = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(y.nbytes, 1)))) for y in ys]
    for d, x in zip(d_in, xs):
        x = np.ascontiguousarray(x)
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d, x.ctypes.data, x.nbytes))
    r.update(timed(lambda: m.run_device(d_in, d_out, mode="graph"), args.iters))
    RUNNERS[("cuvil", variant, past)] = lambda: m.run_device(d_in, d_out, mode="graph")     # --rounds
    prof = m.profile_kernels(repeats=5)
    kind_of = {q["name"]: q["kind"] for q in m.plan["kernels"]}
    itemsize = 2 if variant.split("_")[0] == "fp16" else 4
    rows, by_kind, by_what = [], {}, {}
    for p in prof:
        kind = kind_of.get(p["name"], "?")
        b, what = kernel_bytes(p.get("stage") or "", kind, weights, past, itemsize)
        by_kind[kind] = by_kind.get(kind, 0.0) + p["ms"]
        group = what or kind + " (other)"
        g = by_what.setdefault(group, {"n": 0, "ms": 0.0, "bytes": 0})
        g["n"] += 1
        g["ms"] += p["ms"]
        g["bytes"] += b or 0
        rows.append({"name": p["name"], "stage": p.get("stage"), "kind": kind, "ms": round(p["ms"], 5),
                     "bytes": b, "gbs": round(b / p["ms"] / 1e6, 1) if b and p["ms"] > 0 else None})
    for g in by_what.values():
        g["ms"] = round(g["ms"], 4)
        g["gbs"] = round(g["bytes"] / g["ms"] / 1e6, 1) if g["bytes"] and g["ms"] else None
        g["of_hbm"] = round(g["gbs"] / (HBM_TBS * 1e3), 3) if g["gbs"] else None
    r["kernel_sum_ms"] = round(sum(p["ms"] for p in prof), 4)
    r["kernels_launched"] = len(prof)
    r["ms_by_kind"] = {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    r["by_what"] = dict(sorted(by_what.items(), key=lambda kv: -kv[1]["ms"]))
    r["all_kernels"] = rows
    if getattr(args, "rounds", 0):      # kept open for the interleaved rounds (closed after them)
        OPEN.append((m, d_in + d_out))
    else:
        for d in d_in + d_out:
            drv.cuMemFree(d)
        m.close()
    log(f"  cuvil {key}: graph p50 {r['p50_ms']:.4f} ms (kernel sum {r['kernel_sum_ms']:.4f} ms, "
        f"{len(prof)} kernels); error vs onnxruntime {r['error_vs_ort']}")
    for k, g in list(r["by_what"].items())[:8]:
        log(f"      {k:<44} {g['n']:4d} kernels {g['ms']:.4f} ms" +
            (f"  {g['bytes'] / 1e6:8.1f} MB  {g['gbs']:7.1f} GB/s ({100 * g['of_hbm']:.0f}% of 4.8 TB/s)"
             if g["gbs"] else ""))
    return r


# --- torch peer ----------------------------------------------------------------------------------------------

def torch_gpt2(weights: dict, layers: int, past_kv: list):
    """The decode step of hf_models.gpt2_decode_model in torch, on its own weight arrays; the past as
    buffers (static addresses)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    heads, hidden = 12, 768
    dh = hidden // heads

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            for n, a in weights.items():
                if a.dtype == np.float32:
                    self.register_buffer(n.replace(".", "__"), torch.from_numpy(a))
            for i, t in enumerate(past_kv):
                self.register_buffer(f"past{i}", torch.from_numpy(t))
            self.past = past_kv[0].shape[2]

        def w(self, n):
            return getattr(self, n.replace(".", "__"))

        def forward(self, ids, mask):
            P = self.past
            x = self.w("transformer.wte.weight")[ids] + self.w("transformer.wpe.weight")[P]
            add = torch.where(mask[:, None, None, :P + 1].bool(), 0.0, float("-inf")).to(x.dtype)
            presents = []
            for i in range(layers):
                p = f"transformer.h.{i}"
                h = F.layer_norm(x, (hidden,), self.w(f"{p}.ln_1.weight"), self.w(f"{p}.ln_1.bias"), 1e-5)
                qkv = h @ self.w(f"{p}.attn.c_attn.weight") + self.w(f"{p}.attn.c_attn.bias")
                q, k, v = (t.view(1, 1, heads, dh).transpose(1, 2) for t in qkv.split(hidden, -1))
                k = torch.cat([getattr(self, f"past{2 * i}"), k], 2)
                v = torch.cat([getattr(self, f"past{2 * i + 1}"), v], 2)
                presents += [k, v]
                att = torch.softmax(q @ k.transpose(-1, -2) * dh ** -0.5 + add, -1)
                ctx = (att @ v).transpose(1, 2).reshape(1, 1, hidden)
                x = x + ctx @ self.w(f"{p}.attn.c_proj.weight") + self.w(f"{p}.attn.c_proj.bias")
                h = F.layer_norm(x, (hidden,), self.w(f"{p}.ln_2.weight"), self.w(f"{p}.ln_2.bias"), 1e-5)
                f = F.gelu(h @ self.w(f"{p}.mlp.c_fc.weight") + self.w(f"{p}.mlp.c_fc.bias"), approximate="tanh")
                x = x + f @ self.w(f"{p}.mlp.c_proj.weight") + self.w(f"{p}.mlp.c_proj.bias")
            x = F.layer_norm(x, (hidden,), self.w("transformer.ln_f.weight"), self.w("transformer.ln_f.bias"), 1e-5)
            return (x @ self.w("lm_head.weight_t"), *presents)
    return Step()


def torch_part(args, feeds, names, ref, weights, variant, past):
    import torch
    import torch._dynamo
    if not args.rounds:     # (with --rounds every compiled step stays alive for the interleaved timing)
        torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = variant == "tf32"
    torch.backends.cudnn.allow_tf32 = variant == "tf32"
    dt = torch.float16 if variant == "fp16" else torch.float32
    past_kv = [feeds[n] for n in names if n.startswith("past_key_values")]
    net = torch_gpt2(weights, args.layers, past_kv).cuda().to(dt).eval()
    for b in net.buffers():          # static addresses: the CUDA graph reads weights and cache in place
        torch._dynamo.mark_static_address(b)
    ids = torch.from_numpy(feeds["input_ids"]).cuda()
    mask = torch.from_numpy(feeds["attention_mask"]).cuda()
    t0 = time.perf_counter()
    c = torch.compile(net, mode="reduce-overhead", dynamic=False)
    with torch.inference_mode():
        for _ in range(5):
            ys = c(ids, mask)
        torch.cuda.synchronize()
        r = {"compile_s": round(time.perf_counter() - t0, 1),
             "error_vs_ort": errors([y.float().cpu().numpy() for y in ys], ref)}

        def run():
            c(ids, mask)
            torch.cuda.synchronize()
        r.update(timed(run, args.iters))
    if args.rounds:
        def inference_run(run=run):
            with torch.inference_mode():
                run()
        RUNNERS[("torch", variant, past)] = inference_run
    r["torch"] = torch.__version__
    log(f"  torch.compile {variant}_p{past}: p50 {r['p50_ms']:.4f} ms (compile {r['compile_s']} s); error vs "
        f"onnxruntime {r['error_vs_ort']}")
    return r


#: the Cuvil models (and their device buffers) the interleaved rounds still run: closed after them
OPEN = []


def close_open() -> None:
    from cuvil.targets.ptx.runtime import driver
    drv = driver()
    while OPEN:
        m, bufs = OPEN.pop()
        for d in bufs:
            drv.cuMemFree(d)
        m.close()


def interleaved(args) -> None:
    """Every kept step (Cuvil's graphs, torch.compile's) timed again in ``args.rounds`` rounds, the order rotated
    each round; per step the median of its rounds' p50s (``R[key][engine]["p50_interleaved_ms"]``) and, per past,
    each Cuvil variant over the torch.compile of its base."""
    keys = sorted(RUNNERS, key=str)
    per = max(20, args.iters // args.rounds)
    got = {k: [] for k in keys}
    log(f"=== interleaved: {len(keys)} steps, {args.rounds} rounds of {per} ({time.perf_counter() - T0:.0f} s)")
    for rnd in range(args.rounds):
        for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
            try:
                got[k].append(_timed(RUNNERS[k], per, 3)["p50_ms"])
            except Exception:  # noqa: BLE001 - reported, the others still run
                log(f"  {k}: {traceback.format_exc()[-300:]}")
    for (eng, variant, past), ts in got.items():
        if ts:
            R.setdefault(f"{variant}_p{past}", {}).setdefault(eng, {})["p50_interleaved_ms"] = round(
                statistics.median(ts), 4)
    for (eng, variant, past), ts in sorted(got.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        if not ts or eng != "cuvil":
            continue
        t = statistics.median(ts)
        peer = got.get(("torch", variant.split("_")[0], past)) or []
        ratio = f", / torch.compile {t / statistics.median(peer):.3f}" if peer else ""
        log(f"  interleaved {variant} past {past}: cuvil {t:.4f} ms{ratio}  (rounds {min(ts):.4f}-{max(ts):.4f})")
    for (eng, variant, past), ts in got.items():
        if ts and eng == "torch":
            log(f"  interleaved torch.compile {variant} past {past}: {statistics.median(ts):.4f} ms")
    save(args)


# --- main ----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pasts", type=int, nargs="+", default=[128, 1023])
    ap.add_argument("--variants", nargs="+", default=["fp32", "fp16", "tf32"], choices=list(VARIANTS))
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--budget", type=float, default=280)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after the per-variant runs, time every engine and variant again in this many interleaved "
                         "rounds (order rotated each round) of --iters / rounds steps: the median of the rounds' "
                         "p50s, robust to the drift between blocks run minutes apart")
    ap.add_argument("--jobs", type=int, default=6, help="processes compiling the Cuvil bundles")
    ap.add_argument("--work", default="/tmp/gpt2_decode_bundles")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    import concurrent.futures as cf
    import multiprocessing as mp
    from cuvil.targets.ptx.runtime import device_info
    from cuvil.targets.x86.cpu import cpu_label
    info = device_info(0)
    R.update(device=info, cpu=cpu_label(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             layers=args.layers, iters=args.iters, batch=1)
    log(f"device: {info['name']} ({info['arch']}); CPU {R['cpu']}")
    jobs = [dict(variant=v, past=p, layers=args.layers, arch=info["arch"],
                 out=os.path.join(args.work, f"{v}_p{p}.cuvil")) for v in args.variants for p in args.pasts]
    pool = cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn"))
    args.futures = {f"{j['variant']}_p{j['past']}": pool.submit(compile_job, j) for j in jobs}
    log(f"compiling {len(jobs)} bundles in {args.jobs} processes")

    import onnxruntime as ort
    from onnx import numpy_helper
    from cuvil.testing.hf_models import gpt2_decode_model, text_feeds
    model = gpt2_decode_model(layers=args.layers)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = [vi.name for vi in model.graph.input]
    t0 = time.perf_counter()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    cases = {}
    for past in args.pasts:
        feeds = text_feeds(model, 1, past)
        cases[past] = (feeds, sess.run(None, feeds))
        sb = step_bytes(weights, args.layers, past, 4)
        R.setdefault("bound", {})[str(past)] = {**sb, "bound_ms_fp32": round(sum(sb.values()) / HBM_TBS / 1e9, 4)}
        log(f"past {past}: bytes per token: weights {sb['weights'] / 1e6:.1f} MB, cache read "
            f"{sb['cache_read'] / 1e6:.1f} MB, write {sb['cache_write'] / 1e6:.1f} MB: at {HBM_TBS} TB/s "
            f"{R['bound'][str(past)]['bound_ms_fp32'] * 1e3:.1f} us (fp32)")
    log(f"onnxruntime CPU references in {time.perf_counter() - t0:.1f} s")
    del sess, model
    rc = 0
    for variant in args.variants:
        for past in args.pasts:
            feeds, ref = cases[past]
            out = R.setdefault(f"{variant}_p{past}", {})
            base = variant.split("_")[0]
            for eng in (("torch",) if not args.no_torch and base == variant else ()) + ("cuvil",):
                if over_budget(args, f"{eng} {variant} p{past}"):
                    continue
                log(f"=== {eng} {variant} past {past} ({time.perf_counter() - T0:.0f} s)")
                try:
                    out[eng] = (torch_part(args, feeds, names, ref, weights, variant, past) if eng == "torch" else
                                cuvil_part(args, info, feeds, names, ref, weights, variant, past))
                except Exception:  # noqa: BLE001 - the other steps still run
                    out[eng] = {"error": traceback.format_exc()[-2000:]}
                    log(out[eng]["error"])
                    rc = 1
                save(args)
            ref_out = R.get(f"{base}_p{past}", {})
            if "p50_ms" in out.get("cuvil", {}) and "p50_ms" in ref_out.get("torch", {}):
                out["ratio_cuvil_over_torch"] = round(out["cuvil"]["p50_ms"] / ref_out["torch"]["p50_ms"], 3)
                log(f"  {variant} past {past}: cuvil / torch.compile = {out['ratio_cuvil_over_torch']:.3f}")
            if base != variant and "p50_ms" in out.get("cuvil", {}) and "p50_ms" in ref_out.get("cuvil", {}):
                c, c0 = out["cuvil"], ref_out["cuvil"]
                out["ratio_over_" + base] = {"p50": round(c["p50_ms"] / c0["p50_ms"], 3),
                                             "kernel_sum": round(c["kernel_sum_ms"] / c0["kernel_sum_ms"], 3)}
                log(f"  {variant} past {past}: cuvil / cuvil {base} = {out['ratio_over_' + base]}")
            save(args)
    pool.shutdown(cancel_futures=True)
    if args.rounds and RUNNERS:
        interleaved(args)
    close_open()
    log("summary (p50 ms per token): " + json.dumps({k: {e: v.get(e, {}).get("p50_ms") for e in ("cuvil", "torch")}
                                                     for k, v in R.items() if k.startswith(tuple(VARIANTS))}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
