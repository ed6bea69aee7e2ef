"""Tensor cores on the GPU, correctness and timing in one call: Cuvil's mma.sync MatMul/Gemm kernels
(:mod:`cuvil.targets.ptx.matmul_mma`) and its fp16 convolutions beside torch.compile(mode="reduce-overhead").

    python3 bench/gpu/tensor_cores.py --out DIR [--parts kernels bert resnet] [--iters 100] [--layers 12]

* ``kernels``: every tensor-core kernel family (linear + bias + GELU, batched Q·Kᵀ with the transpose folded
  into the loads, Gemm(transB) + residual; :mod:`cuvil.testing.matmul_models`) in TF32, fp16 and bf16 against
  numpy (float64), normwise relative error.
* ``bert``: BERT-base (``cuvil.testing.hf_models.bert_model``, Hugging Face's graph, random weights), B = 1,
  S = 128, CUDA graph, device-resident inputs and outputs: Cuvil strict fp32, ``allow_tf32``, bf16 (every
  MatMul/Gemm node's precision set to bf16), ``enable_fp16``; each output against onnxruntime (CPU, float32).
  Beside it torch.compile(mode="reduce-overhead") of the same architecture written in torch (nn.Linear,
  LayerNorm, erf GELU, softmax attention with the additive mask; random weights, no transformers needed), in
  strict fp32, TF32 and fp16. ``--bert-variants fp32_new fp32_old`` (also tf32_*, fp16_*): an A/B of the
  row-chain kernels (LayerNorm / Softmax as one kernel per row block) and scaled MatMul operands in the loads
  against the code generator without them, both arms through ``compile_bundle`` on the same graph.
* ``resnet``: ResNet-50 (onnx's light model, BatchNormalization scales in (0.25, 0.75) so float16 stays in
  range) batch 1 and 32, Cuvil fp16 and ``allow_tf32`` beside torch.compile fp16 / TF32 of torchvision's
  resnet50.

Times: host wall clock per inference (launch + synchronize), p50 over ``--iters`` runs after warm-up.
Results as JSON in ``--out``; PyTorch is imported by this script only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resnet50 import timed as _timed  # noqa: E402

TARGET = "nvptx64-nvidia-cuda"
R: dict = {}


def timed(fn, iters: int, warmup: int = 10) -> dict:
    """resnet50.py's timer (p50/p90/p99/min ms of ``iters`` calls after ``warmup``)."""
    return _timed(fn, iters, warmup)


def normwise(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def log(*a):
    print(*a, flush=True)


# --- Cuvil ---------------------------------------------------------------------------------------------------

def cuvil_time(bundle_path, feeds, iters, streams=None, profile=True):
    """(outputs of one run, timing of graph replays with device-resident inputs/outputs, kernel profile);
    ``streams``: the runtime's (load_bundle's; None its default)."""
    from cuvil.targets.ptx.runtime import _call, driver, load_bundle
    drv = driver()
    m = load_bundle(bundle_path, streams=streams)
    ys = m.run(*feeds)
    d_in = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(x.nbytes, 1)))) for x in feeds]
    d_out = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(max(y.nbytes, 1)))) for y in ys]
    for d, x in zip(d_in, feeds):
        x = np.ascontiguousarray(x)
        _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d, x.ctypes.data, x.nbytes))
    r = timed(lambda: m.run_device(d_in, d_out, mode="graph"), iters)
    r["streams"] = m.streams
    if not profile:
        for d in d_in + d_out:
            drv.cuMemFree(d)
        m.close()
        return ys, r
    prof = m.profile_kernels(repeats=3)
    kinds: dict = {}
    for p in prof:
        k = next((q["kind"] for q in m.plan["kernels"] if q["name"] == p["name"]), "?")
        kinds[k] = kinds.get(k, 0.0) + p["ms"]
    r["kernel_sum_ms"] = sum(p["ms"] for p in prof)
    r["ms_by_kind"] = {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}
    r["top_kernels"] = [{"name": p["name"], "stage": p.get("stage"), "ms": round(p["ms"], 4)}
                        for p in sorted(prof, key=lambda p: -p["ms"])[:8]]
    # every kernel (bench/gpu/conv_kernel_flops.py joins these with the convolutions' sizes and plans)
    r["all_kernels"] = [{"name": p["name"], "stage": p.get("stage"), "ms": round(p["ms"], 5),
                         "kind": next((q["kind"] for q in m.plan["kernels"] if q["name"] == p["name"]), "?")}
                        for p in prof]
    for d in d_in + d_out:
        drv.cuMemFree(d)
    m.close()
    return ys, r


