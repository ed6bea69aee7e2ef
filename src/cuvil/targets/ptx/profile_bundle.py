"""One GPU bundle for a whole shape profile (issue 22): the graph with its profiled symbols is specialised
to every bucket point (:mod:`cuvil.targets.ptx.buckets`) and each is compiled ahead of time, by
:func:`~cuvil.targets.ptx.bundle.compile_bundle`, into a sub-directory of the one bundle; nothing compiles
at run time.

    NAME.cuvil/
      plan.json        format cuvil-gpu-plan/1 with "buckets": [{"point": {"N": 8}, "dir": "b3",
                       "weights": "weights.bin"}, ...], "profile" (per symbol: range, buckets, paddable),
                       the inputs/outputs with their dims (ints or symbol names), the largest arena
      weights.bin      the weights, once: every bucket's weights are the same bytes (checked; where a graph's
                       folded constants depend on a symbol, each distinct set is kept once, weights-K.bin)
      manifest.json    the opt bucket's manifest (its ptxas report, its memory-safety certificate) plus "profile", "graph_buckets" and per bucket its kernels,
                       arena and ptxas report
      b0/ b1/ ...      each bucket's kernels.ptx, kernels.<arch>.cubin, plan.json, manifest.json

The runtime (:mod:`cuvil.targets.ptx.runtime`) loads every bucket's module and shares one arena (the
largest), the weights, the staging buffers and the buffer-pointer table between them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Dict, List, Mapping

from ...errors import CuvilError, ShapeError
from ...ir.graph import Graph
from ...progress import stage
from ...rewrite_rules.specialize import specialize_graph
from ...precision.policy import merge_reconciled
from .buckets import BucketSpec, bucket_points, point_text, resolve_buckets
from .bundle import PLAN_FORMAT, compile_bundle
from ...kernels.batch_rows import batch_like


def _dims(v) -> list:
    return [d if isinstance(d, int) else str(d) for d in v.shape]


def profile_of(g: Graph, given: BucketSpec = None) -> dict:
    """The manifest's ``profile``: per profiled symbol its range, buckets and whether it may be padded (with
    the reason where not)."""
    profiles = {n: (s.min, s.tuned, s.max, s.multiple) for n, s in g.symbols.items()}
    buckets = resolve_buckets(profiles, given)
    out = {}
    for n, (lo, opt, hi, mult) in profiles.items():
        ok, why = batch_like(g, n)
        out[n] = {"min": lo, "opt": opt, "max": hi, "multiple": mult, "buckets": buckets[n], "paddable": ok}
        if not ok:
            out[n]["not_paddable"] = why
    return out


def _compile_point(job) -> dict:
    """One bucket point: ``g`` specialised to ``point`` and compiled into ``sub`` (a worker process's job)."""
    g, point, sub, options, precision = job
    try:
        gi, _ = specialize_graph(g, point)
    except ShapeError as e:
        # the buckets of several symbols combine as a product: a decode step's past and total lengths (total =
        # past + 1) make points such as past 1023 with a 129-long mask, which no call can have
        hint = (f"every combination of the buckets of {', '.join(point)} is compiled; give buckets whose every "
                "combination the model admits, or fix the symbols and compile a bundle per combination you need "
                "(--fix NAME=VALUE; Pipeline: fixed=)" if len(point) > 1 else
                "give --graph-buckets values the model admits")
        raise ShapeError(f"bucket point {point_text(point)}: {e.message}", hint=hint, details=e.details) from None
    # the precision plan goes with each point, whose build records what its kernels did not narrow (reconcile)
    extra = {"bucket": point, **({"precision": precision} if precision is not None else {})}
    return compile_bundle(gi, sub, manifest_extra=extra, **options)


def _compile_points_in_processes(g: Graph, points, subs, options, jobs: int, out_dir: str, precision) -> list:
    """Each bucket point compiled by a fresh interpreter (``python -m cuvil.targets.ptx.profile_bundle JOB``):
    nothing of the caller's process (its threads, its ``__main__``) is inherited; the graph is pickled once."""
    import concurrent.futures as cf
    import pickle
    import subprocess
    import sys
    import tempfile
    work = tempfile.mkdtemp(prefix=".buckets-", dir=out_dir)
    try:
        with open(os.path.join(work, "graph.pkl"), "wb") as f:
            pickle.dump(g, f, protocol=pickle.HIGHEST_PROTOCOL)
        env = dict(os.environ)
        # where the cuvil package is (a script may have put it on sys.path itself)
        src = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

        def one(i: int) -> dict:
            job = os.path.join(work, f"job{i}.pkl")
            with open(job, "wb") as f:
                pickle.dump((points[i], subs[i], options, precision), f, protocol=pickle.HIGHEST_PROTOCOL)
            r = subprocess.run([sys.executable, "-m", "cuvil.targets.ptx.profile_bundle", work, job], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip().splitlines()[-12:]
                raise CuvilError(f"compiling bucket {point_text(points[i])} failed:\n" + "\n".join(tail),
                                 hint="compile with jobs=1 to see the error in this process")
            with open(job + ".json") as f:
                return json.load(f)

        with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, range(len(points))))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _worker_main(work: str, job: str) -> None:
    import pickle
    with open(os.path.join(work, "graph.pkl"), "rb") as f:
        g = pickle.load(f)
    with open(job, "rb") as f:
        point, sub, options, precision = pickle.load(f)
    m = _compile_point((g, point, sub, options, precision))
    with open(job + ".json", "w") as f:
        json.dump(m, f)


