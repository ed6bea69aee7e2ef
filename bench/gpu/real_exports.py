"""The torch.onnx exports of ``tests/fixtures/exports/`` on the GPU (and x86) against onnxruntime's CPU provider.

    python3 bench/gpu/real_exports.py                          # B=1 at S=16 and 128, unpadded and padded
    python3 bench/gpu/real_exports.py --shapes 1x128 --targets gpu --json out.json

Each export is compiled with its symbols fixed to the shape (batch B, sequence S; a decode step's past length is
S), in worker processes, then run; the error is normwise per output, max|cuvil - ort| / max|ort|, and the
worst output is reported (pass at 1e-4 relative). "padded" sets the second half of row 0's attention mask to 0
(for a decode step, the first half of the cache), the case where exporters' mask arithmetic meets -inf/finfo.min.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "exports")
TARGETS = {"gpu": "nvptx64-nvidia-cuda", "x86": "x86_64-linux-gnu"}
RTOL = 1e-4


def feeds_for(path: str, b: int, s: int, padded: bool, seed: int = 0):
    """Inputs for an export, from the dims onnxruntime reports (symbol names as the exporters write them)."""
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    decode = any(i.name.startswith("past_key_values") for i in sess.get_inputs())
    dims = {"batch": b, "sequence": s, "past_sequence": s, "total_sequence": s + 1}
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else dims[d] for d in i.shape]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 512, shape).astype(np.int64)
        elif i.name == "attention_mask":
            m = np.ones(shape, np.int64)
            if padded:
                if decode:
                    m[0, : s // 2] = 0
                else:
                    m[0, max(1, s // 2):] = 0
            feeds[i.name] = m
        elif i.name == "token_type_ids":
            feeds[i.name] = np.zeros(shape, np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds, sess


def _compile(path: str, target: str, b: int, s: int, out_dir: str):
    from cuvil import Pipeline
    from cuvil.onnx_backend import CuvilBackendRep
    t0 = time.perf_counter()
    try:
        feeds, _ = feeds_for(path, b, s, False)
        p = Pipeline.from_onnx(path).optimize()
        fixed = CuvilBackendRep._bind_symbols(p.graph, feeds)
        art = p.compile(TARGETS[target], fixed=fixed, cache=False)
        name = os.path.basename(path).replace(".onnx", "").replace(".", "_") + f"_{b}x{s}"
        if target == "gpu":
            out = art.save(os.path.join(out_dir, name + ".cuvil"))
        else:
            out = art.path
        return {"path": out, "compile_s": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixtures", default=FIXTURES)
    ap.add_argument("--shapes", nargs="*", default=["1x16", "1x128"], help="BxS")
    ap.add_argument("--targets", nargs="*", default=["gpu", "x86"], choices=sorted(TARGETS))
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import cuvil
    paths = sorted(glob.glob(os.path.join(args.fixtures, "*.onnx")))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    jobs = [(p, t, b, s) for p in paths for t in args.targets for (b, s) in shapes]
    out_dir = tempfile.mkdtemp(prefix="cuvil-real-")
    with ProcessPoolExecutor(args.jobs) as ex:
        built = list(ex.map(_compile, *zip(*[(p, t, b, s, out_dir) for p, t, b, s in jobs])))
    rows = []
    for (path, target, b, s), res in zip(jobs, built):
        for padded in (False, True):
            row = {"model": os.path.basename(path), "target": target, "B": b, "S": s, "padded": padded}
            if "error" in res:
                row["error"] = res["error"]
            else:
                try:
                    feeds, sess = feeds_for(path, b, s, padded, seed=1)
                    want = sess.run(None, feeds)
                    m = cuvil.load(res["path"])
                    got = m.run(**{k: v for k, v in feeds.items() if k in [i.name for i in m.inputs]})
                    errs = [float(np.max(np.abs(g.astype(np.float64) - w)) / max(float(np.max(np.abs(w))), 1e-30))
                            for g, w in zip(got, want)]
                    row["rel_err"] = max(errs)
                    row["ok"] = bool(row["rel_err"] <= RTOL)
                    m.close()
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            rows.append(row)
            status = ("ok " if row.get("ok") else "BAD") if "rel_err" in row else "ERR"
            print(f"{status} {row['model']:34s} {target:4s} B={b} S={s:<4d} {'padded' if padded else 'full  '} "
                  f"{row.get('rel_err', row.get('error', ''))}", flush=True)
    ok = sum(1 for r in rows if r.get("ok"))
    print(f"{ok} of {len(rows)} right (rel err <= {RTOL})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