def build_model(what: str, layers: int = 12):
    """The ONNX model (and, for the matmul families, the numpy reference) a job compiles."""
    if what == "bert":
        from cuvil.testing.hf_models import bert_model
        return bert_model(layers=layers), None
    if what == "resnet50":
        from cuvil.testing import light_model
        model = light_model("resnet50", bn_scale=(0.25, 0.75))
        for vi in list(model.graph.input[:1]) + list(model.graph.output):
            vi.type.tensor_type.shape.dim[0].dim_param = "N"      # a batch symbol, fixed per compile
        from onnx import numpy_helper
        shapes = {n.input[1] for n in model.graph.node if n.op_type == "Reshape"}
        for i, t in enumerate(model.graph.initializer):     # the flatten before the classifier: [1, 2048] -> [-1, 2048]
            if t.name in shapes:
                a = numpy_helper.to_array(t).copy()
                if a.size == 2 and a[0] == 1:
                    a[0] = -1
                    model.graph.initializer[i].CopyFrom(numpy_helper.from_array(a, t.name))
        return model, None
    from cuvil.testing.matmul_models import FAMILIES
    return FAMILIES[what]()


def compile_report(path: str, manifest: dict, t0: float) -> dict:
    """A worker's report of one bundle it compiled since ``t0`` (perf_counter) and saved at ``path``."""
    return {"path": path, "compile_s": round(time.perf_counter() - t0, 1), "kernels": manifest["kernels"],
            "tensor_core_kernels": manifest.get("tensor_core_kernels"),
            "precision_counts": manifest.get("precision", {}).get("counts")}


def compile_job(job):
    """Worker: compile one (model, variant) into ``job["out"]``; returns the compile report (or the error)."""
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-tc-cache")
    try:
        from cuvil import Pipeline
        t0 = time.perf_counter()
        model, _ = build_model(job["model"], job.get("layers", 12))
        if job.get("tuning") is not None:     # code-generator settings (an A/B): compile_bundle at a static batch
            from cuvil.targets.ptx.bundle import compile_bundle
            from cuvil.targets.ptx.tuning import PtxTuning
            from cuvil.testing import with_batch
            if job["model"] == "bert":
                g = Pipeline.from_onnx(model).optimize().specialize(job["fixed"]).optimize().graph
            else:
                g = Pipeline.from_onnx(with_batch(model, job["fixed"]["N"])).optimize().graph
            man = compile_bundle(g, job["out"], arch=job["arch"], tuning=PtxTuning(**job["tuning"]),
                                 **job.get("kw", {}))
            return compile_report(job["out"], man, t0)
        p = Pipeline.from_onnx(model).optimize()
        if job.get("precision"):
            p = with_precision(p, job["precision"], job.get("ops", ("MatMul", "Gemm")))[0]
        kw = dict(job.get("kw", {}))
        if job.get("image_range"):     # the policy's input box: the image input, whatever its name
            kw["input_ranges"] = {model.graph.input[0].name: tuple(job["image_range"])}
        b = p.compile(TARGET, arch=job["arch"], cache=False, fixed=job.get("fixed"), **kw)
        b.save(job["out"])
        return compile_report(job["out"], b.manifest, t0)
    except Exception:  # noqa: BLE001 - reported by the caller
        return {"error": traceback.format_exc()[-1500:]}


