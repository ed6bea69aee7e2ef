"""Cuvil on the GPU against onnxruntime on the CPU: the nine light architectures (seeded random weights,
batch 1) and a sample of the official ONNX node test cases (those the x86 backend passes,
``tests/conformance_expected_pass.txt``).

    python3 bench/gpu/check_correctness.py                       # everything, table on stdout
    python3 bench/gpu/check_correctness.py --models resnet50 --node-sample 0 --json out.json
    python3 bench/gpu/check_correctness.py --models --node-sample 0 --node-match 'attention|rotary'

Each model is compiled to a bundle (``Pipeline.compile(target="nvptx64-nvidia-cuda")``) in worker
processes, then run on the GPU by graph replay and eagerly (the two must agree bit for bit). Light models
load the cubin ptxas built; node cases are built without ptxas, so their PTX goes through the driver's
JIT (both loading paths are covered). The error is normwise, max|gpu - ref| / max|ref| per output; float
outputs pass at 1e-4, integer and boolean outputs must be equal. The oracle is onnxruntime's CPU provider
on the original model; where onnxruntime cannot run a node case, the case's expected outputs (onnx's
reference) are used and the table says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))

TARGET = "nvptx64-nvidia-cuda"
RTOL = 1e-4


# --- compiling (worker processes) --------------------------------------------------------------------------

def _compile_light(name: str, out_dir: str, arch: str):
    from cuvil import Pipeline
    from cuvil.testing import light_model
    t0 = time.perf_counter()
    try:
        b = Pipeline.from_onnx(light_model(name)).optimize().compile(TARGET, arch=arch, cache=False)
        path = b.save(os.path.join(out_dir, f"{name}.cuvil"))
        return {"path": path, "kernels": b.manifest["kernels"], "compile_s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}


def _compile_node(name: str, model_bytes: bytes, inputs, out_dir: str, arch: str):
    """The case compiled as cuvil.onnx_backend would (value-deciding inputs frozen, symbols bound from the
    inputs), without ptxas (the bundle's PTX is JIT-compiled by the driver)."""
    import onnx
    import cuvil.targets.ptx.bundle as bundle_mod
    from cuvil import Pipeline
    from cuvil.onnx_backend import CuvilBackendRep, _freeze_inputs, value_specialized_inputs
    saved, bundle_mod.find_ptxas = bundle_mod.find_ptxas, (lambda: None)
    try:
        model = onnx.ModelProto()
        model.ParseFromString(model_bytes)
        inits = {t.name for t in model.graph.initializer}
        names = [vi.name for vi in model.graph.input if vi.name not in inits]
        feeds = dict(zip(names, inputs))
        frozen = {n: feeds[n] for n in value_specialized_inputs(model)}
        m = _freeze_inputs(model, frozen) if frozen else model
        p = Pipeline.from_onnx(m).optimize()
        env = CuvilBackendRep._bind_symbols(p.graph, feeds)
        b = p.compile(TARGET, arch=arch, fixed=env, cache=False)
        path = b.save(os.path.join(out_dir, f"{name}.cuvil"))
        return {"path": path, "kernels": b.manifest["kernels"], "feeds": [n for n in names if n not in frozen]}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    finally:
        bundle_mod.find_ptxas = saved


# --- comparing ---------------------------------------------------------------------------------------------

def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    if got.shape != ref.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    if got.dtype.kind in "biu" or ref.dtype.kind in "biu":
        return 0.0 if np.array_equal(got, ref) else float("inf")
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(r)):
        return float("inf")
    ok = ~np.isnan(r)
    if not ok.any():
        return 0.0
    return float(np.max(np.abs(g[ok] - r[ok])) / max(np.max(np.abs(r[ok])), 1e-30))


def _ort(model, feeds):
    from cuvil.testing.oracles import ort_session
    return ort_session(model).run(None, feeds)


def run_gpu(path: str, args):
    from cuvil.targets.ptx.runtime import load_bundle
    with load_bundle(path) as m:
        t0 = time.perf_counter()
        graph = m.run(*args)
        first = time.perf_counter() - t0
        eager = m.run(*args, mode="eager")
        same = all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f") for a, b in zip(graph, eager))
        return graph, same, m.module_source, first


