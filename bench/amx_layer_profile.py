"""Per-layer profile of the every-bf16 ResNet-50 (a library from ``bench/amx_resnet_ab.py --build``) beside
OpenVINO's default build (bf16 on a CPU with AMX), one thread, in one process: Cuvil's step profiler (in-kernel
time per step) and OpenVINO's per-node counters (``PERF_COUNT``, ``get_profiling_info()``), rounds rotated
among the engines (and between two Cuvil builds, A and B, when two are given).

Each round also times every engine's plain runs (wall clock; OpenVINO from a second compiled model without
``PERF_COUNT``), so that each engine's per-step sum can be checked against what its plain run costs: the
engines' totals compare by that wall-clock line. (On the model-207 Xeon of session 25, whose speed moved in
phases of minutes, one slow-phase run put Cuvil's steps at 0.95 of OpenVINO's nodes while plain runs minutes
later gave 1.28x; with the line the two are taken in the same rounds.)

    PYTHONPATH=src python3 bench/amx_resnet_ab.py --build /tmp/base.so
    PYTHONPATH=src python3 bench/amx_layer_profile.py /tmp/base.so [--rounds 15] [--layers] [--min]
    PYTHONPATH=src python3 bench/amx_layer_profile.py /tmp/before.so /tmp/after.so   # both, OpenVINO beside

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
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from amx_resnet_ab import cpu_model  # noqa: E402
from precision_speed import model_and_feeds  # noqa: E402


#: the steps matched to OpenVINO's convolution nodes layer by layer (the packed-panel and channels-last kernels)
CONV_KERNELS = ("gemm", "bf16_nhwc_amx")


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


def openvino_request(model, perf_count: bool = True):
    import openvino as ov
    core = ov.Core()
    c = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                           {"INFERENCE_NUM_THREADS": 1, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1,
                            "PERF_COUNT": perf_count})
    if not perf_count:
        return c.create_infer_request(), {}
    origin = {}
    for op in c.get_runtime_model().get_ordered_ops():
        names = op.get_rt_info()["originalLayersNames"].astype(str)
        origin[op.get_friendly_name()] = [s for s in names.split(",") if s]
    return c.create_infer_request(), origin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libs", nargs="+", help="one library, or two (A: before, B: after) built from one model")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min", action="store_true",
                    help="each step's and node's best round, not the median (a loaded VM's noise only adds time)")
    ap.add_argument("--layers", action="store_true", help="also every layer")
    a = ap.parse_args(argv)
    from cuvil.targets.x86.loader import load
    model, feeds, _ = model_and_feeds("resnet50", 128, 12)
    labels = ["A", "B"][:len(a.libs)] if len(a.libs) > 1 else ["Cuvil"]
    libs, steps = {}, None
    for label, path in zip(labels, a.libs):
        libs[label] = load(path, num_threads=1)
        with open(path[:-3] + ".manifest.json") as f:
            st_ = json.load(f)["steps"]
        if steps is not None and [s_["stage"] for s_ in st_] != [s_["stage"] for s_ in steps]:
            raise SystemExit(f"{path}: not the same steps as {a.libs[0]} (give builds of one model)")
        steps = st_
    req, origin = openvino_request(model)
    plain, _ = openvino_request(model, perf_count=False)
    x = next(iter(feeds.values()))
    print(cpu_model(), "| load", os.getloadavg(), flush=True)
    cu, ovt = {k: [] for k in labels}, []
    wall = {k: [] for k in labels + ["ov"]}
    order = labels + ["ov"]
    for i in range(a.rounds):
        for who in order[i % len(order):] + order[:i % len(order)]:     # rotated every round
            for _ in range(3):      # plain runs, wall clock: what the per-step figures are read against
                t0 = time.perf_counter()
                libs[who].run(x) if who != "ov" else plain.infer(feeds)
                wall[who].append((time.perf_counter() - t0) * 1e3)
            if who != "ov":
                cu[who].append(np.array(libs[who].profile(x, runs=3, num_threads=1)) * 1e3)
            else:
                runs = []
                for _ in range(3):
                    req.infer(feeds)
                    runs.append({p.node_name: (p.real_time.total_seconds() * 1e3, p.node_type, p.exec_type)
                                 for p in req.get_profiling_info()})
                ovt.append({k: np.mean([r[k][0] for r in runs]) for k in runs[0]})
                ov_meta = {k: v[1:] for k, v in runs[0].items()}
    stat = np.min if a.min else np.median
    cu_med = {k: stat(np.array(v), 0) for k, v in cu.items()}
    ov_med = {k: float(stat([r[k] for r in ovt])) for k in ovt[0]}
    prod = producers(model)
    kinds = conv_kinds(model)
    # ONNX node -> the OpenVINO node it was fused into (a Conv itself is renamed there when the BatchNorm after
    # it is folded into its weights; the BatchNorm, Relu and Add after it keep their names)
    ov_of_node = {o: name for name, orig in origin.items() for o in orig}
    nodes = {n.name: n for n in model.graph.node}

    readers = defaultdict(list)
    for n_ in model.graph.node:
        for i_ in n_.input:
            readers[i_].append(n_.name)
    written = {st["stage"] for st in steps if st.get("kernel") in CONV_KERNELS}

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

    nl = len(labels)
    rows = defaultdict(lambda: [0.0] * (nl + 2))       # per kind: each library's ms, OpenVINO's ms, layers
    layers = []
    used_ov = set()
    for si, st in enumerate(steps):
        ms = [float(cu_med[k][si]) for k in labels]
        if st.get("kernel") not in CONV_KERNELS:
            r = rows[f"cuvil {st.get('kernel')} ({st['op']})"]
            for j in range(nl):
                r[j] += ms[j]
            continue
        end = prod.get(st["stage"])
        node = back(end, lambda nd: nd in kinds)
        shape = st["shape"]
        k = st.get("flops", 0) // max(1, 2 * int(np.prod(shape[1:])))
        kind = kinds.get(node, "fc" if st["op"] in ("Gemm", "MatMul", "Add") else "?")
        key = f"{kind} K={k} -> {shape[1]}x{shape[2] if len(shape) > 2 else 1}"
        # OpenVINO's node: the one holding the Conv itself, or (a Conv renamed there when the BatchNorm after
        # it was folded into its weights) the one holding the node that reads the Conv's output
        ovn = None
        if node is not None:
            for nd in [node] + readers.get(nodes[node].output[0], []):
                if ov_meta.get(ov_of_node.get(nd, ""), ("",))[0] == "Convolution":
                    ovn = ov_of_node[nd]
                    break
        else:
            ovn = ov_of_node.get(back(end, lambda nd: nd in ov_of_node and ov_meta.get(ov_of_node[nd], ("",))[0]
                                      == "FullyConnected") or "")
        if ovn is None and kind == "fc":
            ovn = next((nm for nm, (ty, _) in ov_meta.items() if ty == "FullyConnected"), None)
        ov_ms = ov_med.get(ovn, 0.0) if ovn else 0.0
        if ovn:
            used_ov.add(ovn)
        r = rows[key]
        for j in range(nl):
            r[j] += ms[j]
        r[nl] += ov_ms
        r[nl + 1] += 1
        layers.append((st["stage"], key, ms, ov_ms, ovn, st.get("flops", 0)))
    for nm, v in ov_med.items():
        if nm not in used_ov and v > 0:
            rows[f"openvino {ov_meta[nm][0]} ({ov_meta[nm][1]})"][nl] += v
    tot = {k: float(v.sum()) for k, v in cu_med.items()}
    tot_o = sum(ov_med.values())
    print(f"\n{'best' if a.min else 'median'} of {a.rounds} rounds (Cuvil: in-kernel ms per step, mean of 3 runs; OpenVINO: per-node "
          f"real time, mean of 3 runs), 1 thread: " + ", ".join(f"{k} {v:.2f} ms ({v / tot_o:.3f} of OpenVINO)"
                                                               for k, v in tot.items())
          + f", OpenVINO {tot_o:.2f} ms" + (f"; B/A {tot['B'] / tot['A']:.3f}" if nl > 1 else ""))
    w_med = {k: float(stat(v)) for k, v in wall.items()}
    print(f"plain runs, wall clock ({'best' if a.min else 'median'} of {3 * a.rounds}): "
          + ", ".join(f"{k} {w_med[k]:.2f} ms ({w_med[k] / w_med['ov']:.3f} of OpenVINO)" for k in labels)
          + f", OpenVINO {w_med['ov']:.2f} ms. OpenVINO's node times sum to {tot_o / w_med['ov']:.2f}x its plain run"
          + ", Cuvil's steps to " + ", ".join(f"{tot[k] / w_med[k]:.2f}x" for k in labels) + " of its own")
    fmt = lambda c_, o_: f"{c_ / o_:.2f}" if o_ > 0 else "-"
    print("| layer kind (convolutions: kernel, K, output channels x size) | layers | "
          + " | ".join(f"{k} ms" for k in labels) + " | OpenVINO ms | " + " | ".join(f"{k} / OpenVINO" for k in labels)
          + (" | B / A" if nl > 1 else "") + f" | {labels[-1]} - OpenVINO ms |")
    print("|---" * (4 + 2 * nl + (nl > 1)) + "|")
    for key, r in sorted(rows.items(), key=lambda kv: -(kv[1][nl - 1] - kv[1][nl])):
        print(f"| {key} | {int(r[nl + 1]) or '-'} | " + " | ".join(f"{r[j]:.3f}" for j in range(nl))
              + f" | {r[nl]:.3f} | " + " | ".join(fmt(r[j], r[nl]) for j in range(nl))
              + (f" | {fmt(r[1], r[0])}" if nl > 1 else "") + f" | {r[nl - 1] - r[nl]:+.3f} |")
    if a.layers:
        print("\n| step | kind | " + " | ".join(f"{k} ms" for k in labels) + " | OpenVINO ms | OpenVINO node | "
              + " | ".join(f"{k} GFLOP/s" for k in labels) + " | OpenVINO GFLOP/s |")
        print("|---" * (5 + 2 * nl) + "|")
        for stg, key, ms, o_, ovn, fl in layers:
            print(f"| {stg} | {key} | " + " | ".join(f"{c_:.3f}" for c_ in ms) + f" | {o_:.3f} | {ovn} | "
                  + " | ".join(f"{fl / c_ / 1e6:.0f}" for c_ in ms) + f" | {(fl / o_ / 1e6) if o_ else 0:.0f} |")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main()
