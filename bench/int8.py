"""Quantized ResNet-50 (issue 21, part 4): Cuvil int8 vs onnxruntime int8 (the same QDQ model) vs Cuvil fp32,
side by side in one process, 1 and 2 threads; and the int8 model's top-1 / top-5 agreement with fp32. On a CPU
with AMX-INT8 a fourth column: Cuvil int8 on the AVX512-VNNI kernels (``X86Tuning(amx=False)``), beside the
default AMX tiles.

    PYTHONPATH=src python3 bench/int8.py                        # latency, 1 and 2 threads
    PYTHONPATH=src python3 bench/int8.py --accuracy 1000        # + agreement on 1000 real images
    PYTHONPATH=src taskset -c 0,1 python3 bench/int8.py --out bench/results/int8.json

The model: onnx's light ResNet-50 (the real architecture, seeded random weights, as ``cuvil zoo`` has it)
quantized by onnxruntime's ``quantize_static`` (QDQ format, per-channel int8 weights, uint8 activations: its
defaults), calibrated on 16 inputs (the real images of bench/precision_accuracy.py where it and scikit-image
are there, else seeded random ones; the script says which). Latency: batch 1, interleaved blocks of calls of each
engine, the median per call (wall and CPU time); ratios are Cuvil int8 over onnxruntime int8 (the goal: <= 0.8)
and over Cuvil fp32. Accuracy (``--accuracy N``): the crops of bench/precision_accuracy.py (range's bench; N
seeded crops of the photos that ship in scikit-image), Cuvil int8 against Cuvil fp32 (top-1 / top-5 agreement,
relative error of the logits), onnxruntime int8 against its fp32 beside it, and Cuvil int8 against
onnxruntime int8 in output quantization steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort

from cuvil import Pipeline, load
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.gemm_int8 import has_amx_int8
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing import light_model
from cuvil.testing.quant_models import output_step, qdq_model, random_feeds

HERE = os.path.dirname(os.path.abspath(__file__))


def real_images(n: int, seed: int):
    """(array [n, 3, 224, 224], source) from bench/precision_accuracy.py's crops, or None with the reason."""
    sys.path.insert(0, HERE)
    try:
        from precision_accuracy import image_inputs
        return image_inputs(n, seed)[0], "photos of scikit-image (bench/precision_accuracy.py crops)"
    except ImportError as e:
        return None, f"no real images ({e}); seeded standard-normal inputs"


def timed(f, calls: int):
    c, t = time.process_time(), time.perf_counter()
    for _ in range(calls):
        f()
    return (time.process_time() - c) / calls, (time.perf_counter() - t) / calls