VARIANTS = {"fp32": ({}, ""), "tf32": ({"allow_tf32": True}, ""), "fp16": ({"enable_fp16": True}, ""),
            "bf16": ({}, "bf16")}
# through the precision policy (Pipeline.compile(precision=..., input_ranges=...)): BERT's integer inputs declared
# over their whole ranges (token ids over the vocabulary, the mask and token types 0..1), every MatMul/Gemm whose
# inputs the policy bounds narrowed, fp8 with its power-of-two scales (issue 21, part 5); "_policy" the same for
# fp16 / bf16, the like-for-like comparison (only the products narrowed, everything else float32)
BERT_RANGES = {"input_ids": (0, 30521), "attention_mask": (0, 1), "token_type_ids": (0, 1)}
VARIANTS.update({f"{f}_policy": ({"precision": f, "input_ranges": BERT_RANGES}, "") for f in ("fp8", "fp16", "bf16")})
# ResNet-50 with float32 activations and narrowed contractions (issue 21, part 5): "_policy" what the precision
# policy certifies for images declared in RESNET_RANGE (the bench's standard-normal inputs lie inside), "_every"
# every Conv / Gemm narrowed by hand (the kernels' speed whatever the certificate allows)
RESNET_RANGE = (-8.0, 8.0)
RESNET_NARROWED = tuple(f"{f}_{how}" for f in ("fp16", "bf16") for how in ("policy", "every"))
# ResNet-50 A/B of the convolution kernels (code-generator settings, cuvil.targets.ptx.tuning.PtxTuning):
# "_old" the per-image 64 x 64 mma tiles of conv.py (fp16) / float32 SIMT tiles (tf32), "_noldm" conv_mma.py
# with 32-bit shared fragment loads instead of ldmatrix, "_noasync" without the cp.async pointwise kernel (the
# kernels of 2026-12-02), "_staged" with the shared-memory output tile, "_tap" with the tap-major reduction
# order (both off by default until measured)
TUNED = {"fp16_old": ("fp16", {"conv_mma_batch": False}), "fp16_noldm": ("fp16", {"ldmatrix": False}),
         "tf32_old": ("tf32", {"conv_mma_batch": False}),
         "fp16_tb132": ("fp16", {"target_blocks": 132}), "fp16_mb2": ("fp16", {"conv_mma_min_blocks": 2}),
         "fp16_noasync": ("fp16", {"conv_mma_async": False}),
         "fp16_staged": ("fp16", {"conv_mma_staged_out": True}), "fp16_tap": ("fp16", {"conv_mma_tap_major": True}),
         "fp16_staged_tap": ("fp16", {"conv_mma_staged_out": True, "conv_mma_tap_major": True}),
         "tf32_tap": ("tf32", {"conv_mma_tap_major": True})}
# BERT A/B, both arms through compile_bundle on the same specialised graph: "_new" the shipped settings, "_old"
# without the row-chain kernels (ptx/row_chain.py: LayerNorm / Softmax as one kernel, a block per row) and without
# scaled MatMul operands in the loads (gpu_schedule's scaled_operands), i.e. the code generator before them
TUNED.update({f"{v}_{arm}": (v, {} if arm == "new" else {"row_chains": False, "scaled_operands": False})
              for v in ("fp32", "tf32", "fp16") for arm in ("new", "old")})
