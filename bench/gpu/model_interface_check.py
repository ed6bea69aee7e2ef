"""One model, two targets, one interface: a transformer export loaded from a GPU bundle and from an x86 library
answers the same calls with the same outputs (issue 27, "Two APIs for one idea").

    python3 bench/gpu/model_interface_check.py                       # BERT (torchscript export), B=2, S=16
    python3 bench/gpu/model_interface_check.py --model distilbert.dynamo --batch 1 --sequence 32 --json out.json

The export (tests/fixtures/exports/MODEL.onnx) is compiled twice: an x86 library over a profile that holds the
shape (batch 1..8, sequence 1..128) and a GPU bundle with batch and sequence fixed. Both are opened with
``cuvil.load`` and run with the dict of named inputs of the issue's failing case (``input_ids``,
``attention_mask``, ``token_type_ids`` where the model has it; row 0 half padded), then positionally, by keyword
and (GPU) eagerly. Checked: the same output names in the same order, a dict back for a dict call and a list
otherwise, every output within 1e-4 normwise (max|gpu - x86| / max|x86|) of the x86 library's, and the same
refusal (after the artifact's name) for an unknown input, a missing one and a wrong dtype. Exit status 0 when
all hold, 1 when one does not, 2 without a GPU (the bundle's input checks still run, up to the launch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "src"))

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "exports")
RTOL = 1e-4


def feeds_for(model, batch: int, seq: int) -> dict:
    """The named inputs a tokenizer would give: ids, a mask with row 0 half padded, zero token types."""
    rng = np.random.default_rng(0)
    names = [i.name for i in model.graph.input]
    feeds = {"input_ids": rng.integers(3, 512, (batch, seq)).astype(np.int64)}
    mask = np.ones((batch, seq), np.int64)
    mask[0, max(1, seq // 2):] = 0
    feeds["attention_mask"] = mask
    if "token_type_ids" in names:
        feeds["token_type_ids"] = np.zeros((batch, seq), np.int64)
    missing = sorted(set(names) - set(feeds))
    if missing:
        raise SystemExit(f"{model.graph.name}: inputs {missing} are not a tokenizer's; pick a BERT-like export")
    return feeds


def refusal(call) -> str:
    """The message of the ShapeError ``call`` raises, after the artifact's name."""
    from cuvil import ShapeError
    try:
        call()
    except ShapeError as e:
        return e.message.split(": ", 1)[1]
    return "(accepted)"


def normwise(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - want))) / scale


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert.torchscript", help="an export in tests/fixtures/exports (no .onnx)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--sequence", type=int, default=16)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    import onnx

    import cuvil
    from cuvil import Pipeline
    from cuvil.targets.ptx.runtime import NoGpuError, bundle_signature

    path = os.path.join(FIXTURES, args.model + ".onnx")
    model = onnx.load(path)
    feeds = feeds_for(model, args.batch, args.sequence)
    p = Pipeline.from_onnx(model).optimize()
    out_dir = tempfile.mkdtemp(prefix="cuvil-iface-")
    so = p.compile(shape_profiles={"batch": (1, args.batch, 8), "sequence": (1, args.sequence, 128)}).save(
        os.path.join(out_dir, "libmodel.so"))
    bundle = p.compile("nvptx64-nvidia-cuda", arch=args.arch, fixed={"batch": args.batch,
                                                                      "sequence": args.sequence}).save(
        os.path.join(out_dir, "model.cuvil"))
    results = {"model": args.model, "batch": args.batch, "sequence": args.sequence, "checks": {}}
    checks = results["checks"]
    bad_dtype = {**feeds, "input_ids": feeds["input_ids"].astype(np.int32)}
    no_mask = {k: v for k, v in feeds.items() if k != "attention_mask"}
    wrong_name = {**no_mask, "mask": feeds["attention_mask"]}

    cpu = cuvil.load(so)
    want = cpu.run(feeds)
    sig = bundle_signature(bundle)           # the GPU model's input checks, without a device
    for what, bad in (("unknown input", wrong_name), ("missing input", no_mask), ("wrong dtype", bad_dtype)):
        a = refusal(lambda: cpu.run(bad))
        b = refusal(lambda: sig.prepare((bad,), {}))
        checks[f"refusal: {what}"] = {"ok": a == b and a != "(accepted)", "x86": a, "gpu": b}
    prep = sig.prepare((feeds,), {})
    checks["gpu inputs prepared from the dict"] = {
        "ok": prep.as_dict and all(np.array_equal(x, feeds[d.name]) for x, d in zip(prep.arrays, sig.inputs))}
    checks["metadata of one form"] = {
        "ok": [(d.name, d.dtype) for d in cpu.inputs] == [(d.name, d.dtype) for d in sig.inputs]
        and [(d.name, d.dtype) for d in cpu.outputs] == [(d.name, d.dtype) for d in sig.outputs],
        "x86": [str(d) for d in cpu.inputs + cpu.outputs], "gpu": [str(d) for d in sig.inputs + sig.outputs]}

    try:
        gpu = cuvil.load(bundle)
    except NoGpuError as e:
        results["gpu"] = f"not run: {e}"
        gpu = None
    if gpu is not None:
        results["gpu"] = gpu.device["name"]
        got = gpu.run(feeds)
        checks["dict in, dict out, same names"] = {"ok": isinstance(got, dict) and list(got) == list(want),
                                                   "names": list(got)}
        for name in want:
            err = normwise(got[name], want[name])
            checks[f"output {name} (normwise vs x86)"] = {"ok": got[name].shape == want[name].shape and err <= RTOL,
                                                          "error": err}
        order = [d.name for d in gpu.inputs]
        for how, outs in (("positional", gpu.run(*[feeds[n] for n in order])), ("keywords", gpu.run(**feeds)),
                          ("eager", gpu.run(feeds, mode="eager"))):
            outs = list(outs.values()) if isinstance(outs, dict) else outs
            checks[f"{how} call"] = {"ok": all(np.array_equal(a, b) for a, b in zip(outs, got.values()))}
        for what, bad in (("unknown input", wrong_name), ("missing input", no_mask), ("wrong dtype", bad_dtype)):
            checks[f"loaded gpu refusal: {what}"] = {"ok": refusal(lambda: gpu.run(bad)) == checks[
                f"refusal: {what}"]["x86"]}
        gpu.close()
    cpu.close()

    for name, c in checks.items():
        detail = {k: v for k, v in c.items() if k != "ok"}
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}" + (f"  {json.dumps(detail, default=str)}" if detail else ""))
    print(f"gpu: {results['gpu']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    if not all(c["ok"] for c in checks.values()):
        return 1
    return 0 if gpu is not None else 2


if __name__ == "__main__":
    sys.exit(main())