def ort_session(model, threads: int):
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def topk_agree(ref: np.ndarray, got: np.ndarray, k: int) -> float:
    top = np.argsort(-ref, axis=1)[:, :k]
    return float(np.mean([g.argmax() in t for g, t in zip(got, top)])) if k > 1 else \
        float(np.mean(ref.argmax(1) == got.argmax(1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--calls", type=int, default=5, help="calls per block")
    ap.add_argument("--blocks", type=int, default=5, help="interleaved blocks per engine")
    ap.add_argument("--accuracy", type=int, default=0, metavar="N", help="agreement on N inputs (0: skip)")
    ap.add_argument("--calibration", type=int, default=16, help="calibration inputs for quantize_static")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    f32 = light_model("resnet50")
    name = f32.graph.input[0].name
    cal, source = real_images(a.calibration, seed=12345)
    calib = [{name: x[None]} for x in cal] if cal is not None else random_feeds(f32, 1, a.calibration)
    t0 = time.perf_counter()
    q8 = qdq_model(f32, calib)
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    art8 = Pipeline.from_onnx(q8).optimize().compile(opt_level=3)
    t_c8 = time.perf_counter() - t0
    art32 = Pipeline.from_onnx(f32).optimize().compile(opt_level=3)
    # on an AMX host, the VNNI kernels beside the tiles (same bits, tests/test_int8.py)
    art8v = (Pipeline.from_onnx(q8).optimize().compile(opt_level=3, tuning=X86Tuning(amx=False))
             if has_amx_int8(host_cpu().features) else None)
    kinds = sorted({s["kernel"] for s in art8.manifest["steps"]})
    print(f"CPU: {cpu_label()}")
    print(f"model: light ResNet-50, QDQ by onnxruntime {ort.__version__} quantize_static (per-channel, calibrated on "
          f"{len(calib)} inputs: {source}); quantized in {t_quant:.1f} s, Cuvil int8 compiled in {t_c8:.1f} s")
    paths = sorted({s["path"] for s in art8.manifest["steps"] if s.get("precision") == "int8"})
    print(f"Cuvil int8 kernels: {', '.join(kinds)} (int8 paths: {', '.join(paths) or 'none'}); fusions: "
          + ", ".join(f"{k} x{v['applied']}" for k, v in art8.manifest["rules_applied"].items() if k.startswith("qdq")))
    x = (cal[0][None] if cal is not None else random_feeds(f32, 2, 1)[0][name])
    res = {"cpu": cpu_label(), "onnxruntime": ort.__version__, "kernels": kinds, "int8_paths": paths, "latency": [],
           "source": source, "load_before": os.getloadavg()[0]}
    vcol = f" | {'Cuvil int8 VNNI':>15}" if art8v is not None else ""
    print(f"\n{'threads':>7} | {'Cuvil int8':>11} | {'ORT int8':>9} | {'Cuvil fp32':>10}{vcol} | int8 / ORT int8 | "
          f"int8 / Cuvil fp32   (ms per call, median wall; CPU time in brackets)")
    for th in a.threads:
        m8, m32 = load(art8.path, num_threads=th), load(art32.path, num_threads=th)
        s8 = ort_session(q8, th)
        engines = {"cuvil_int8": lambda: m8.run(x), "ort_int8": lambda: s8.run(None, {name: x}),
                   "cuvil_fp32": lambda: m32.run(x)}
        m8v = load(art8v.path, num_threads=th) if art8v is not None else None
        if m8v is not None:
            engines["cuvil_int8_vnni"] = lambda: m8v.run(x)
        for f in engines.values():
            f()
        t = {k: [] for k in engines}
        for _ in range(a.blocks):
            for k, f in engines.items():
                t[k].append(timed(f, a.calls))
        med = {k: np.median(np.array(v), axis=0) * 1e3 for k, v in t.items()}   # (cpu, wall) ms
        row = {"threads": th, **{k: {"wall_ms": float(v[1]), "cpu_ms": float(v[0])} for k, v in med.items()},
               "ratio_vs_ort_int8": float(med["cuvil_int8"][1] / med["ort_int8"][1]),
               "ratio_vs_cuvil_fp32": float(med["cuvil_int8"][1] / med["cuvil_fp32"][1]),
               "cpu_ratio_vs_ort_int8": float(med["cuvil_int8"][0] / med["ort_int8"][0]), "load": os.getloadavg()[0]}
        res["latency"].append(row)
        vnni = (f" | {med['cuvil_int8_vnni'][1]:6.2f} ({med['cuvil_int8_vnni'][0]:5.1f})"
                if "cuvil_int8_vnni" in med else "")
        print(f"{th:>7} | {med['cuvil_int8'][1]:6.2f} ({med['cuvil_int8'][0]:5.1f}) | {med['ort_int8'][1]:5.2f} "
              f"({med['ort_int8'][0]:5.1f}) | {med['cuvil_fp32'][1]:6.2f} ({med['cuvil_fp32'][0]:5.1f}){vnni} | "
              f"{row['ratio_vs_ort_int8']:15.2f} | {row['ratio_vs_cuvil_fp32']:.2f}   (load {row['load']:.1f})")
        m8.close(), m32.close()
        if m8v is not None:
            m8v.close()

    if a.accuracy:
        xs, src = real_images(a.accuracy, seed=0)
        if xs is None:
            xs = np.stack([f[name][0] for f in random_feeds(f32, 3, a.accuracy)])
        m8, m32 = load(art8.path, num_threads=max(a.threads)), load(art32.path, num_threads=max(a.threads))
        s8, s32 = ort_session(q8, max(a.threads)), ort_session(f32, max(a.threads))
        out = {k: [] for k in ("c8", "c32", "o8", "o32")}
        for xi in xs:
            xi = xi[None]
            out["c8"].append(m8.run(xi)[0]), out["c32"].append(m32.run(xi)[0])
            out["o8"].append(s8.run(None, {name: xi})[0]), out["o32"].append(s32.run(None, {name: xi})[0])
        o = {k: np.concatenate(v).reshape(len(xs), -1) for k, v in out.items()}
        rel = lambda r, g: float(np.median(np.linalg.norm(g - r, axis=1) / np.linalg.norm(r, axis=1)))
        diffs = np.abs(o["c8"] - o["o8"])
        qstep = output_step(q8)
        acc = {"n": int(len(xs)), "inputs": src,
               "cuvil_int8_vs_fp32": {"top1": topk_agree(o["c32"], o["c8"], 1), "top5": topk_agree(o["c32"], o["c8"], 5),
                                      "rel_err_median": rel(o["c32"], o["c8"])},
               "ort_int8_vs_fp32": {"top1": topk_agree(o["o32"], o["o8"], 1), "top5": topk_agree(o["o32"], o["o8"], 5),
                                    "rel_err_median": rel(o["o32"], o["o8"])},
               "cuvil_int8_vs_ort_int8_max_steps": float(diffs.max() / qstep),
               "cuvil_int8_vs_ort_int8_identical": float(np.mean(diffs == 0))}
        res["accuracy"] = acc
        print(f"\naccuracy on {acc['n']} inputs ({src}):")
        for k in ("cuvil_int8_vs_fp32", "ort_int8_vs_fp32"):
            v = acc[k]
            print(f"  {k:<20} top-1 {v['top1']:.3f}  top-5 {v['top5']:.3f}  median rel. error {v['rel_err_median']:.3g}")
        print(f"  Cuvil int8 vs onnxruntime int8: max {acc['cuvil_int8_vs_ort_int8_max_steps']:.2f} quantization "
              f"steps, {100 * acc['cuvil_int8_vs_ort_int8_identical']:.1f}% of outputs identical")
        m8.close(), m32.close()
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