# the row-chain kernels alone, each arm explicit whatever the default ("_rows" / "_norows"); with them, the
# tensor-core products' plan (plan_matmul): "_mb96" aims the tile choice at 96 blocks instead of 264 (64 x 64
# tiles where BERT's 128-row products give 96), "_ks8" allows 8 K groups (1,024-thread blocks, fp16 / bf16)
TUNED.update({f"{v}_rows": (v, {"row_chains": True}) for v in ("fp32", "tf32", "fp16")})
TUNED.update({f"{v}_norows": (v, {"row_chains": False}) for v in ("fp32", "tf32", "fp16")})
TUNED.update({f"{v}_rows_mb96": (v, {"row_chains": True, "mma_min_blocks": 96}) for v in ("tf32", "fp16")})
TUNED.update({"fp16_rows_ks8": ("fp16", {"row_chains": True, "mma_max_ks": 8})})
# split-K tensor-core products (PtxTuning.mma_sm_groups, ptx/matmul_mma.py plan_slices): "_gN" keeps N four-warp
# groups resident per SM (ptxas register cap) and splits K across blocks where the tiles are too few; "_gN_mb96"
# with the 96-block tile aim
TUNED.update({f"{v}_g{n}": (v, {"mma_sm_groups": n}) for v in ("tf32", "fp16") for n in (4, 6, 8)})
TUNED.update({f"{v}_g{n}_mb96": (v, {"mma_sm_groups": n, "mma_min_blocks": 96}) for v in ("tf32", "fp16")
              for n in (4, 8)})
# ... and "_vec": float16 operands loaded as 16-byte vectors (PtxTuning.mma_vec). Both on by default since
# session 16: "_g0" is the former products (no vectors, the plan of mma_min_blocks / mma_max_ks), explicitly
TUNED.update({"fp16_vec": ("fp16", {"mma_vec": True, "mma_sm_groups": 0})})
TUNED.update({f"fp16_g{n}_vec": ("fp16", {"mma_sm_groups": n, "mma_vec": True}) for n in (4, 8, 16)})
TUNED.update({f"{v}_g{n}": (v, {"mma_sm_groups": n, "mma_vec": False}) for v in ("tf32", "fp16") for n in (0, 4, 6, 8)})
# session 17: float16 products through cp.async stages and ldmatrix (PtxTuning.mma_async): "_asyncN" N shared
# stages per K group (the shipped split-K plan otherwise), "_g0_asyncN" without split-K; ResNet-50 takes them
# as --resnet-modes (its final Gemm is its one product)
TUNED.update({f"fp16_async{n}": ("fp16", {"mma_async": n}) for n in (2, 3, 4)})
TUNED.update({f"fp16_g0_async{n}": ("fp16", {"mma_async": n, "mma_sm_groups": 0}) for n in (2, 3)})
TUNED.update({"fp16_sync": ("fp16", {"mma_async": 0})})
# session 24: split-K products combined by their last slice (PtxTuning.mma_fused_splitk) instead of a sum kernel
TUNED.update({f"{v}_fsk": (v, {"mma_fused_splitk": True}) for v in ("tf32", "fp16")})
TUNED.update({f"{v}_cfsk": (v, {"conv_mma_fused_splitk": True}) for v in ("tf32", "fp16")})
TUNED.update({f"{v}_nofsk": (v, {"mma_fused_splitk": False}) for v in ("tf32", "fp16")})
# session 27: the products' K slices planned for 132 / C SMs only (PtxTuning.concurrency alone; convolutions and
# GEMVs keep their grids): does one BERT call gain from fewer split-K slices, as the concurrency=4 / 8 builds did?
# (H100: fp16 1.086 -> 1.037 / 1.034 ms, TF32 1.515 -> 1.717 / 1.498: both ways; bench/gpu/RESULTS.md, session 27)
TUNED.update({f"{v}_psm{c}": (v, {"concurrency": c}) for v in ("tf32", "fp16") for c in (2, 4)})
# session 38: every product at a fixed K-slice count where its chunks allow it (PtxTuning.mma_splits; 1: none):
# whole BERT-base at each count, beside bench/gpu/split_sweep.py's per-shape sweep
TUNED.update({f"{v}_sk{n}": (v, {"mma_splits": n}) for v in ("tf32", "fp16") for n in (1, 2, 3, 4, 6, 8, 12, 16, 24)})
# ... and the cp.async products' split plan of before session 38 (PtxTuning.mma_async_costs (1, 1)), for the A/B,
# and "fp16_ar{R}_as{S}": a round at R tenths of a load's latency and the sum kernel at S (whole-model checks of
# other costs than the shipped (1, 8))
TUNED.update({"fp16_syncmodel": ("fp16", {"mma_async_costs": (1.0, 1.0)})})
TUNED.update({f"fp16_ar{r}_as{a}": ("fp16", {"mma_async_costs": (r / 10, a)})
              for r in (2, 4, 7, 10, 15) for a in (2, 4, 8, 12)})

