"""Several inferences in flight from several host threads (issue 22, part 4), and page-locked staging:

    python3 bench/gpu/concurrency.py [--json out.json] [--models resnet50 bert] [--threads 1 2 4 8]
                                     [--calls 300] [--repeats 3] [--pinned-batches 1 32]

1. Throughput: one bundle loaded with ``sessions=max(threads)``; T host threads each make ``--calls`` calls
   (T = 1, 2, 4, 8) on their own inputs, every call taking a free session (its own stream, arena and graph);
   calls per second over the whole run = T x calls / wall seconds, p50 of ``--repeats`` runs. Two call forms:
   ``run`` (numpy in/out through the session's page-locked staging) and ``run_device`` (device-resident
   buffers per thread). The figure the issue asks for: 4 threads on 4 streams against 1 thread, batch 1.
   Every output of the threaded runs is compared with the one-thread output of the same input (bit for bit).
2. Page-locked against pageable inputs: ``run`` latency (p50 of 100 calls, blocks interleaved) of ResNet-50 at
   each ``--pinned-batches`` batch given a pageable array, given the session's page-locked staging filled in
   place (``pinned_inputs``: one DMA, no host copy), and with ``pinned=False``. (Run 1 of 2026-12-02 measured
   the earlier design, which copied every input into the staging first: ``results/concurrency_2026-12-02.*``.)

Models: ``resnet50`` (onnx's light ResNet-50, float32, batch 1), ``resnet50-fp16`` (the same with
``enable_fp16``: float16 activations and weights on the tensor cores; BatchNormalization scales drawn from
[0.25, 0.75], as ``tensor_cores.py``'s, so that its activations stay within float16's range) and ``bert`` (BERT-base, B = 1, S = 128,
``enable_fp16`` on the tensor cores: the fastest BERT the bundle has). Bundles are compiled in parallel
processes first. Host CPU and load are printed beside the figures.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)

TARGET = "nvptx64-nvidia-cuda"
RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)


def cpu_label() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        fam = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cpu family"))
        mod = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model\t"))
        step = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("stepping"))
        return f"{name} (family {fam}, model {mod}, stepping {step}), {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def build(what: str):
    """(onnx model, feeds builder(batch), fixed symbols, compile keywords)."""
    if what == "bert":
        from cuvil.testing.hf_models import bert_model, text_feeds
        m = bert_model()
        return m, (lambda n, seed: text_feeds(m, n, 128, seed)), {"batch": 1, "sequence": 128}, {"enable_fp16": True}
    from profiles import resnet50_batched
    m = resnet50_batched(bn_scale=(0.25, 0.75)) if what == "resnet50-fp16" else resnet50_batched()
    name = m.graph.input[0].name

    def feeds(n, seed):
        return {name: np.random.default_rng(seed).standard_normal((n, 3, 224, 224)).astype(np.float32)}
    return m, feeds, None, ({"enable_fp16": True} if what == "resnet50-fp16" else {})


def compile_job(job):
    os.environ.setdefault("CUVIL_CACHE_DIR", "/tmp/cuvil-conc-cache")
    try:
        from cuvil import Pipeline
        t0 = time.perf_counter()
        model, _, fixed, kw = build(job["model"])
        if job["model"].startswith("resnet50"):
            fixed = {"N": job["batch"]}
        if "concurrency" in job.get("tuning", {}):      # a compile option (PtxOptions.concurrency)
            kw = {**kw, "concurrency": job["tuning"]["concurrency"]}
        elif job.get("tuning"):       # code-generator settings (--variants): compile_bundle at the fixed shapes
            from cuvil.targets.ptx.bundle import compile_bundle
            from cuvil.targets.ptx.tuning import PtxTuning
            g = Pipeline.from_onnx(model).optimize().specialize(fixed).optimize().graph
            man = compile_bundle(g, job["out"], arch=job["arch"], tuning=PtxTuning(**job["tuning"]), **kw)
            return {"path": job["out"], "compile_s": round(time.perf_counter() - t0, 1), "kernels": man["kernels"]}
        b = Pipeline.from_onnx(model).optimize().compile(TARGET, arch=job["arch"], cache=False, fixed=fixed, **kw)
        b.save(job["out"])
        return {"path": job["out"], "compile_s": round(time.perf_counter() - t0, 1), "kernels": b.manifest["kernels"]}
    except Exception:  # noqa: BLE001 - reported by the caller
        return {"error": traceback.format_exc()[-1500:]}


def throughput(m, feeds_of, threads: int, calls: int, repeats: int, form: str, expect) -> dict:
    """Calls per second of ``threads`` threads x ``calls`` calls (p50 over ``repeats``); outputs checked."""
    from cuvil.targets.ptx.runtime import _call, driver
    drv = driver()
    names = [o.name for o in m.outputs]
    dev = []
    if form == "device":
        for t in range(threads):
            ins = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(a.nbytes))) for a in feeds_of[t].values()]
            for p, a in zip(ins, feeds_of[t].values()):
                _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(p, a.ctypes.data, a.nbytes))
            outs = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes))) for y in expect[t]]
            dev.append((ins, outs))
    rates, bad = [], []

    def work(t, barrier, got):
        try:
            m._d.cuCtxSetCurrent(m._ctx)
            barrier.wait()
            if form == "numpy":
                x = feeds_of[t]
                for _ in range(calls):
                    y = m.run(x)
                got[t] = [y[n] for n in names]
            else:
                ins, outs = dev[t]
                for _ in range(calls):
                    m.run_device(ins, outs)
                ys = [np.empty_like(e) for e in expect[t]]
                for y, p in zip(ys, outs):
                    _call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(y.ctypes.data, p, y.nbytes))
                got[t] = ys
        except BaseException as e:  # noqa: BLE001 - reported
            bad.append(repr(e))

    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)
        got = [None] * threads
        ts = [threading.Thread(target=work, args=(t, barrier, got)) for t in range(threads)]
        for th in ts:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in ts:
            th.join()
        wall = time.perf_counter() - t0
        rates.append(threads * calls / wall)
        for t in range(threads):
            if got[t] is None or not all(np.array_equal(a, b) for a, b in zip(got[t], expect[t])):
                bad.append(f"thread {t}: output differs from the one-thread output of its input")
    for ins, outs in dev:
        for p in ins + outs:
            drv.cuMemFree(p)
    return {"calls_per_s": statistics.median(rates), "all": rates, "ms_per_call": 1e3 / statistics.median(rates),
            "errors": bad[:3]}


def part_threads(args, paths):
    from cuvil.targets.ptx.runtime import load_bundle
    out = RESULTS.setdefault("threads", {})
    for what in labels(args):
        path = paths.get((what, 1))
        if path is None:
            continue
        _, feeds, _, _ = build(what.split("[")[0])
        T = max(args.threads)
        feeds_of = [feeds(1, 100 + t) for t in range(T)]
        with load_bundle(path, sessions=T) as m:
            expect = []                               # one session, one at a time
            for f in feeds_of:
                y = m.run(f)
                expect.append([y[o.name] for o in m.outputs])
            r = out[what] = {}
            for form in ("numpy", "device"):
                r[form] = {}
                for threads in args.threads:
                    res = throughput(m, feeds_of, threads, args.calls, args.repeats, form, expect)
                    r[form][str(threads)] = res
                    base = r[form]["1"]["calls_per_s"]
                    res["speedup"] = res["calls_per_s"] / base
                    log(f"{what} b1 {form:6s} {threads} threads / {threads} sessions: {res['calls_per_s']:8.0f} calls/s "
                        f"({res['ms_per_call']:.3f} ms per call), x{res['speedup']:.2f} of one thread"
                        + (f"  ERRORS {res['errors']}" if res["errors"] else ""))
            r["stats"] = {k: v for k, v in m.stats().items() if k != "buckets"}


def labels(args) -> list:
    """Each model, then each model under each ``--variants`` setting (``model[setting]``)."""
    return list(args.models) + [f"{m}[{v}]" for v in args.variants for m in args.models]


def part_pinned(args, paths):
    from resnet50 import timed
    from cuvil.targets.ptx.runtime import load_bundle
    out = RESULTS.setdefault("pinned", {})
    _, feeds, _, _ = build("resnet50")
    for n in args.pinned_batches:
        path = paths.get(("resnet50", n))
        if path is None:
            continue
        x = list(feeds(n, 7).values())[0]
        with load_bundle(path, pinned=True) as mp_, load_bundle(path, pinned=False) as mq:
            (xin,) = mp_.pinned_inputs()
            ref = mq.run(x)[0]
            assert np.array_equal(mp_.run(x)[0], ref)
            xin[...] = x
            assert np.array_equal(mp_.run(xin)[0], ref)
            iters = 100 if n <= 8 else 40
            blocks = {"run(x), x pageable": [], "run(pinned_inputs()), filled in place": [],
                      "pinned=False, run(x)": []}
            for _ in range(3):
                blocks["run(x), x pageable"].append(timed(lambda: mp_.run(x), iters)["p50_ms"])
                blocks["run(pinned_inputs()), filled in place"].append(timed(lambda: mp_.run(xin), iters)["p50_ms"])
                blocks["pinned=False, run(x)"].append(timed(lambda: mq.run(x), iters)["p50_ms"])
            r = out[str(n)] = {k: {"p50_ms": statistics.median(v), "blocks": v} for k, v in blocks.items()}
            page = r["pinned=False, run(x)"]["p50_ms"]
            for k, v in r.items():
                v["vs_pageable"] = v["p50_ms"] / page
            log(f"resnet50 b{n} run(): " + ", ".join(f"{k} {v['p50_ms']:.3f} ms (x{v['vs_pageable']:.2f})"
                                                     for k, v in r.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--models", nargs="+", default=["resnet50", "bert"], choices=["resnet50", "resnet50-fp16", "bert"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pinned-batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--parts", nargs="+", default=["threads", "pinned"], choices=["threads", "pinned"])
    ap.add_argument("--work", default="/tmp/cuvil-concurrency")
    ap.add_argument("--variants", nargs="*", default=[], metavar="NAME=VALUE[,...]",
                    help="also each model compiled with these PtxTuning settings (codegen_settings.py's, typed by "
                         "their defaults), e.g. target_blocks=66, or with the compile option concurrency=C (part threads)")
    args = ap.parse_args(argv)
    from codegen_settings import parse_assignments
    if 1 not in args.threads:
        args.threads = [1] + args.threads
    from cuvil.targets.ptx.runtime import device_info
    info = device_info(0)
    RESULTS.update(device=info, host_cpu=cpu_label(), load=os.getloadavg(), argv=sys.argv[1:])
    log(f"device: {info['name']} ({info['arch']}); host: {RESULTS['host_cpu']}; load {os.getloadavg()}")
    jobs = [{"model": w, "batch": 1} for w in args.models] if "threads" in args.parts else []
    for v in args.variants:
        if "concurrency" in parse_assignments(v) and len(parse_assignments(v)) > 1:
            ap.error(f"--variants {v}: concurrency=C is a compile option, give it alone (not with PtxTuning settings)")
    if "threads" in args.parts:
        jobs += [{"model": w, "batch": 1, "tuning": parse_assignments(v), "label": f"{w}[{v}]"}
                 for v in args.variants for w in args.models]
    if "pinned" in args.parts:
        jobs += [{"model": "resnet50", "batch": n} for n in args.pinned_batches
                 if n != 1 or "resnet50" not in args.models or "threads" not in args.parts]
    for i, j in enumerate(jobs):
        j.setdefault("label", j["model"])
        j.update(arch=info["arch"], out=os.path.join(args.work, f"{j['model']}_b{j['batch']}_{i}.cuvil"))
    paths = {}
    with cf.ProcessPoolExecutor(max_workers=len(jobs), mp_context=mp.get_context("spawn")) as pool:
        for j, r in zip(jobs, pool.map(compile_job, jobs)):
            RESULTS.setdefault("compile", {})[f"{j['label']}_b{j['batch']}"] = r
            if "error" in r:
                log(f"compile {j['label']} b{j['batch']} FAILED:\n{r['error']}")
            else:
                paths[(j["label"], j["batch"])] = r["path"]
                log(f"compiled {j['label']} b{j['batch']} in {r['compile_s']} s ({r['kernels']} kernels)")
    for name, fn in (("threads", part_threads), ("pinned", part_pinned)):
        if name not in args.parts:
            continue
        try:
            fn(args, paths)
        except Exception:  # noqa: BLE001 - the other part still runs
            RESULTS.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            log(f"{name} FAILED:\n{RESULTS['errors'][name]}")
    RESULTS["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 1 if RESULTS.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
