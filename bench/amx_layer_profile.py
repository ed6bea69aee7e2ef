"""Per-layer profile of the every-bf16 ResNet-50 (a library from ``bench/amx_resnet_ab.py --build``) beside
OpenVINO's default build (bf16 on a CPU with AMX), one thread, in one process: Cuvil's step profiler (in-kernel
time per step) and OpenVINO's per-node counters (``PERF_COUNT``, ``get_profiling_info()``), rounds alternated.

    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/base.so
    PYTHONPATH=src python3 bench/amx_layer_profile.py /tmp/base.so [--rounds 15] [--layers]

Steps are matched to OpenVINO's nodes by the ONNX node that ends them (OpenVINO's ``originalLayersNames``
holds the ONNX nodes it fused into a node; a Cuvil step is named by the value it writes). Per round each
engine's per-layer times; the table gives per layer kind (kernel, K = input channels x kernel positions, output
channels, output size) the sum over the layers of that kind of the median round, both engines, and their
ratio; ``--layers`` prints every layer. Cuvil's non-contraction steps (pads, pools, residual sums done
outside a convolution) and OpenVINO's non-convolution nodes (reorders, pools) are summed by kind too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from amx_resnet_ab import cpu_model  # noqa: E402
from precision_speed import model_and_feeds  # noqa: E402


def producers(model) -> dict:
    """ONNX value name -> the node (name) writing it."""
    return {o: n.name for n in model.graph.node for o in n.output}


def conv_kinds(model) -> dict:
    """ONNX Conv node name -> its kind ("3x3 s1", "1x1 s2", ...)."""
    out = {}
    for n in model.graph.node:
        if n.op_type == "Conv":
            at = {a.name: a for a in n.attribute}
            ks = list(at["kernel_shape"].ints) if "kernel_shape" in at else []
            st = list(at["strides"].ints) if "strides" in at else [1]
            out[n.name] = f"{'x'.join(map(str, ks))} s{max(st)}"
    return out


def openvino_request(model):
    import openvino as ov
    core = ov.Core()
    c = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                           {"INFERENCE_NUM_THREADS": 1, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1,
                            "PERF_COUNT": True})
    origin = {}
    for op in c.get_runtime_model().get_ordered_ops():
        names = op.get_rt_info()["originalLayersNames"].astype(str)
        origin[op.get_friendly_name()] = [s for s in names.split(",") if s]
    return c.create_infer_request(), origin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", action="store_true", help="also every layer")
    a = ap.parse_args(argv)
    from cuvil.targets.x86.loader import load
    model, feeds, _ = model_and_feeds("resnet50", 128, 12)
    lib = load(a.lib, num_threads=1)
    with open(a.lib[:-3] + ".manifest.json") as f:
        steps = json.load(f)["steps"]
    req, origin = openvino_request(model)
    x = next(iter(feeds.values()))
    print(cpu_model(), "| load", os.getloadavg(), flush=True)
    cu, ovt = [], []
    for i in range(a.rounds):
        for who in (("cu", "ov") if i % 2 == 0 else ("ov", "cu")):
            if who == "cu":
                cu.append(np.array(lib.profile(x, runs=3, num_threads=1)) * 1e3)
            else:
                runs = []
                for _ in range(3):
                    req.infer(feeds)
                    runs.append({p.node_name: (p.real_time.total_seconds() * 1e3, p.node_type, p.exec_type)
                                 for p in req.get_profiling_info()})
                ovt.append({k: np.mean([r[k][0] for r in runs]) for k in runs[0]})
                ov_meta = {k: v[1:] for k, v in runs[0].items()}
    cu_med = np.median(np.array(cu), 0)
    ov_med = {k: float(np.median([r[k] for r in ovt])) for k in ovt[0]}
    prod = producers(model)
    kinds = conv_kinds(model)
    # ONNX node -> the OpenVINO node it was fused into (a Conv itself is renamed there when the BatchNorm after
    # it is folded into its weights; the BatchNorm, Relu and Add after it keep their names)
    ov_of_node = {o: name for name, orig in origin.items() for o in orig}
    nodes = {n.name: n for n in model.graph.node}

    written = {st["stage"] for st in steps if st.get("kernel") == "gemm"}

    def back(node, want):
        """From ONNX node ``node`` back to the nearest node for which ``want`` holds: along first inputs, at a
        residual Add along the input no other contraction step wrote (the step's own convolution)."""
        for _ in range(8):
            if node is None or want(node):
                return node
            ins = [i for i in nodes[node].input if i in prod]
            own = [i for i in ins if i not in written] if nodes[node].op_type in ("Add", "Sum") else ins
            node = prod.get((own or ins or [None])[0])
        return None
    rows = defaultdict(lambda: [0.0, 0.0, 0])
    layers = []
    used_ov = set()
    for st, ms in zip(steps, cu_med):
        if st.get("kernel") != "gemm":
            rows[f"cuvil {st.get('kernel')} ({st['op']})"][0] += ms
            continue
        # the Conv this step computes: walk back from the written value to the nearest Conv node
        end = prod.get(st["stage"])
        node = back(end, lambda nd: nd in kinds)
        shape = st["shape"]
        k = st.get("flops", 0) // max(1, 2 * int(np.prod(shape[1:])))
        kind = kinds.get(node, "fc" if st["op"] in ("Gemm", "MatMul", "Add") else "?")
        key = f"{kind} K={k} -> {shape[1]}x{shape[2] if len(shape) > 2 else 1}"
        ovn = ov_of_node.get(back(end, lambda nd: nd in ov_of_node and ov_meta.get(ov_of_node[nd], ("",))[0]
                                  in ("Convolution", "FullyConnected")) or "")
        if ovn is None and kind == "fc":
            ovn = next((nm for nm, (ty, _) in ov_meta.items() if ty == "FullyConnected"), None)
        ov_ms = ov_med.get(ovn, 0.0) if ovn else 0.0
        if ovn:
            used_ov.add(ovn)
        rows[key][0] += ms
        rows[key][1] += ov_ms
        rows[key][2] += 1
        layers.append((st["stage"], key, ms, ov_ms, ovn, st.get("flops", 0)))
    for nm, v in ov_med.items():
        if nm not in used_ov and v > 0:
            rows[f"openvino {ov_meta[nm][0]} ({ov_meta[nm][1]})"][1] += v
    tot_c, tot_o = float(cu_med.sum()), sum(ov_med.values())
    print(f"\nmedian of {a.rounds} rounds (Cuvil: in-kernel ms per step, mean of 3 runs; OpenVINO: per-node "
          f"real time, mean of 3 runs), 1 thread: Cuvil {tot_c:.2f} ms, OpenVINO {tot_o:.2f} ms, "
          f"ratio {tot_c / tot_o:.3f}")
    print("| layer kind (convolutions: kernel, K, output channels x size) | layers | Cuvil ms | OpenVINO ms | "
          "Cuvil / OpenVINO | Cuvil - OpenVINO ms |")
    print("|---|---|---|---|---|---|")
    for key, (c_, o_, n_) in sorted(rows.items(), key=lambda kv: -(kv[1][0] - kv[1][1])):
        ratio = f"{c_ / o_:.2f}" if o_ > 0 else "-"
        print(f"| {key} | {n_ or '-'} | {c_:.3f} | {o_:.3f} | {ratio} | {c_ - o_:+.3f} |")
    if a.layers:
        print("\n| step | kind | Cuvil ms | OpenVINO ms | OpenVINO node | Cuvil GFLOP/s | OpenVINO GFLOP/s |")
        print("|---|---|---|---|---|---|---|")
        for stg, key, c_, o_, ovn, fl in layers:
            print(f"| {stg} | {key} | {c_:.3f} | {o_:.3f} | {ovn} | {fl / c_ / 1e6:.0f} | "
                  f"{(fl / o_ / 1e6) if o_ else 0:.0f} |")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
