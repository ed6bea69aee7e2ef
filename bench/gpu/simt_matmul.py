"""Strict float32 matrix products on the GPU (:mod:`cuvil.targets.ptx.matmul_simt`, the register-tiled SIMT
kernel) beside the kernels they replace (``PtxTuning(simt_matmul=False)``: lane-split / element kernels),
correctness and per-kernel time in one call:

    python3 bench/gpu/simt_matmul.py --out DIR [--repeats 20] [--only correctness|speed] [--alternatives]

* correctness: ragged M/N/K (K not a multiple of the 16-term chunk), batch dims, transposed B (Q·Kᵀ), P·V,
  Gemm(transB) + residual, bias + erf GELU epilogue, ``fma`` on and off; each against numpy (float64,
  normwise error) and against the old kernels: bit-identical where the plan has one K group (the same fma
  chain in the same order), else the difference reported.
* speed: BERT-base's products at B = 1, S = 128 (QKV / output projection 128x768x768, FFN1 128x3072x768
  with GELU, FFN2 128x768x3072 with residual, Q·Kᵀ and P·V over 12 heads) and ResNet-50's classifier at
  batch 32 / 64: the kernel time (CUDA events, median of ``--repeats``, ``profile_kernels``) of the new and
  the old kernels, and the new kernel's TFLOP/s against the H200's float32 peak (~67 TFLOP/s); with
  ``--alternatives`` also every forced (tile, ks) of ALTERNATIVES (``PtxTuning.simt_force``), to check the
  cost model's choice.
Results as JSON in ``--out`` (simt_matmul.json).
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

from cuvil import Pipeline  # noqa: E402
from cuvil.targets.ptx.bundle import compile_bundle  # noqa: E402
from cuvil.targets.ptx.codegen import gpu_schedule  # noqa: E402
from cuvil.targets.ptx.matmul_mma import matmul_parts  # noqa: E402
from cuvil.targets.ptx.matmul_simt import describe, plan_simt  # noqa: E402
from cuvil.targets.ptx.tuning import PtxTuning  # noqa: E402
from cuvil.testing import matmul_models as mm  # noqa: E402

PEAK = 67.0
CORRECTNESS = {
    "linear_gelu_b2_40x48x272": lambda: mm.linear_gelu(2, 40, 272, 48),
    "linear_gelu_b3_37x50x17": lambda: mm.linear_gelu(3, 37, 17, 50),
    "linear_gelu_b1_130x70x3001": lambda: mm.linear_gelu(1, 130, 3001, 70),
    "linear_gelu_b1_512x512x512": lambda: mm.linear_gelu(1, 512, 512, 512),
    "qkt_b2_h3_40x40x32": lambda: mm.attention_scores(2, 3, 40, 32),
    "qkt_b1_h12_128x128x64": lambda: mm.attention_scores(1, 12, 128, 64),
    "pv_b2_h3_40x33x45": lambda: mm.batched_matmul(2, 3, 40, 45, 33),
    "gemm_transb_res_24x56x200": lambda: mm.gemm_transb_residual(24, 200, 56),
    "gemm_transb_res_100x300x1000": lambda: mm.gemm_transb_residual(100, 1000, 300),
}
SPEED = {    # name: (model, flops)
    "bert_qkv_128x768x768": (lambda: mm.linear_gelu(1, 128, 768, 768), 2 * 128 * 768 * 768),
    "bert_out_128x768x768_res": (lambda: mm.gemm_transb_residual(128, 768, 768), 2 * 128 * 768 * 768),
    "bert_ffn1_128x3072x768_gelu": (lambda: mm.linear_gelu(1, 128, 768, 3072), 2 * 128 * 3072 * 768),
    "bert_ffn2_128x768x3072_res": (lambda: mm.gemm_transb_residual(128, 3072, 768), 2 * 128 * 768 * 3072),
    "bert_qkt_h12_128x128x64": (lambda: mm.attention_scores(1, 12, 128, 64), 2 * 12 * 128 * 128 * 64),
    "bert_pv_h12_128x64x128": (lambda: mm.batched_matmul(1, 12, 128, 128, 64), 2 * 12 * 128 * 64 * 128),
    "resnet_fc_b32_32x1000x2048": (lambda: mm.gemm_transb_residual(32, 2048, 1000), 2 * 32 * 1000 * 2048),
    "resnet_fc_b64_64x1000x2048": (lambda: mm.gemm_transb_residual(64, 2048, 1000), 2 * 64 * 1000 * 2048),
}


def log(*a):
    print(*a, flush=True)


def feeds_of(model, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
            for vi in model.graph.input]


ALTERNATIVES = ((32, 32, 1), (32, 32, 2), (32, 32, 4), (32, 32, 8), (32, 64, 4), (64, 32, 4), (64, 64, 1),
                (64, 64, 2), (128, 64, 1), (16, 64, 4), (16, 64, 8), (16, 32, 4), (16, 32, 8), (32, 16, 4),
                (32, 16, 8))


def make_model(name):
    return (CORRECTNESS[name]() if name in CORRECTNESS else SPEED[name][0]())


def compile_job(job):
    """Worker: one bundle (job: key, model, simt, fma, force, path); returns its plans or the error."""
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-simt-cache")
    try:
        model, _ = make_model(job["model"])
        g = Pipeline.from_onnx(model).optimize().graph
        tuning = PtxTuning(simt_matmul=job["simt"], simt_force=tuple(job.get("force", ())), simt_tk=job.get("tk", 16))
        compile_bundle(g, job["path"], tuning=tuning, fma=job.get("fma", True))
        plans = [plan_simt(st, p, tuning.simt_force, tuning.simt_tk) for st in gpu_schedule(g).stages if (p := matmul_parts(st))]
        return {"plans": [describe(q)[0] for q in plans], "ks": [q.ks for q in plans]}
    except Exception:  # noqa: BLE001 - reported by the caller
        return {"error": traceback.format_exc()[-1500:]}


def compile_all(args, jobs):
    from concurrent.futures import ProcessPoolExecutor
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as ex:
        res = dict(zip([j["key"] for j in jobs], ex.map(compile_job, jobs)))
    log(f"compiled {len(jobs)} bundles in {time.perf_counter() - t0:.1f} s")
    return res


def run(path, feeds, repeats=0):
    from cuvil.targets.ptx.runtime import load_bundle
    m = load_bundle(path)
    try:
        ys = m.run(*feeds)
        prof = m.profile_kernels(repeats=repeats) if repeats else []
        kinds = {k["name"]: k["kind"] for k in m.plan["kernels"]}
        return ys, [dict(p, kind=kinds.get(p["name"], "?")) for p in prof]
    finally:
        m.close()


def correctness_jobs(args):
    jobs = []
    for name in CORRECTNESS:
        for fma in (True, False):
            for label, simt in (("new", True), ("old", False)):
                key = f"{name}_fma{int(fma)}_{label}"
                jobs.append(dict(key=key, model=name, simt=simt, fma=fma, path=os.path.join(args.work, key)))
    return jobs


def correctness(args, out, built):
    for name, make in CORRECTNESS.items():
        for fma in (True, False):
            key = f"{name}_fma{int(fma)}"
            try:
                for lab in ("new", "old"):
                    if "error" in built[f"{key}_{lab}"]:
                        raise RuntimeError(built[f"{key}_{lab}"]["error"])
                model, ref = make()
                feeds = feeds_of(model)
                want = ref(*feeds).astype(np.float64)
                (y,), _ = run(os.path.join(args.work, key + "_new"), feeds)
                (y0,), _ = run(os.path.join(args.work, key + "_old"), feeds)
                err = float(np.abs(y - want).max() / np.abs(want).max())
                err0 = float(np.abs(y0 - want).max() / np.abs(want).max())
                same = bool(np.array_equal(y.view(np.uint32), y0.view(np.uint32)))
                ks = built[key + "_new"]["ks"]
                r = {"plans": built[key + "_new"]["plans"], "ks": ks, "normwise_new": err, "normwise_old": err0,
                     "bit_identical_to_old": same, "max_abs_diff_vs_old": float(np.abs(y.astype(np.float64) - y0).max())}
                r["ok"] = err < 1e-5 and (same or max(ks) > 1)
                out[key] = r
                log(f"  {key:40} err {err:.2e} (old {err0:.2e}) identical {same} ks {ks} {'OK' if r['ok'] else 'FAIL'}")
            except Exception:  # noqa: BLE001
                out[key] = {"error": traceback.format_exc()[-1500:]}
                log(out[key]["error"])


def speed_jobs(args):
    jobs = []
    for name in SPEED:
        for label, simt, force in [("new", True, ()), ("old", False, ())] + \
                [("f%d_%d_%d" % f, True, f) for f in (ALTERNATIVES if args.alternatives else ())]:
            key = f"{name}_{label}"
            jobs.append(dict(key=key, model=name, simt=simt, force=force, path=os.path.join(args.work, key),
                             label=label))
        jobs.append(dict(key=f"{name}_tk32", model=name, simt=True, tk=32, path=os.path.join(args.work, name + "_tk32"),
                         label="tk32"))
    return jobs


def speed(args, out, built, jobs):
    for name, (make, flops) in SPEED.items():
        try:
            model, _ = make()
            feeds = feeds_of(model)
            r = {"flops": flops}
            for j in [j for j in jobs if j["model"] == name]:
                info = built[j["key"]]
                if "error" in info:
                    r[j["label"]] = {"error": info["error"]}
                    continue
                _, prof = run(j["path"], feeds, args.repeats)
                us = sum(p["ms"] for p in prof) * 1000
                r[j["label"]] = {"kernels": [(p["kind"], round(p["ms"] * 1000, 2)) for p in prof], "us": round(us, 2),
                                 "plans": info["plans"], "tflops": round(flops / (us * 1e-6) / 1e12, 2)}
            r["speedup"] = round(r["old"]["us"] / r["new"]["us"], 2)
            alts = {k: v["us"] for k, v in r.items() if k[:1] in "ft" and isinstance(v, dict) and "us" in v}
            if alts:
                r["best_alternative"] = min(alts, key=alts.get)
            out[name] = r
            n = r["new"]
            log(f"  {name:30} new {n['us']:8.2f} us ({n['tflops']:5.2f} TFLOP/s, {100 * n['tflops'] / PEAK:4.1f}% of "
                f"fp32 peak) old {r['old']['us']:8.2f} us x{r['speedup']} {n['plans']} {n['kernels']}")
            for k in sorted(alts, key=alts.get)[:5]:
                log(f"      {k:14} {alts[k]:8.2f} us {r[k]['plans']}")
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()[-1500:]}
            log(out[name]["error"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/simt_matmul_bundles")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", choices=["correctness", "speed"])
    ap.add_argument("--alternatives", action="store_true", help="also time every tile / ks of ALTERNATIVES")
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the bundles")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    R = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    t0 = time.perf_counter()
    cjobs = correctness_jobs(args) if args.only != "speed" else []
    sjobs = speed_jobs(args) if args.only != "correctness" else []
    built = compile_all(args, cjobs + sjobs)
    if cjobs:
        correctness(args, R.setdefault("correctness", {}), built)
    if sjobs:
        speed(args, R.setdefault("speed", {}), built, sjobs)
    R["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(args.out, "simt_matmul.json"), "w") as f:
        json.dump(R, f, indent=1)
    bad = [k for k, v in R.get("correctness", {}).items() if "error" in v or not v.get("ok")]
    log(f"done in {R['wall_s']} s; correctness failures: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