# attention as one kernel (PtxTuning.fused_attention, ptx/attention.py): "_attn" on, "_noattn" off, each explicit
TUNED.update({f"{v}_attn": (v, {"fused_attention": True}) for v in ("fp32", "tf32", "fp16")})
TUNED.update({f"{v}_noattn": (v, {"fused_attention": False}) for v in ("fp32", "tf32", "fp16")})
# session 39: float16 attention of many query rows on tensor cores (PtxTuning.attention_mma, ptx/attention_mma.py);
# "fp16_noflash": off (BERT's attention stays the scores / softmax / P.V kernels)
TUNED.update({"fp16_noflash": ("fp16", {"attention_mma": False})})
# ... and a product whose tiles fill the GPU not split (PtxTuning.mma_split_filled=False; the default splits it where
# the estimate says so)
TUNED.update({"fp16_nosplitfilled": ("fp16", {"mma_split_filled": False})})
# session 40: the attention kernels storing their rows where the heads' merge puts them (no copy kernel)
TUNED.update({"fp16_heads": ("fp16", {"attention_heads_merged": True})})


def jobs_for(args, arch):
    from cuvil.testing.matmul_models import FAMILIES
    jobs = []

    def add(key, model, variant, **extra):
        if variant in TUNED:
            variant, extra["tuning"] = TUNED[variant]
        if extra.get("tuning") is not None and VARIANTS[variant][1]:
            raise SystemExit(f"{variant}: node precisions go through Pipeline.compile, not compile_bundle")
        kw, prec = VARIANTS[variant]
        jobs.append(dict(key=key, model=model, arch=arch, kw=kw, precision=prec,
                         out=os.path.join(args.work, key + ".cuvil"), **extra))
    if "kernels" in args.parts:
        for name in FAMILIES:
            for v in ("fp32", "tf32", "fp16", "bf16"):
                add(f"{name}_{v}", name, v)
    if "bert" in args.parts:
        for v in args.bert_variants:
            add(f"bert_{v}", "bert", v, layers=args.layers, fixed={"batch": args.bert_batch, "sequence": args.seq})
    if "resnet" in args.parts:
        for bsz in args.batches:
            for v in args.resnet_modes:
                if v in RESNET_NARROWED:     # through Pipeline.compile: the precision policy, or every node by hand
                    fmt, how = v.split("_")
                    jobs.append(dict(key=f"resnet50_{v}_b{bsz}", model="resnet50", arch=arch, fixed={"N": bsz},
                                     out=os.path.join(args.work, f"resnet50_{v}_b{bsz}.cuvil"),
                                     **({"kw": {"precision": fmt}, "image_range": RESNET_RANGE} if how == "policy"
                                        else {"precision": fmt, "ops": ("Conv", "MatMul", "Gemm")})))
                    continue
                # through compile_bundle at a static batch (tuning: the shipped one or an A/B's), so the bundle
                # is the code generator's output alone (no build records)
                add(f"resnet50_{v}_b{bsz}", "resnet50", v, fixed={"N": bsz}, tuning={})
    # the longest first
    jobs.sort(key=lambda j: {"bert": 0, "resnet50": 1}.get(j["model"], 2))
    return jobs


def result_of(futures, key, timeout=600):
    r = futures[key].result(timeout=timeout)
    if "error" in r:
        raise RuntimeError(f"compile of {key} failed:\n{r['error']}")
    log(f"  cuvil {key}: compiled {r['kernels']} kernels in {r['compile_s']} s; tensor-core kernels "
        f"{r['tensor_core_kernels']}" + (f"; precision {r['precision_counts']}" if r.get('precision_counts') else ""))
    return r


