"""BERT-base from ONE GPU bundle for B = 1..32, S = 16..512 (issue 22), beside torch.compile, in one process:

    python3 bench/gpu/bert_profile.py [--json out.json] [--precision fp16|tf32|fp32] [--jobs 0] [--iters 50]
                                      [--batch-buckets 1,2,4,8,16,32] [--seq-buckets 16,32,64,128,256,512]
                                      [--no-torch]

1. ``cuvil.testing.hf_models.bert_model()`` (Hugging Face's BertModel graph, seeded random weights) compiled
   once with the profile batch in [1, 32], sequence in [16, 512] and those buckets (each bucket point
   specialised ahead of time into the one bundle, ``--jobs`` processes at once; ``--precision fp16`` is
   ``enable_fp16``, tf32 ``allow_tf32``). Batch is padded up to its bucket (rows proved independent);
   sequence is not paddable (attention mixes positions), so only its bucket values run and another length
   is refused with the compile that would serve it.
2. Correctness against onnxruntime (CPU, float32) at several (B, S) points, padded batches included; normwise
   error max|gpu - ref| / max|ref| per output. The number of modules loaded before and after every call is
   compared (nothing compiles at run time).
3. p50 per call at B = 1, 8, 32 and S = 128: ``run_device`` (device-resident inputs and outputs) and ``run``
   (numpy in/out); then torch.compile(mode="reduce-overhead") of the same architecture in torch
   (tensor_cores.py's ``torch_bert``), at the same precision, one compiled function called at each shape.
PyTorch is imported by this script only.
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
sys.path.insert(0, HERE)

from resnet50 import timed  # noqa: E402

TARGET = "nvptx64-nvidia-cuda"
R: dict = {}
CHECKS = ((1, 16), (3, 128), (8, 128), (2, 512), (32, 64), (5, 64))
TIMED = ((1, 128), (8, 128), (32, 128))


def log(*a):
    print(*a, flush=True)


def ints(text):
    return [int(v) for v in text.split(",") if v.strip()]


def part_compile(args, arch):
    from cuvil import Pipeline
    from cuvil.testing.hf_models import bert_model
    model = bert_model()
    kw = {"fp16": {"enable_fp16": True}, "tf32": {"allow_tf32": True}, "fp32": {}}[args.precision]
    t0 = time.perf_counter()
    p = Pipeline.from_onnx(model).optimize()
    b = p.compile(TARGET, arch=arch, cache=False, jobs=args.jobs,
                  shape_profiles={"batch": (1, 1, 32), "sequence": (16, 128, 512)},
                  graph_buckets={"batch": ints(args.batch_buckets), "sequence": ints(args.seq_buckets)}, **kw)
    path = b.save(os.path.join(args.work, f"bert_{args.precision}.cuvil"))
    man = b.manifest
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    R["compile"] = {"seconds": round(time.perf_counter() - t0, 1), "kernels": man["kernels"],
                    "buckets": man["graph_buckets"], "points": len(man["buckets"]),
                    "paddable": {n: v["paddable"] for n, v in man["profile"].items()},
                    "weights_files": sorted({e["weights"] for e in json.load(open(os.path.join(path, "plan.json")))["buckets"]}),
                    "bundle_bytes": size}
    log(f"compiled BERT-base {args.precision} for batch 1..32, sequence 16..512 into one bundle in "
        f"{R['compile']['seconds']} s: {len(man['buckets'])} bucket points {man['graph_buckets']}, "
        f"{man['kernels']} kernels, paddable {R['compile']['paddable']}, weights files "
        f"{R['compile']['weights_files']}, {size / 2**30:.2f} GiB")
    return model, path


def part_check(args, model, m):
    import onnxruntime as ort
    from cuvil.errors import ShapeError
    from cuvil.testing.hf_models import text_feeds
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = R["check"] = {}
    loads = m.module_loads
    for bsz, seq in CHECKS:
        feeds = text_feeds(model, bsz, seq, seed=bsz * 1000 + seq)
        got = m.run(feeds)
        ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        errs = {k: float(np.max(np.abs(got[k] - ref[k])) / max(np.max(np.abs(ref[k])), 1e-30)) for k in ref}
        shapes_ok = all(got[k].shape == ref[k].shape for k in ref)
        out[f"B={bsz},S={seq}"] = {"error": errs, "shapes_ok": shapes_ok}
        log(f"  B={bsz:2d} S={seq:3d}: normwise error vs onnxruntime " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            + ("" if shapes_ok else "  SHAPES DIFFER"))
    try:
        m.run(text_feeds(model, 1, 100))
        R["refused_S100"] = "NOT refused"
    except ShapeError as e:
        R["refused_S100"] = str(e).splitlines()[0]
    log(f"  S=100 (between buckets): {R['refused_S100']}")
    R["module_loads_during_calls"] = m.module_loads - loads
    log(f"  modules loaded during the calls: {R['module_loads_during_calls']}")


def part_time(args, model, m):
    from cuvil.targets.ptx.runtime import _call, driver
    from cuvil.testing.hf_models import text_feeds
    drv = driver()
    out = R["cuvil"] = {}
    for bsz, seq in TIMED:
        feeds = text_feeds(model, bsz, seq)
        xs = list(feeds.values())
        got = m.run(feeds)
        ys = [got[o.name] for o in m.outputs]
        d_in = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes))) for x in xs]
        d_out = [int(_call(drv, "cuMemAlloc", drv.cuMemAlloc(y.nbytes))) for y in ys]
        for d, x in zip(d_in, xs):
            _call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d, x.ctypes.data, x.nbytes))
        sym = {"batch": bsz, "sequence": seq}
        td = timed(lambda: m.run_device(d_in, d_out, symbols=sym), args.iters)
        tn = timed(lambda: m.run(feeds), args.iters)
        for d in d_in + d_out:
            drv.cuMemFree(d)
        out[f"{bsz}x{seq}"] = {"run_device": td, "run": tn}
        log(f"  cuvil B={bsz:2d} S={seq}: run_device p50 {td['p50_ms']:.3f} ms, run (numpy) p50 {tn['p50_ms']:.3f} ms")
    st = m.stats()
    R["stats"] = {k: v for k, v in st.items() if k != "buckets"}


def part_torch(args, model):
    import torch
    from tensor_cores import torch_bert
    from cuvil.testing.hf_models import text_feeds
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    torch.manual_seed(0)
    net = torch_bert()().eval().cuda()
    if args.precision == "fp16":
        net = net.half()
    import torch._dynamo
    torch._dynamo.reset()
    c = torch.compile(net, mode="reduce-overhead")
    out = R["torch"] = {"precision": args.precision, "version": torch.__version__}
    for bsz, seq in TIMED:
        feeds = text_feeds(model, bsz, seq)
        ids, mask, types = (torch.from_numpy(feeds[k]).cuda() for k in ("input_ids", "attention_mask", "token_type_ids"))
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(5):
                c(ids, mask, types)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0

            def run():
                c(ids, mask, types)
                torch.cuda.synchronize()
            r = timed(run, args.iters)
        r["first_calls_s"] = round(first, 2)
        out[f"{bsz}x{seq}"] = r
        log(f"  torch.compile {args.precision} B={bsz:2d} S={seq}: p50 {r['p50_ms']:.3f} ms (first 5 calls {first:.1f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "tf32", "fp32"])
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batch-buckets", default="1,2,4,8,16,32")
    ap.add_argument("--seq-buckets", default="16,32,64,128,256,512")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--work", default="/tmp/cuvil-bert-profile")
    args = ap.parse_args(argv)
    from cuvil.targets.ptx.runtime import device_info, load_bundle
    from concurrency import cpu_label
    info = device_info(0)
    R.update(device=info, host_cpu=cpu_label(), load=os.getloadavg(), args=vars(args))
    log(f"device {info['name']} ({info['arch']}); host {R['host_cpu']}; load {os.getloadavg()}")
    rc = 0
    try:
        model, path = part_compile(args, info["arch"])
        t0 = time.perf_counter()
        with load_bundle(path, max_graphs=8) as m:
            R["load_s"] = round(time.perf_counter() - t0, 2)
            R["device_bytes"] = m.device_bytes
            log(f"loaded in {R['load_s']} s, {m.module_loads} modules, {m.device_bytes / 2**30:.2f} GiB on the device")
            part_check(args, model, m)
            part_time(args, model, m)
        if not args.no_torch:
            part_torch(args, model)
    except Exception:  # noqa: BLE001 - reported, results so far kept
        R["error"] = traceback.format_exc()[-3000:]
        log(R["error"])
        rc = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
