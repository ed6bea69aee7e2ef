"""LoRA merged at compile time (issue 23): the merged Cuvil library beside the model merged in numpy and run by
onnxruntime, on the torch exports of tests/fixtures/exports (both exporters), and the cost of the correctly
rounded merge at BERT-base size.

    PYTHONPATH=src python3 bench/lora_merge.py                 # every export, one adapter and two with weights
    PYTHONPATH=src python3 bench/lora_merge.py --exports bert.torchscript gpt2.dynamo --rank 8
    PYTHONPATH=src python3 bench/lora_merge.py --out bench/results/lora_merge.md   # also as a Markdown file

Per export: an adapter in PEFT's layout (random A, B: cuvil.testing.lora) of rank --rank on every Linear the
mapping finds (attention projections, MLP, pooler/lm_head), merged with ``Pipeline.with_lora``, compiled for
B = 2, S = 32 and run on token ids with a padded mask; the same adapter merged in numpy (float64, cast to
float32: cuvil.testing.lora.numpy_merged_model) and run by onnxruntime. The figure is max|Cuvil - ort| /
max|ort| over every output; beside it the adapter's effect (base vs merged, onnxruntime), which must be large
for the comparison to mean anything. Then a second run with two adapters (weights 0.5 and -1.0).
The goal row: "merged library vs numpy-merged onnxruntime: max rel err" (goal <= 1e-5).
"""
from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from cuvil import Pipeline
from cuvil.lora.rounding import round_exact_sum
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing.lora import model_modules, numpy_merged_model, write_peft_adapter
from cuvil.testing.oracles import max_rel_error, ort_session

ROOT = Path(__file__).resolve().parent.parent
EXPORTS = ROOT / "tests" / "fixtures" / "exports"
GOAL = 1e-5


def feeds(model, batch=2, seq=32, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        dims = [d.dim_value or {"batch": batch}.get(d.dim_param, seq) for d in vi.type.tensor_type.shape.dim]
        et = vi.type.tensor_type.elem_type
        if et == onnx.TensorProto.FLOAT:
            out[vi.name] = rng.standard_normal(dims).astype(np.float32)
        elif "mask" in vi.name:
            m = np.ones(dims, np.int64)
            m[0, dims[1] // 2:] = 0
            out[vi.name] = m
        else:
            out[vi.name] = rng.integers(0, 2 if "type" in vi.name else 512, dims).astype(np.int64)
    return out


def one(name: str, rank: int, tmp: Path):
    model = onnx.load(EXPORTS / f"{name}.onnx")
    if any(d.dim_param == "past_sequence" for vi in model.graph.input for d in vi.type.tensor_type.shape.dim):
        return None   # the decode-step exports need a KV cache: same weights as the prefill ones
    mods = model_modules(model)
    d1 = write_peft_adapter(tmp / f"{name}.a1", mods, r=rank, lora_alpha=2 * rank, seed=1, scale_b=0.05)
    d2 = write_peft_adapter(tmp / f"{name}.a2", mods, r=max(1, rank // 2), lora_alpha=rank, seed=2, scale_b=0.05)
    f = feeds(model)
    base = ort_session(model).run(None, f)
    rows = []
    for label, specs in (("1 adapter", [(d1, 1.0)]), ("2 adapters (0.5, -1.0)", [(d1, 0.5), (d2, -1.0)])):
        t0 = time.perf_counter()
        p = Pipeline.from_onnx(model)
        for d, w in specs:
            p = p.with_lora(d, w)
        t_merge = time.perf_counter() - t0
        lib = p.optimize().compile(fixed={k: v for k, v in {"batch": 2, "sequence": 32}.items() if k in p.graph.symbols})
        got = lib.run(f)
        want = ort_session(numpy_merged_model(model, specs)).run(None, f)
        err = max(max_rel_error(got[o.name], w) for o, w in zip(model.graph.output, want))
        effect = min(max_rel_error(b, w) for b, w in zip(base, want))
        exact = sum(r["exact_decisions"] for r in p.lora_records)
        rows.append((name, label, len(p.lora_records), err, effect, t_merge, exact))
    return rows


def merge_cost(rank: int):
    """The correctly rounded merge of BERT-base's q/k/v/o (48 weights 768x768) at ``rank``."""
    rng = np.random.default_rng(0)
    total, exact = 0.0, 0
    for _ in range(48):
        w = (rng.standard_normal((768, 768)) * 0.02).astype(np.float32)
        a = (rng.standard_normal((768, rank)) / np.sqrt(768)).astype(np.float32)
        b = (rng.standard_normal((rank, 768)) * 0.01).astype(np.float32)
        s = np.full(rank, 2.0, np.float32)
        t0 = time.perf_counter()
        _, n = round_exact_sum(w, a, s, b, "float32")
        total += time.perf_counter() - t0
        exact += n
    return total, exact


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exports", nargs="*", default=None, help="fixture stems (default: every prefill export)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", default=None, help="also write the report to this Markdown file")
    args = ap.parse_args()
    lines = []

    def emit(line=""):   # the report goes to stdout and, with --out, to the file
        lines.append(line)
        print(line, flush=True)

    names = args.exports or sorted(p.name[:-5] for p in EXPORTS.glob("*.onnx"))
    emit(f"# LoRA merge, {datetime.date.today()}, {cpu_label()}, rank {args.rank}")
    emit(f"{'export':28} {'adapters':24} {'weights':>7} {'max rel err':>11} {'effect':>8} {'merge s':>8} {'exact':>5}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for row in one(name, args.rank, Path(tmp)) or ():
                worst = max(worst, row[3])
                emit(f"{row[0]:28} {row[1]:24} {row[2]:>7} {row[3]:>11.2e} {row[4]:>8.2f} {row[5]:>8.2f} {row[6]:>5}")
    secs, exact = merge_cost(args.rank)
    emit(f"correctly rounded merge, BERT-base q/k/v/o (48 x 768x768), rank {args.rank}: {secs:.2f} s "
          f"({exact} elements decided in rational arithmetic)")
    emit(f"merged library vs numpy-merged onnxruntime: max rel err {worst:.2e} (goal <= {GOAL:g}: "
          f"{'MET' if worst <= GOAL else 'NOT MET'}) on {cpu_label()}")
    if args.out:
        Path(args.out).write_text(lines[0] + "\n\n`PYTHONPATH=src python3 bench/lora_merge.py`\n\n```text\n"
                                  + "\n".join(lines[1:]) + "\n```\n")


if __name__ == "__main__":
    main()