def with_precision(pipeline, fmt: str, ops=("MatMul", "Gemm")):
    """A copy of the pipeline whose MatMul/Gemm nodes compute in ``fmt`` (as the precision policy marks them)."""
    from cuvil import Pipeline
    g = pipeline.graph.clone()
    n = 0
    for nd in g.nodes:
        if nd.op in ops:
            nd.precision = fmt
            n += 1
    return Pipeline(g), n


# --- parts ---------------------------------------------------------------------------------------------------

def part_kernels(args, arch, futures):
    from cuvil.targets.ptx.runtime import load_bundle
    from cuvil.testing.matmul_models import FAMILIES
    out = R.setdefault("kernels", {})
    rng = np.random.default_rng(0)
    for name, make in FAMILIES.items():
        model, ref = make()
        feeds = [rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
                 for vi in model.graph.input]
        want = ref(*feeds)
        for label in ("fp32", "tf32", "fp16", "bf16"):
            try:
                r = futures[f"{name}_{label}"].result()
                if "error" in r:
                    raise RuntimeError(r["error"])
                m = load_bundle(r["path"])
                (y,) = m.run(*feeds)
                m.close()
                e = normwise(y, want)
                out[f"{name}_{label}"] = {"normwise_vs_numpy": e, "kernels": r["tensor_core_kernels"]}
                log(f"  {name:22} {label}: normwise error vs numpy {e:.2e}; {r['tensor_core_kernels']}")
            except Exception:  # noqa: BLE001
                out[f"{name}_{label}"] = {"error": traceback.format_exc()[-1200:]}
                log(traceback.format_exc()[-1200:])


def torch_bert(hidden=768, layers=12, heads=12, ffn=3072):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            self.o = nn.Linear(hidden, hidden)
            self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
            self.f1, self.f2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

        def forward(self, x, mask):
            b, s, _ = x.shape
            dh = hidden // heads

            def split(t):
                return t.view(b, s, heads, dh).transpose(1, 2)
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / dh ** 0.5 + mask, dim=-1)
            ctx = (att @ v).transpose(1, 2).reshape(b, s, hidden)
            x = self.ln1(self.o(ctx) + x)
            return self.ln2(self.f2(F.gelu(self.f1(x))) + x)

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(30522, hidden)
            self.pos = nn.Embedding(512, hidden)
            self.typ = nn.Embedding(2, hidden)
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.pool = nn.Linear(hidden, hidden)

        def forward(self, ids, mask, types):
            s = ids.shape[1]
            x = self.ln(self.word(ids) + self.typ(types) + self.pos(torch.arange(s, device=ids.device))[None])
            m = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            for layer in self.layers:
                x = layer(x, m)
            return x, torch.tanh(self.pool(x[:, 0]))
    return Bert


def torch_compiled(net, inputs, iters, label, out):
    import torch
    import torch._dynamo
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        c = torch.compile(net, mode="reduce-overhead")
        with torch.inference_mode():
            for _ in range(5):
                c(*inputs)
            torch.cuda.synchronize()

            def run():
                c(*inputs)
                torch.cuda.synchronize()
            r = timed(run, iters)
        r["compile_s"] = round(time.perf_counter() - t0, 1)
    except Exception as e:  # noqa: BLE001 - reported
        r = {"error": f"{type(e).__name__}: {e}"[:300]}
    out[label] = r
    log(f"  torch.compile {label}: " + (f"p50 {r['p50_ms']:.3f} ms (compile {r['compile_s']} s)" if "p50_ms" in r
                                        else r["error"]))


def bert_inputs(args):
    from cuvil.testing.hf_models import bert_model, text_feeds
    model = bert_model(layers=args.layers)
    return model, text_feeds(model, args.bert_batch, args.seq)