def compile_profile_bundle(g: Graph, out_dir: str, *, graph_buckets: BucketSpec = None,
                           manifest_extra: Mapping = None, jobs: int = 1, **options) -> dict:
    """Compile ``g`` (its symbols profiled) into one bundle at ``out_dir`` holding a specialisation per bucket
    point; ``options`` as for :func:`compile_bundle`; ``jobs``: bucket points compiled at once, each in its own
    process (0: one per CPU). Buckets whose weights are the same bytes share one file (``weights.bin``; a
    bucket whose folded constants differ, e.g. a position table sliced to the sequence length, gets
    ``weights-K.bin``, uploaded once for all the buckets that have it). Returns the top manifest (with
    ``timings``)."""
    if not g.symbols:
        raise CuvilError("compile_profile_bundle: the graph has no symbols; compile_bundle builds it")
    profile = profile_of(g, graph_buckets)
    points = bucket_points({n: p["buckets"] for n, p in profile.items()})
    if len(points) > 64:
        raise CuvilError(f"{len(points)} bucket points (the product of "
                         + " x ".join(f"{len(p['buckets'])} {n}" for n, p in profile.items()) + "): too many to "
                         "compile ahead of time",
                         hint="fix the symbols that need not vary (--fix NAME=VALUE; Pipeline: fixed=), or give "
                         "fewer buckets: --graph-buckets " + ";".join(
                             f"{n}={p['opt']},{p['max']}" if p["opt"] < p["max"] else f"{n}={p['max']}"
                             for n, p in profile.items()))
    os.makedirs(out_dir, exist_ok=True)
    opt_point = {n: p["opt"] for n, p in profile.items()}
    precision = (manifest_extra or {}).get("precision")
    jobs = min(max(1, int(jobs) if jobs else (os.cpu_count() or 1)), len(points))
    subs = [os.path.join(out_dir, f"b{i}") for i in range(len(points))]
    if jobs > 1:
        with stage("buckets", detail=f"{len(points)} in {jobs} processes"):
            manifests = _compile_points_in_processes(g, points, subs, options, jobs, out_dir, precision)
    else:
        manifests = []
        for i, (point, sub) in enumerate(zip(points, subs)):
            with stage("bucket", detail=f"{i + 1}/{len(points)}: {point_text(point)}"):
                manifests.append(_compile_point((g, point, sub, options, precision)))
    entries, seconds = [], 0.0
    weights_of: Dict[str, str] = {}       # sha256 of a bucket's weights.bin -> the file it is kept as
    for i, (point, sub, m) in enumerate(zip(points, subs, manifests)):
        seconds += m.pop("timings", {}).get("compile_seconds", 0.0)
        with open(os.path.join(sub, "weights.bin"), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        entry = {"point": point, "dir": f"b{i}"}
        if sha not in weights_of:    # the first bucket with these bytes keeps them at the top, once
            weights_of[sha] = "weights.bin" if not weights_of else f"weights-{len(weights_of)}.bin"
            os.replace(os.path.join(sub, "weights.bin"), os.path.join(out_dir, weights_of[sha]))
        else:
            os.remove(os.path.join(sub, "weights.bin"))
        entry["weights"] = weights_of[sha]
        entries.append(entry)
    shared = len(weights_of) == 1
    plans = []
    for e in entries:
        with open(os.path.join(out_dir, e["dir"], "plan.json")) as f:
            plans.append(json.load(f))
    first = plans[-1]
    plan = {
        "format": PLAN_FORMAT,
        "arch": first["arch"],
        "arena_bytes": max(p["arena_bytes"] for p in plans),
        "weights_bytes": max(p["weights_bytes"] for p in plans),
        "buffers": first["buffers"],
        "kernels": [],
        "inputs": [{**d, "dims": _dims(v)} for d, v in zip(first["inputs"], g.inputs)],
        "outputs": [{**d, "dims": _dims(v)} for d, v in zip(first["outputs"], g.outputs)],
        "profile": profile,
        "buckets": entries,
    }
    with open(os.path.join(out_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
        f.write("\n")
    k = next((j for j, e in enumerate(entries) if e["point"] == opt_point), len(entries) - 1)
    base = dict(manifests[k])
    for key in ("bucket", "kernels", "arena_bytes", "splitk_scratch_bytes", "register_pass", "launch_graph"):
        base.pop(key, None)
    manifest = {
        **base,
        **merged_counts(manifests),
        "kernels": sum(m["kernels"] for m in manifests),
        "arena_bytes": plan["arena_bytes"],
        "weights_shared": shared,
        "profile": profile,
        "graph_buckets": {n: p["buckets"] for n, p in profile.items()},
        "buckets": [{"point": e["point"], "dir": e["dir"], "kernels": m["kernels"], "arena_bytes": m["arena_bytes"],
                     "tensor_core_kernels": m.get("tensor_core_kernels"), "launch_graph": m.get("launch_graph"),
                     "memory_safety": (m.get("memory_safety") or {}).get("summary"),
                     "ptxas": m.get("ptxas"), "register_pass": m.get("register_pass")}
                    for e, m in zip(entries, manifests)],
        **(manifest_extra or {}),
    }
    if precision is not None:     # narrowed only where every bucket's kernels narrowed it
        manifest["precision"] = merge_reconciled(precision, [(f"bucket {point_text(m['bucket'])}", m["precision"])
                                                             for m in manifests if "precision" in m])
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return {**manifest, "timings": {"compile_seconds": round(seconds, 3)}}


def merged_counts(manifests: List[dict]) -> dict:
    """The profile manifest's records that count over the whole bundle, every bucket's summed (each bucket's own
    manifest stays in its directory): kernels by tensor-core kind, rules applied, kernel rules fired, ops fused,
    float16 reductions widened, the memory-safety proof (each bucket's kernels, named with their bucket)."""
    out: dict = {}

    def add_counts(key):
        tot: Dict[str, int] = {}
        for m in manifests:
            for k, n in (m.get(key) or {}).items():
                tot[k] = tot.get(k, 0) + n
        if any(key in m for m in manifests):
            out[key] = dict(sorted(tot.items()))

    def add_rules(key):
        tot: Dict[str, dict] = {}
        for m in manifests:
            for name, r in (m.get(key) or {}).items():
                if name in tot:
                    tot[name]["applied"] = tot[name].get("applied", 0) + r.get("applied", 0)
                else:
                    tot[name] = dict(r)
        if any(key in m for m in manifests):
            out[key] = tot
    add_counts("tensor_core_kernels")
    add_counts("fused_ops")
    add_rules("rules_applied")
    add_rules("kernel_rules")
    if any("float16_reductions_widened" in m for m in manifests):
        out["float16_reductions_widened"] = sum(m.get("float16_reductions_widened", 0) for m in manifests)
    if any("float16_tensors" in m for m in manifests):
        out["float16_tensors"] = list(dict.fromkeys(t for m in manifests for t in m.get("float16_tensors") or ()))
    proofs = [(point_text(m["bucket"]) if m.get("bucket") else str(i), m["memory_safety"])
              for i, m in enumerate(manifests) if m.get("memory_safety")]
    if proofs:
        n = sum(ms["kernels"] for _, ms in proofs)
        ok = sum(ms["kernels_proved"] for _, ms in proofs)
        out["memory_safety"] = {
            "summary": f"{ok}/{n} kernels proved in bounds ({len(proofs)} buckets)", "kernels_proved": ok,
            "kernels": n, **{k: sum(ms.get(k, 0) for _, ms in proofs) for k in ("accesses", "z3_queries", "cache_hits")},
            "guarded": [{**k, "bucket": b} for b, ms in proofs for k in ms.get("guarded", ())],
            "per_kernel": [{**k, "bucket": b} for b, ms in proofs for k in ms.get("per_kernel", ())]}
    return out


def bucket_plans(path: str, plan: dict, read) -> Dict[str, dict]:
    """Each bucket's own plan (``read(name) -> bytes``), by its directory."""
    return {e["dir"]: json.loads(read(f"{e['dir']}/plan.json")) for e in plan["buckets"]}


__all__ = ["compile_profile_bundle", "profile_of", "bucket_plans"]

if __name__ == "__main__":      # one bucket point of compile_profile_bundle(..., jobs=N): see above
    import sys
    _worker_main(sys.argv[1], sys.argv[2])