def check_light(names, out_dir, arch, pool):
    from cuvil.testing import light_model
    futs = {n: pool.submit(_compile_light, n, out_dir, arch) for n in names}
    rows = []
    for n in names:
        built = futs[n].result()
        row = {"case": n, "kind": "light"}
        if "error" in built:
            rows.append({**row, "status": "compile error", "detail": built["error"]})
            continue
        model = light_model(n)
        rng = np.random.default_rng(1)
        inits = {t.name for t in model.graph.initializer}
        feeds = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
                 for vi in model.graph.input if vi.name not in inits}
        try:
            ref = _ort(model, feeds)
            got, same, source, first = run_gpu(built["path"], list(feeds.values()))
            err = max(rel_error(a, b) for a, b in zip(got, ref))
            status = "pass" if err <= RTOL and same else ("graph!=eager" if not same else "mismatch")
            rows.append({**row, "status": status, "rel_err": err, "kernels": built["kernels"], "oracle": "onnxruntime",
                         "module": source, "compile_s": round(built["compile_s"], 1), "first_run_s": round(first, 3)})
        except Exception as e:  # noqa: BLE001
            rows.append({**row, "status": "run error", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
        finally:
            import shutil
            shutil.rmtree(built["path"], ignore_errors=True)
        print(_fmt(rows[-1]), flush=True)
    return rows


def node_sample(k: int):
    """Every k-th of the cases the x86 backend passes (sorted by name): a deterministic spread over ops."""
    with open(os.path.join(ROOT, "tests", "conformance_expected_pass.txt")) as f:
        names = sorted(ln.strip() for ln in f if ln.strip() and not ln.startswith("#"))
    return names[::k] if k > 0 else []


def node_names():
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return [c.name for c in collect_testcases(None)]


def check_nodes(names, out_dir, arch, pool):
    import onnx
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = {c.name: c for c in collect_testcases(None)}
    names = [n for n in names if n in cases]

    def arrays(xs):   # cases that keep their data as TensorProto (float8, int4, ... casts): numpy, as onnx's runner
        return [onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x) for x in xs]
    futs = {}
    for n in names:
        c = cases[n]
        inputs = arrays(c.data_sets[0][0])
        futs[n] = pool.submit(_compile_node, n, c.model.SerializeToString(), list(inputs), out_dir, arch)
    rows = []
    for n in names:
        c = cases[n]
        inputs, expected = arrays(c.data_sets[0][0]), arrays(c.data_sets[0][1])
        built = futs[n].result()
        row = {"case": n, "kind": "node"}
        if "error" in built:
            rows.append({**row, "status": "compile error", "detail": built["error"]})
            print(_fmt(rows[-1]), flush=True)
            continue
        model = c.model
        inits = {t.name for t in model.graph.initializer}
        all_names = [vi.name for vi in model.graph.input if vi.name not in inits]
        feeds = dict(zip(all_names, inputs))
        try:
            try:
                ref, oracle = _ort(model, feeds), "onnxruntime"
            except Exception:  # noqa: BLE001 - onnxruntime lacks the op or opset: onnx's expected outputs
                ref, oracle = expected, "onnx expected"
            got, same, source, _ = run_gpu(built["path"], [feeds[k] for k in built["feeds"]])
            errs = [rel_error(a, np.asarray(b)) for a, b in zip(got, ref)]
            err = max(errs) if errs else 0.0
            status = "pass" if err <= RTOL and same and len(got) == len(ref) else ("graph!=eager" if not same else "mismatch")
            rows.append({**row, "status": status, "rel_err": err, "kernels": built["kernels"], "oracle": oracle,
                         "module": source})
        except Exception as e:  # noqa: BLE001
            rows.append({**row, "status": "run error", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r) -> str:
    err = r.get("rel_err")
    err_s = "" if err is None else ("inf" if err == float("inf") else f"{err:.2e}")
    return (f"{r['kind']:5} {r['case']:44} {r['status']:13} {err_s:>9} {r.get('kernels', ''):>4} "
            f"{r.get('oracle', ''):14} {r.get('module', '')}" + (f"  {r['detail']}" if r.get("detail") else ""))


def main(argv=None) -> int:
    from cuvil.targets.ptx.runtime import device_info
    from cuvil.testing import LIGHT_MODELS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(LIGHT_MODELS))
    ap.add_argument("--node-sample", type=int, default=15, help="every k-th passing node case (0: none)")
    ap.add_argument("--node-match", help="also every node case whose name matches this regular expression")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    info = device_info(0)
    print(f"device: {info['name']} ({info['arch']}, driver CUDA {info['driver_cuda_version']})", flush=True)
    out_dir = tempfile.mkdtemp(prefix="cuvil-gpu-check-")
    t0 = time.perf_counter()
    import multiprocessing as mp
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
        print(f"{'kind':5} {'case':44} {'status':13} {'rel.err':>9} {'krn':>4} {'oracle':14} module", flush=True)
        rows = check_light(args.models, out_dir, info["arch"], pool)
        names = node_sample(args.node_sample)
        if args.node_match:
            names += [n for n in node_names() if re.search(args.node_match, n) and n not in names]
        rows += check_nodes(names, out_dir, info["arch"], pool)
    summary = {}
    for r in rows:
        summary.setdefault(r["kind"], {}).setdefault(r["status"], 0)
        summary[r["kind"]][r["status"]] += 1
    print(f"\nsummary ({time.perf_counter() - t0:.0f} s): " + "; ".join(
        f"{k}: " + ", ".join(f"{v} {s}" for s, v in sorted(d.items())) for k, d in summary.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": info, "rtol": RTOL, "rows": rows, "summary": summary}, f, indent=1, default=str)
    bad = [r for r in rows if r["status"] not in ("pass", "compile error")]
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)