def torch_part_bert(args):
    import torch
    out = R.setdefault("bert", {"batch": args.bert_batch, "sequence": args.seq, "layers": args.layers})
    _, feeds = bert_inputs(args)
    torch.manual_seed(0)
    net = torch_bert(layers=args.layers)().eval().cuda()
    ids = torch.from_numpy(feeds["input_ids"]).cuda()
    mask = torch.from_numpy(feeds["attention_mask"]).cuda()
    types = torch.from_numpy(feeds["token_type_ids"]).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch_compiled(net, (ids, mask, types), args.iters, "torch_compile_fp32", out)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch_compiled(net, (ids, mask, types), args.iters, "torch_compile_tf32", out)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch_compiled(net.half(), (ids, mask, types), args.iters, "torch_compile_fp16", out)


def torch_part_resnet(args):
    import torch
    import torchvision
    out = R.setdefault("resnet50", {"bn_scale": [0.25, 0.75]})
    net = torchvision.models.resnet50(weights=None).eval().cuda()
    for batch in args.batches:
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        if "fp32" in args.resnet_modes:
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            torch_compiled(net, (x,), args.iters, f"torch_compile_fp32_b{batch}", out)
        if any(m.startswith("tf32") for m in args.resnet_modes):
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch_compiled(net, (x,), args.iters, f"torch_compile_tf32_b{batch}", out)
        torch_compiled(net.half(), (x.half(),), args.iters, f"torch_compile_fp16_b{batch}", out)
        net.float()


def part_bert(args, arch, futures):
    import onnxruntime as ort
    out = R.setdefault("bert", {"batch": args.bert_batch, "sequence": args.seq, "layers": args.layers})
    model, feeds = bert_inputs(args)
    names = [vi.name for vi in model.graph.input]
    t0 = time.perf_counter()
    model.ir_version = min(model.ir_version, 10)    # onnxruntimes older than onnx read IR <= 10
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    log(f"  onnxruntime CPU reference in {time.perf_counter() - t0:.1f} s")
    for label in args.bert_variants:
        try:
            info = result_of(futures, f"bert_{label}")
            ys, r = cuvil_time(info["path"], [feeds[n] for n in names], args.iters)
            r.update(info)
            r["normwise_vs_ort"] = [normwise(y, x) for y, x in zip(ys, ref)]
            # cosine similarity of the pooled output (issue 21's BERT accuracy figure)
            pa, pb = ys[-1].astype(np.float64).ravel(), ref[-1].astype(np.float64).ravel()
            r["pooled_cosine_vs_ort"] = float(pa @ pb / (np.linalg.norm(pa) * np.linalg.norm(pb)))
            out[f"cuvil_{label}"] = r
            log(f"  cuvil {label}: graph p50 {r['p50_ms']:.3f} ms (kernel sum {r['kernel_sum_ms']:.3f}); error vs "
                f"onnxruntime {['%.1e' % e for e in r['normwise_vs_ort']]}, pooled cosine {r['pooled_cosine_vs_ort']:.6f}; by kind {r['ms_by_kind']}")
            for n in args.streams:     # the same bundle, its graph captured over n streams (1: launch order)
                ys2, r2 = cuvil_time(info["path"], [feeds[k] for k in names], args.iters, streams=n, profile=False)
                r2["same_bits"] = all(np.array_equal(a, b) for a, b in zip(ys, ys2))
                out[f"cuvil_{label}_streams{n}"] = r2
                log(f"  cuvil {label} streams={n}: graph p50 {r2['p50_ms']:.3f} ms, same bits {r2['same_bits']}")
        except Exception:  # noqa: BLE001 - the others still run
            out[f"cuvil_{label}"] = {"error": traceback.format_exc()[-1500:]}
            log(traceback.format_exc()[-1500:])
        save(args)


