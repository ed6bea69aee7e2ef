"""What a verified load costs: cuvil.load(path) against cuvil.load(path, verify=PUB), side by side in one process.

    PYTHONPATH=src python3 bench/verified_load.py                 # squeezenet (light model, random weights)
    PYTHONPATH=src python3 bench/verified_load.py --model resnet50 --reps 5

The model is compiled once, saved and signed; each repetition copies the signed artifact into a fresh folder
(a new path, so dlopen maps it anew rather than returning the library already loaded), then times, in
alternating order, a plain load and a verified load (read every file once, SHA-256 them, check the ECDSA
signature, copy the library into a sealed memfd, dlopen it), each followed by a first run and a second run.
Medians over the repetitions, and verified / plain ratios. The files come from the page cache in both cases
(they were just copied): this measures the checking and the copy, not a cold disk.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import cuvil
from cuvil import Pipeline
from cuvil.signing import artifact_files, verify_artifact
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.models import LIGHT_MODELS, light_model


def _copy(src_so: str, folder: str) -> str:
    os.makedirs(folder)
    for name, path in artifact_files(src_so).items():
        shutil.copyfile(path, os.path.join(folder, name))
    shutil.copyfile(os.path.splitext(src_so)[0] + ".sig", os.path.join(folder, os.path.basename(src_so)[:-3] + ".sig"))
    return os.path.join(folder, os.path.basename(src_so))


def _timed_load(so: str, x, pub=None) -> dict:
    t0 = time.perf_counter()
    m = cuvil.load(so, verify=pub) if pub else cuvil.load(so)
    t1 = time.perf_counter()
    m.run(x)
    t2 = time.perf_counter()
    m.run(x)
    t3 = time.perf_counter()
    return {"load": t1 - t0, "first_run": t2 - t1, "second_run": t3 - t2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="squeezenet", help=f"a light model ({', '.join(LIGHT_MODELS)}) or an .onnx path")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    model = args.model if args.model.endswith(".onnx") else light_model(args.model)
    work = tempfile.mkdtemp(prefix="cuvil-verified-load-")
    try:
        p = Pipeline.from_onnx(model) if not isinstance(model, str) else Pipeline.from_file(model)
        so = p.compile(fixed={s: 1 for s in p.graph.symbols} or None).save(os.path.join(work, "src", "libm.so"))
        cuvil.keygen(os.path.join(work, "key.pem"), os.path.join(work, "pub.pem"))
        cuvil.sign(so, os.path.join(work, "key.pem"))
        pub = os.path.join(work, "pub.pem")
        m0 = cuvil.load(so, num_threads=args.threads)
        x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in m0.inputs[0].shape]
                                                     ).astype(np.float32)
        size = sum(os.path.getsize(f) for f in artifact_files(so).values())
        rows = {"plain": [], "verified": [], "verify_only": []}
        for k in range(args.reps):
            order = ("plain", "verified") if k % 2 == 0 else ("verified", "plain")
            for kind in order:
                copy = _copy(so, os.path.join(work, f"{k}-{kind}"))
                rows[kind].append(_timed_load(copy, x, pub if kind == "verified" else None))
            copy = _copy(so, os.path.join(work, f"{k}-v"))
            t0 = time.perf_counter()
            verify_artifact(copy, pub)
            rows["verify_only"].append({"load": time.perf_counter() - t0})
        med = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for kind, rs in rows.items()}
        print(f"verified load, {args.model}: artifact {size / 2**20:.1f} MiB in {len(artifact_files(so))} files, "
              f"{args.reps} reps, {args.threads} thread(s); CPU: {cpu_label()}")
        print(f"{'':12s} {'load ms':>9s} {'1st run ms':>11s} {'2nd run ms':>11s}")
        for kind in ("plain", "verified"):
            r = med[kind]
            print(f"{kind:12s} {1e3 * r['load']:9.2f} {1e3 * r['first_run']:11.2f} {1e3 * r['second_run']:11.2f}")
        print(f"{'ratio':12s} {med['verified']['load'] / med['plain']['load']:9.2f} "
              f"{med['verified']['first_run'] / med['plain']['first_run']:11.2f} "
              f"{med['verified']['second_run'] / med['plain']['second_run']:11.2f}   (verified / plain)")
        print(f"verify_artifact alone: {1e3 * med['verify_only']['load']:.2f} ms "
              f"({size / 2**20 / med['verify_only']['load']:.0f} MiB/s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
