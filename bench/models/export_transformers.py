"""BERT-base and the GPT-2 (124M) decode step with a KV cache, exported by torch.onnx at full size with random
weights (transformers' default configs), for ``bench/run_all.py --bert-model ... --gpt2-model ...``.

Needs torch and transformers (the GPU machine has both; nothing runs on the GPU). It runs the project's
exporter, ``scripts/export_transformers.py --size full`` (both exporters: TorchScript, opset 17, and dynamo,
opset 18; symbolic batch and sequence / past dims; each export checked against torch with onnxruntime at two
shapes; weights in ``DIR/*.onnx.data``), for the two benchmark models only, and prints the run_all command::

    python3 bench/models/export_transformers.py --out DIR
    python3 bench/run_all.py --section transformer --bert-model DIR/bert.torchscript.onnx \\
        --gpt2-model DIR/gpt2_decode.torchscript.onnx

Without torch, run_all builds the same architectures itself (``cuvil.testing.hf_models``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("bert", "gpt2_decode")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a folder for the .onnx files, their .data and exports.json")
    ap.add_argument("--exporter", choices=("torchscript", "dynamo", "both"), default="both",
                    help="which torch.onnx exporter(s) (default both; torchscript alone takes seconds)")
    ap.add_argument("--only", nargs="+", choices=MODELS, default=list(MODELS))
    a = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"export_transformers: {e.name} is not installed; this script needs torch and transformers.\n"
              "next: run it where they are (pip install torch transformers), or run bench/run_all.py without "
              "--bert-model/--gpt2-model: it builds the same models", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("export_transformers",
                                                  os.path.join(ROOT, "scripts", "export_transformers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if a.exporter != "both":         # the script exports with both: keep its loop, with one exporter
        real = mod._export
        skip = a.exporter == "torchscript"

        def one(module, args, path, input_names, output_names, dyn, dynamo):
            if dynamo == skip:
                raise RuntimeError(f"skipped (--exporter {a.exporter})")
            return real(module, args, path, input_names, output_names, dyn, dynamo)
        mod._export = one
    rc = mod.main(["--out", a.out, "--size", "full", "--only", *a.only])
    index = os.path.join(a.out, "exports.json")
    with open(index) as f:
        records = json.load(f)
    if a.exporter != "both":                      # the skipped exporter's entries are no failures
        records = [r for r in records if r["exporter"] == a.exporter]
        with open(index, "w") as f:
            json.dump(records, f, indent=1)
        rc = 0 if all(r["status"] == "ok" for r in records) else 1
    for r in records:
        print(f"{r['file']}: {r['status']} {r.get('ort_vs_torch_rel_err', r.get('error', ''))}"[:300])
    ok = {r["model"]: r["file"] for r in records if r["status"] == "ok"
          and r["exporter"] == ("dynamo" if a.exporter == "dynamo" else "torchscript")}
    flags = {"bert": "--bert-model", "gpt2_decode": "--gpt2-model"}
    if ok:
        print("next: python3 bench/run_all.py --section transformer --transformers " + " ".join(ok) + " "
              + " ".join(f"{flags[m]} {os.path.join(a.out, f)}" for m, f in ok.items()))
    return rc


if __name__ == "__main__":
    sys.exit(main())
