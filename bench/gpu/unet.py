"""A U-Net-style image model with symbolic H and W from ONE GPU bundle (issue 22):

    python3 bench/gpu/unet.py [--json out.json] [--sizes 256,512,...] [--jobs 0] [--iters 20]

``unet_model()``: x[1, 3, H, W] -> two encoder levels (3x3 convolution + ReLU, 2x2 max pooling), a bottleneck,
two decoder levels (nearest 2x Resize, concatenation with the skip, 3x3 convolution + ReLU) and a 1x1 head ->
y[1, 2, H, W]; seeded weights. H and W are symbols; the profile is H, W in [256, 2048], multiples of 256 (the
pooling needs multiples of 4; a multiple of 256 keeps the number of sizes at 8 per axis), and every size of the
profile is a bucket: the one bundle holds 8 x 8 = 64 specialisations compiled ahead of time (``--sizes`` for
fewer). H and W are not paddable (a convolution mixes neighbouring rows and columns, and zero rows would leak
into the border after the first layer), so a size outside the buckets is refused with the compile that would
serve it; nothing compiles at run time.

Checked: every (H, W) bucket against onnxruntime (CPU, float32), normwise error max|gpu - ref| / max|ref|; the
modules loaded before and after all the calls; p50 ms per call (numpy in/out) at a few sizes.
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

TARGET = "nvptx64-nvidia-cuda"
R: dict = {}


def unet_model(c1: int = 8, c2: int = 16, c3: int = 32, seed: int = 0):
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(x, cin, cout, name, k=3, relu=True):
        w = nh.from_array((rng.standard_normal((cout, cin, k, k)) * (2.0 / (cin * k * k)) ** 0.5).astype(np.float32),
                          f"{name}.w")
        b = nh.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), f"{name}.b")
        inits.extend([w, b])
        p = k // 2
        nodes.append(h.make_node("Conv", [x, w.name, b.name], [f"{name}.c"], pads=[p, p, p, p]))
        if not relu:
            return f"{name}.c"
        nodes.append(h.make_node("Relu", [f"{name}.c"], [f"{name}.r"]))
        return f"{name}.r"

    def pool(x, name):
        nodes.append(h.make_node("MaxPool", [x], [name], kernel_shape=[2, 2], strides=[2, 2]))
        return name

    scales = nh.from_array(np.array([1, 1, 2, 2], np.float32), "up.scales")
    inits.append(scales)

    def up(x, name):
        nodes.append(h.make_node("Resize", [x, "", scales.name], [name], mode="nearest"))
        return name

    e1 = conv("x", 3, c1, "enc1")
    e2 = conv(pool(e1, "p1"), c1, c2, "enc2")
    mid = conv(pool(e2, "p2"), c2, c3, "mid")
    nodes.append(h.make_node("Concat", [up(mid, "u2"), e2], ["cat2"], axis=1))
    d2 = conv("cat2", c3 + c2, c2, "dec2")
    nodes.append(h.make_node("Concat", [up(d2, "u1"), e1], ["cat1"], axis=1))
    d1 = conv("cat1", c2 + c1, c1, "dec1")
    y = conv(d1, c1, 2, "head", k=1, relu=False)
    nodes.append(h.make_node("Identity", [y], ["y"]))
    g = h.make_graph(nodes, "unet", [h.make_tensor_value_info("x", T.FLOAT, [1, 3, "H", "W"])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 2, "H", "W"])], inits)
    m = onnx.helper.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 10          # the onnxruntime beside the GPU reads IR <= 10 (docs: DEVICE image)
    return m


def log(*a):
    print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--sizes", default="256,512,768,1024,1280,1536,1792,2048")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--arch", default=None, help="compile only, for this arch (no GPU needed)")
    ap.add_argument("--work", default="/tmp/cuvil-unet")
    args = ap.parse_args(argv)
    from cuvil import Pipeline
    sizes = [int(v) for v in args.sizes.split(",")]
    arch = args.arch
    if arch is None:
        from cuvil.targets.ptx.runtime import device_info
        from concurrency import cpu_label
        info = device_info(0)
        arch = info["arch"]
        R.update(device=info, host_cpu=cpu_label(), load=os.getloadavg())
        log(f"device {info['name']} ({arch}); host {R['host_cpu']}; load {os.getloadavg()}")
    model = unet_model()
    rc = 0
    try:
        t0 = time.perf_counter()
        prof = (256, 512, 2048, {"multiple": 256})
        b = Pipeline.from_onnx(model).optimize().compile(
            TARGET, arch=arch, cache=False, jobs=args.jobs, shape_profiles={"H": prof, "W": prof},
            graph_buckets={"H": sizes, "W": sizes})
        path = b.save(os.path.join(args.work, "unet.cuvil"))
        man = b.manifest
        R["compile"] = {"seconds": round(time.perf_counter() - t0, 1), "points": len(man["buckets"]),
                        "kernels": man["kernels"], "buckets": man["graph_buckets"], "weights_shared": man["weights_shared"],
                        "paddable": {n: v["paddable"] for n, v in man["profile"].items()},
                        "bundle_bytes": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)}
        log(f"compiled the U-Net for H, W in [256, 2048] (multiples of 256) into one bundle: {R['compile']}")
        if args.arch is not None:
            return 0
        import onnxruntime as ort
        from cuvil.errors import ShapeError
        from cuvil.targets.ptx.runtime import load_bundle
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        with load_bundle(path, max_graphs=4) as m:
            loads = m.module_loads
            errs = R["check"] = {}
            for hh in sizes:
                for ww in sizes:
                    x = np.random.default_rng(hh * 7 + ww).standard_normal((1, 3, hh, ww)).astype(np.float32)
                    (y,) = m.run(x)
                    ref = sess.run(None, {"x": x})[0]
                    errs[f"{hh}x{ww}"] = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            worst = max(errs, key=errs.get)
            R["worst"] = [worst, errs[worst]]
            log(f"{len(errs)} sizes checked against onnxruntime: worst normwise error {errs[worst]:.2e} at {worst}")
            try:
                m.run(np.zeros((1, 3, 300, 300), np.float32))
                R["refused_300"] = "NOT refused"
            except ShapeError as e:
                R["refused_300"] = str(e).splitlines()[0]
            log(f"300x300: {R['refused_300']}")
            R["module_loads_during_calls"] = m.module_loads - loads
            from resnet50 import timed
            R["time"] = {}
            for s in (256, 1024, 2048):
                if s in sizes:
                    x = np.random.default_rng(s).standard_normal((1, 3, s, s)).astype(np.float32)
                    R["time"][str(s)] = t = timed(lambda: m.run(x), args.iters, 3)
                    log(f"{s}x{s}: p50 {t['p50_ms']:.3f} ms per call (numpy in/out)")
            st = m.stats()
            R["stats"] = {k: v for k, v in st.items() if k != "buckets"}
            log(f"modules loaded during the calls: {R['module_loads_during_calls']}; graphs alive "
                f"{st['graphs_alive']} (max {st['max_graphs']}), captures {st['captures']}, evictions {st['evictions']}")
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