def part_resnet(args, arch, futures):
    import onnxruntime as ort
    out = R.setdefault("resnet50", {"bn_scale": [0.25, 0.75]})
    model, _ = build_model("resnet50")
    iname = model.graph.input[0].name
    for batch in args.batches:
        x = np.random.default_rng(1).standard_normal((batch, 3, 224, 224)).astype(np.float32)
        ref = None
        if batch <= args.ref_max_batch:
            model.ir_version = min(model.ir_version, 10)
            ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {iname: x})[0]
        for label in args.resnet_modes:
            try:
                info = result_of(futures, f"resnet50_{label}_b{batch}")
                (y,), r = cuvil_time(info["path"], [x], args.iters)
                r.update(info)
                if ref is not None:
                    r["normwise_vs_ort"] = normwise(y, ref)
                    r["top1_agree"] = float(np.mean(np.argmax(y, -1) == np.argmax(ref, -1)))
                out[f"cuvil_{label}_b{batch}"] = r
                log(f"  cuvil {label} b{batch}: graph p50 {r['p50_ms']:.3f} ms; err {r.get('normwise_vs_ort')}; "
                    f"by kind {r['ms_by_kind']}")
                for n in args.streams:
                    (y2,), r2 = cuvil_time(info["path"], [x], args.iters, streams=n, profile=False)
                    r2["same_bits"] = bool(np.array_equal(y, y2))
                    out[f"cuvil_{label}_b{batch}_streams{n}"] = r2
                    log(f"  cuvil {label} b{batch} streams={n}: graph p50 {r2['p50_ms']:.3f} ms, same bits "
                        f"{r2['same_bits']}")
            except Exception:  # noqa: BLE001
                out[f"cuvil_{label}_b{batch}"] = {"error": traceback.format_exc()[-1500:]}
                log(traceback.format_exc()[-1500:])
            save(args)


def save(args):
    with open(os.path.join(args.out, "tensor_cores.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", nargs="+", default=["kernels", "bert", "resnet"])
    ap.add_argument("--bert-variants", nargs="+", default=["fp32", "tf32", "fp16", "bf16"])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bert-batch", type=int, default=1, help="BERT-base's batch (fixed shapes)")
    ap.add_argument("--streams", type=int, nargs="*", default=[],
                    help="also time each BERT / ResNet-50 bundle with its graph captured over this many streams (load_bundle's "
                         "streams; 1: the launch order), outputs compared bit for bit with the default's")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--resnet-modes", nargs="+", default=["fp16"], help="fp16, tf32 (allow_tf32: convolutions "
                    "and the final Gemm on TF32 tensor cores), fp32; narrowed contractions, float32 activations: "
                    + ", ".join(RESNET_NARROWED) + "; A/B: " + ", ".join(TUNED))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ref-max-batch", type=int, default=32, help="ResNet-50 checked against onnxruntime (CPU) "
                    "up to this batch")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the Cuvil bundles")
    ap.add_argument("--work", default="/tmp/tensor_cores_bundles", help="where the bundles go")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    from cuvil.targets.ptx.runtime import device_info
    from cuvil.targets.x86.cpu import cpu_label
    info = device_info(0)
    R["device"] = info
    R["cpu"] = cpu_label()
    R["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"device: {info['name']} ({info['arch']}); CPU {R['cpu']}")
    rc = 0
    import concurrent.futures as cf
    import multiprocessing as mp
    jobs = jobs_for(args, info["arch"])
    pool = cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn"))
    futures = {j["key"]: pool.submit(compile_job, j) for j in jobs}
    log(f"compiling {len(jobs)} bundles in {args.jobs} processes")
    steps = []
    if not args.no_torch:
        steps += [("torch bert", torch_part_bert)] if "bert" in args.parts else []
        steps += [("torch resnet", torch_part_resnet)] if "resnet" in args.parts else []
    steps += [(p, {"kernels": part_kernels, "bert": part_bert, "resnet": part_resnet}[p]) for p in args.parts]
    for name, fn in steps:
        log(f"=== {name} ({time.strftime('%H:%M:%S')})")
        try:
            fn(args) if name.startswith("torch") else fn(args, info["arch"], futures)
        except Exception:  # noqa: BLE001 - the other parts still run
            R.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            log(traceback.format_exc()[-2000:])
            rc = 1
        save(args)
    pool.shutdown(cancel_futures=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
