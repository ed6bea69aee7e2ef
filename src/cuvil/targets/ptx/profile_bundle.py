"""One GPU bundle for a whole shape profile (issue 22): the graph with its profiled symbols is specialised
to every bucket point (:mod:`cuvil.targets.ptx.buckets`) and each is compiled ahead of time, by
:func:`~cuvil.targets.ptx.bundle.compile_bundle`, into a sub-directory of the one bundle; nothing compiles
at run time.

    NAME.cuvil/
      plan.json        format cuvil-gpu-plan/1 with "buckets": [{"point": {"N": 8}, "dir": "b3",
                       "weights": "weights.bin"}, ...], "profile" (per symbol: range, buckets, paddable),
                       the inputs/outputs with their dims (ints or symbol names), the largest arena
      weights.bin      the weights, once: every bucket's weights are the same bytes (checked; a graph whose
                       constants depend on a symbol keeps a weights.bin per bucket instead)
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
from typing import Dict, Mapping

from ...errors import CuvilError
from ...ir.graph import Graph
from ...progress import stage
from ...rewrite_rules.specialize import specialize_graph
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


def compile_profile_bundle(g: Graph, out_dir: str, *, graph_buckets: BucketSpec = None,
                           manifest_extra: Mapping = None, **options) -> dict:
    """Compile ``g`` (its symbols profiled) into one bundle at ``out_dir`` holding a specialisation per bucket
    point; ``options`` as for :func:`compile_bundle`. Returns the top manifest (with ``timings``)."""
    if not g.symbols:
        raise CuvilError("compile_profile_bundle: the graph has no symbols; compile_bundle builds it")
    profile = profile_of(g, graph_buckets)
    points = bucket_points({n: p["buckets"] for n, p in profile.items()})
    if len(points) > 64:
        raise CuvilError(f"{len(points)} bucket points (the product of "
                         + " x ".join(f"{len(p['buckets'])} {n}" for n, p in profile.items()) + "): too many to "
                         "compile ahead of time", hint="give fewer buckets: --graph-buckets N=1,8,64;H=256,1024")
    os.makedirs(out_dir, exist_ok=True)
    opt_point = {n: p["opt"] for n, p in profile.items()}
    entries, manifests, seconds = [], [], 0.0
    weights_sha = set()
    for i, point in enumerate(points):
        sub = os.path.join(out_dir, f"b{i}")
        with stage("bucket", detail=f"{i + 1}/{len(points)}: {point_text(point)}"):
            gi, _ = specialize_graph(g, point)
            m = compile_bundle(gi, sub, manifest_extra={"bucket": point}, **options)
        seconds += m.pop("timings", {}).get("compile_seconds", 0.0)
        with open(os.path.join(sub, "weights.bin"), "rb") as f:
            weights_sha.add(hashlib.sha256(f.read()).hexdigest())
        manifests.append(m)
        entries.append({"point": point, "dir": f"b{i}"})
    shared = len(weights_sha) == 1
    if shared:   # one copy of the weights for every bucket
        os.replace(os.path.join(out_dir, "b0", "weights.bin"), os.path.join(out_dir, "weights.bin"))
        for e in entries[1:]:
            os.remove(os.path.join(out_dir, e["dir"], "weights.bin"))
    else:
        shutil.copyfile(os.path.join(out_dir, "b0", "weights.bin"), os.path.join(out_dir, "weights.bin"))
    plans = []
    for e in entries:
        e["weights"] = "weights.bin" if shared else f"{e['dir']}/weights.bin"
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
    for key in ("bucket", "kernels", "arena_bytes", "splitk_scratch_bytes", "register_pass"):
        base.pop(key, None)
    manifest = {
        **base,
        "kernels": sum(m["kernels"] for m in manifests),
        "arena_bytes": plan["arena_bytes"],
        "weights_shared": shared,
        "profile": profile,
        "graph_buckets": {n: p["buckets"] for n, p in profile.items()},
        "buckets": [{"point": e["point"], "dir": e["dir"], "kernels": m["kernels"], "arena_bytes": m["arena_bytes"],
                     "ptxas": m.get("ptxas"), "register_pass": m.get("register_pass")}
                    for e, m in zip(entries, manifests)],
        **(manifest_extra or {}),
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return {**manifest, "timings": {"compile_seconds": round(seconds, 3)}}


def bucket_plans(path: str, plan: dict, read) -> Dict[str, dict]:
    """Each bucket's own plan (``read(name) -> bytes``), by its directory."""
    return {e["dir"]: json.loads(read(f"{e['dir']}/plan.json")) for e in plan["buckets"]}


__all__ = ["compile_profile_bundle", "profile_of", "bucket_plans"]
