"""Accuracy of low precision against float32 on real inputs (issue 21, part 6): relative error and top-1 /
top-5 agreement of the CNNs on >= 1,000 real images, cosine similarity of BERT's pooled output on real text.

    PYTHONPATH=src python3 bench/precision_accuracy.py                         # the four CNNs + BERT, 1000 images
    PYTHONPATH=src python3 bench/precision_accuracy.py --models squeezenet --n 200 --no-bert
    PYTHONPATH=src python3 bench/precision_accuracy.py --out bench/results/precision_accuracy.json

Inputs (installable, nothing downloaded at run time):
* images: the photographs that ship inside scikit-image's wheel (``skimage/data``: astronaut, chelsea, coffee,
  rocket, motorcycle left/right, hubble deep field, retina, ...; greyscale ones repeated over 3 channels), each
  cut into random crops (20-100 % of the side, random aspect 3/4-4/3, random horizontal flip) resized to
  224x224 and normalised as ImageNet's (mean 0.485/0.456/0.406, std 0.229/0.224/0.225), seeded: --n inputs in
  all. ``pip install scikit-image`` (the ``bench`` extra).
* text: sentences of the docstrings of Python's own standard library (real English prose that ships with every
  Python), as token ids by a stable hash of each lower-cased word into the model's vocabulary (no tokenizer
  is installable offline; the words and their order are real, the ids are not BERT's WordPiece ones).

Models: the CNNs of ``cuvil zoo`` (onnx's light ResNet-50, DenseNet-121, Inception-v1, SqueezeNet: the real
architectures with seeded random weights, He-initialised, BatchNorm scales in [0.5, 1.5]; no pretrained weights
can be fetched here), and the BERT export of tests/fixtures/exports (a small random-initialised BERT).

What is measured: Cuvil's optimised graph (import, proved rewrites) exported to ONNX and run by onnxruntime in
float32 (the reference), and the same graph with the narrowing *simulated*: for every node the precision
policy narrows (Conv/MatMul/Gemm offered in the format, the input box declared as the normalised image range),
its activation input is rounded to the format (a Cast to bf16/fp16 and back) and its weights are rounded once;
it accumulates in float32, as the kernels will. ``<fmt>-all`` rounds every contraction whatever the proof says:
what the policy protects from. --cuvil also runs the compiled libraries: float32 and bf16 (where the CPU has the
kernels), and where the bf16 build's 3x3 convolutions took Winograd F(2x2) (a CPU without AMX) the direct bf16
build beside it ("bf16 direct (cuvil)", X86Tuning(bf16_winograd=False)).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import re
import sys
import time
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.frontend import export_model
from cuvil.precision import plan_precision
from cuvil.targets.x86.cpu import cpu_label
from cuvil.targets.x86.tuning import X86Tuning
from cuvil.testing.zoo import zoo_model

ROOT = Path(__file__).resolve().parent.parent
CNNS = ("squeezenet", "inception_v1", "resnet50", "densenet121")
CONTRACTIONS = frozenset({"Conv", "MatMul", "Gemm"})
MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png", "motorcycle_right.png",
          "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "color.png", "brick.png", "grass.png", "gravel.png",
          "camera.png", "moon.png", "coins.png", "page.png", "cell.png", "clock_motion.png", "microaneurysms.png",
          "text.png", "logo.png")
CAST_TO = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16, "fp8": TensorProto.FLOAT8E4M3FN}
NUMPY_OF = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8": ml_dtypes.float8_e4m3fn}


# ------------------------------------------------------------------------------------------------ inputs
def photos():
    import skimage
    from skimage import io
    d = Path(skimage.__file__).parent / "data"
    out = []
    for name in PHOTOS:
        if not (d / name).exists():
            continue
        img = np.asarray(io.imread(d / name)).astype(np.float32)
        if img.ndim == 2:
            img = np.stack([img] * 3, -1)
        img = img[..., :3]
        img = img / (255.0 if img.max() > 1.5 else 1.0)
        if min(img.shape[:2]) >= 64:
            out.append((name, img))
    return out


def image_inputs(n: int, seed: int = 0):
    """n normalised 224x224 crops of the photos, [n, 3, 224, 224] float32, and which photo each came from."""
    from skimage.transform import resize
    rng = np.random.default_rng(seed)
    pics = photos()
    xs, src = np.empty((n, 3, 224, 224), np.float32), []
    for i in range(n):
        name, img = pics[i % len(pics)]
        h, w = img.shape[:2]
        side = rng.uniform(0.2, 1.0) * min(h, w)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        ch, cw = int(min(h, side * np.sqrt(aspect))), int(min(w, side / np.sqrt(aspect)))
        y0, x0 = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        crop = img[y0:y0 + ch, x0:x0 + cw]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = resize(crop, (224, 224), anti_aliasing=True).astype(np.float32)
        xs[i] = (np.clip(crop, 0, 1).transpose(2, 0, 1) - MEAN) / STD
        src.append(name)
    return xs, src, [p[0] for p in pics]


def text_sentences(n: int):
    """n sentences of the standard library's docstrings (modules' and their functions'), in a fixed order."""
    import importlib
    mods = ["os", "json", "re", "inspect", "argparse", "collections", "functools", "itertools", "pathlib", "shutil",
            "subprocess", "textwrap", "threading", "datetime", "decimal", "fractions", "statistics", "random",
            "string", "heapq", "bisect", "email", "http.client", "urllib.parse", "logging", "unittest", "csv",
            "zipfile", "tarfile", "tempfile", "difflib", "pickle", "sqlite3", "typing", "dataclasses", "enum"]
    out = []
    for name in mods:
        try:
            m = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(m) or ""] + [inspect.getdoc(o) or "" for _, o in sorted(vars(m).items())
                                            if callable(o) and not _.startswith("_")]
        for doc in docs:
            for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 6 <= len(s.split()) <= 60:
                    out.append(s)
    return out[:n]


def token_ids(sentence: str, vocab: int, seq: int):
    words = re.findall(r"[a-z0-9]+|[^\sa-z0-9]", sentence.lower())
    ids = [101] + [1000 + zlib.crc32(w.encode()) % (vocab - 1000) for w in words][:seq - 2] + [102]
    ids = [i % vocab for i in ids]
    mask = [1] * len(ids) + [0] * (seq - len(ids))
    return np.array(ids + [0] * (seq - len(ids)), np.int64), np.array(mask, np.int64)


# ------------------------------------------------------------------------------------------ the simulation
def narrowed_model(graph, formats: dict, scales: dict = None) -> onnx.ModelProto:
    """``graph`` exported, with each node of ``formats`` (name -> bf16/fp16/fp8) reading its activation rounded to
    the format and its weight rounded once; float32 everywhere else. fp8 (E4M3) takes ``scales`` (name -> the
    policy's exponents per input, ``Node.precision_scales``): the input is multiplied by ``2^-e``, rounded
    (``Cast`` to float8e4m3fn, saturating; ml_dtypes for the weights) and multiplied back by ``2^e``: what the
    GPU's fp8 products read."""
    m = export_model(graph)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    new_nodes = []
    scales = scales or {}
    for node in g.node:
        fmt = formats.get(node.name)
        if fmt:
            for i in (0, 1):
                if i >= len(node.input) or not node.input[i]:
                    continue
                name = node.input[i]
                e = scales.get(node.name, (0, 0))[i] if fmt == "fp8" else 0
                if name in inits:
                    w = numpy_helper.to_array(inits[name]).astype(np.float32)
                    with np.errstate(over="ignore"):
                        ws = w * np.float32(2.0 ** -e)
                        if fmt == "fp8":     # the GPU's conversion saturates (satfinite); ml_dtypes' gives NaN
                            ws = np.clip(ws, -448.0, 448.0)
                        r = ws.astype(NUMPY_OF[fmt]).astype(np.float32) * np.float32(2.0 ** e)
                    rn = f"{name}__{node.name}__{fmt}"
                    if rn not in inits:
                        inits[rn] = numpy_helper.from_array(r, rn)
                        g.initializer.append(inits[rn])
                    node.input[i] = rn
                else:
                    src = name
                    pre = f"{name}__{node.name}__{fmt}"
                    if e:
                        for c, v in ((f"{pre}_down", 2.0 ** -e), (f"{pre}_up", 2.0 ** e)):
                            g.initializer.append(numpy_helper.from_array(np.array(v, np.float32), c))
                        new_nodes.append(helper.make_node("Mul", [name, f"{pre}_down"], [f"{pre}_s"]))
                        src = f"{pre}_s"
                    extra = {"saturate": 1} if fmt == "fp8" else {}
                    new_nodes.append(helper.make_node("Cast", [src], [pre], to=CAST_TO[fmt], **extra))
                    new_nodes.append(helper.make_node("Cast", [pre], [f"{pre}_f32"], to=TensorProto.FLOAT))
                    back = f"{pre}_f32"
                    if e:
                        new_nodes.append(helper.make_node("Mul", [back, f"{pre}_up"], [f"{pre}_u"]))
                        back = f"{pre}_u"
                    node.input[i] = back
        new_nodes.append(node)
    del g.node[:]
    g.node.extend(new_nodes)
    return m


def session(model, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC   # keep the Casts where they are
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_all(sess, feeds_list):
    name = sess.get_outputs()[0].name
    return [sess.run([name], f)[0] for f in feeds_list]


def compare(ref, got) -> dict:
    ref, got = np.concatenate([r.reshape(r.shape[0], -1) for r in ref]), np.concatenate(
        [g.reshape(g.shape[0], -1) for g in got])
    finite = np.isfinite(got).all(1)
    with np.errstate(all="ignore"):
        rel = np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    top1 = np.argmax(ref, 1)
    top5 = np.argsort(-np.where(np.isfinite(got), got, -np.inf), 1)[:, :5]
    return {"n": int(len(ref)), "non_finite": int((~finite).sum()),
            "rel_err_median": float(np.median(rel[finite])) if finite.any() else None,
            "rel_err_p99": float(np.percentile(rel[finite], 99)) if finite.any() else None,
            "rel_err_max": float(rel[finite].max()) if finite.any() else None,
            "top1_agreement": float(np.mean(np.argmax(got, 1) == top1)),
            "top5_agreement": float(np.mean([t in row for t, row in zip(top1, top5)]))}


def cosine(ref, got) -> dict:
    r = np.concatenate([x.reshape(x.shape[0], -1) for x in ref]).astype(np.float64)
    g = np.concatenate([x.reshape(x.shape[0], -1) for x in got]).astype(np.float64)
    with np.errstate(all="ignore"):
        c = (r * g).sum(1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(g, axis=1))
    ok = np.isfinite(c)
    return {"n": int(len(c)), "non_finite": int((~ok).sum()), "cosine_min": float(c[ok].min()),
            "cosine_mean": float(c[ok].mean()),
            "rel_err_median": float(np.median(np.linalg.norm(g - r, axis=1) / np.linalg.norm(r, axis=1)))}


def configs(graph, box, search: int, int_ranges=None):
    """(label, formats) to run: the policy's bf16 and fp16 choices over the contractions, and every contraction."""
    out, reports = [], {}
    for fmt in ("bf16", "fp16"):
        t = time.perf_counter()
        plan = plan_precision(graph, fmt, input_ranges=box, target_ops={fmt: CONTRACTIONS}, search_budget=search)
        formats = plan.formats()
        n_contr = sum(1 for n in graph.nodes if n.op in CONTRACTIONS)
        reports[fmt] = {"narrowed": len(formats), "contractions": n_contr, "search": plan.search,
                        "analysis_s": round(time.perf_counter() - t, 2),
                        "kept": {k: v for k, v in _kept(plan).items()}}
        out.append((f"{fmt} (policy)", formats))
        out.append((f"{fmt}-all", {n.name: fmt for n in graph.nodes if n.op in CONTRACTIONS}))
    return out, reports


def _kept(plan):
    c = {}
    for n in plan.nodes:
        if n.op in CONTRACTIONS and not n.format:
            key = n.reason.split(":")[0][:60]
            c[key] = c.get(key, 0) + 1
    return c


def bench_cnn(name: str, xs, threads: int, search: int, cuvil: bool = False, cuvil_only: bool = False) -> dict:
    p = Pipeline.from_onnx(zoo_model(name)).optimize()
    g = p.graph
    if g.symbols:
        p = p.specialize({s: sym.tuned for s, sym in g.symbols.items()})
        g = p.graph
    inp = g.inputs[0].name
    box = {inp: (float(((0 - MEAN) / STD).min()), float(((1 - MEAN) / STD).max()))}
    feeds = [{inp: x[None]} for x in xs]
    t = time.perf_counter()
    ref = run_all(session(export_model(g), threads), feeds)
    res = {"model": name, "inputs": len(xs), "box": box[inp], "fp32_s": round(time.perf_counter() - t, 1), "rows": {}}
    if cuvil_only:
        cfgs, res["policy"] = [], {}
    else:
        cfgs, res["policy"] = configs(g, box, search)
    if cuvil:   # the compiled libraries: float32, and bf16 where this CPU has the kernels (precision_ops)
        builds = [("fp32 (cuvil)", {}), ("bf16 (cuvil)", {"precision": "bf16", "input_ranges": box})]
        for label, kw in builds:
            t = time.perf_counter()
            art = p.compile(**kw)
            if label == "bf16 (cuvil)" and any(s_["kernel"] == "winograd_in" for s_ in art.manifest["steps"]):
                # its 3x3 convolutions took bf16 Winograd (a CPU without AMX): the direct ones beside them
                builds.append(("bf16 direct (cuvil)", {**kw, "tuning": X86Tuning(bf16_winograd=False)}))
            pr = art.manifest.get("precision") or {}
            got = [next(iter(art.run(f).values())) for f in feeds]
            res["rows"][label] = {"narrowed": (pr.get("counts") or {}).get("bf16", 0), **compare(ref, got),
                                  "seconds": round(time.perf_counter() - t, 1)}
            print(f"  {name} {label}: {res['rows'][label]}", flush=True)
    for label, formats in cfgs:
        got = run_all(session(narrowed_model(g, formats), threads), feeds)
        res["rows"][label] = {"narrowed": len(formats), **compare(ref, got)}
        print(f"  {name} {label}: {res['rows'][label]}", flush=True)
    return res


def fp8_config(graph, box, search: int):
    """(label, formats, scales) of the policy's explicit fp8 over the MatMul/Gemm (the GPU's fp8 products)."""
    plan = plan_precision(graph, "fp8", input_ranges=box, target_ops={"fp8": frozenset({"MatMul", "Gemm"})},
                          search_budget=search)
    formats = plan.formats()
    return "fp8 (policy, GPU products)", formats, {p.name: p.scales for p in plan.nodes if p.format == "fp8"}


def bench_bert(n: int, threads: int, search: int, seq: int = 32, layers: int = 0) -> dict:
    """The fixture BERT (a 2-layer torch export), or with ``layers`` this repository's Hugging Face BertModel
    graph at BERT-base width (cuvil.testing.hf_models, seeded weights) with that many layers."""
    path = ROOT / "tests" / "fixtures" / "exports" / "bert.torchscript.onnx"
    if layers:
        from cuvil.testing.hf_models import bert_model
        model = bert_model(layers=layers)
    else:
        model = onnx.load(path)
    emb = next(numpy_helper.to_array(t) for t in model.graph.initializer if "word_embeddings" in t.name)
    vocab = emb.shape[0]
    sentences = text_sentences(n)
    p = Pipeline.from_onnx(model).optimize()
    names = [v.name for v in p.graph.inputs]
    shapes = {k: [1, seq] for k in names}
    p = p.specialize(p.resolve_shapes(None, None, shapes)[0])
    g = p.graph
    feeds = []
    for s in sentences:
        ids, mask = token_ids(s, vocab, seq)
        f = {"input_ids": ids[None], "attention_mask": mask[None], "token_type_ids": np.zeros((1, seq), np.int64)}
        feeds.append({k: v for k, v in f.items() if k in names})
    out_name = "pooler_output" if "pooler_output" in g.output_names else g.output_names[-1]
    m32 = export_model(g)
    ref_sess = session(m32, threads)
    ref = [ref_sess.run([out_name], f)[0] for f in feeds]
    box = {"input_ids": (0, vocab - 1), "attention_mask": (0, 1), "token_type_ids": (0, 0)}
    box = {k: v for k, v in box.items() if k in names}
    what = (f"BERT-base width, {layers} layers (cuvil.testing.hf_models, seeded)" if layers else
            "bert (tests/fixtures/exports/bert.torchscript.onnx, random init)")
    res = {"model": what, "inputs": len(feeds), "vocab": int(vocab), "seq": seq, "output": out_name, "rows": {}}
    cfgs, res["policy"] = configs(g, box, search)
    cfgs = [(label, formats, None) for label, formats in cfgs] + [fp8_config(g, box, search)]
    res["policy"]["fp8"] = {"narrowed": len(cfgs[-1][1]), "exponents": sorted({tuple(v[:2]) for v in cfgs[-1][2].values()})}
    cfgs.append(("fp8-all (unscaled)", {nd.name: "fp8" for nd in g.nodes if nd.op in ("MatMul", "Gemm")}, {}))
    for label, formats, scales in cfgs:
        s = session(narrowed_model(g, formats, scales), threads)
        got = [s.run([out_name], f)[0] for f in feeds]
        res["rows"][label] = {"narrowed": len(formats), **cosine(ref, got)}
        print(f"  bert {label}: {res['rows'][label]}", flush=True)
    return res


def render_md(res: dict) -> str:
    """The accuracy tables of bench/PRECISION.md from a results JSON."""
    lines = [f"Measured {res['date']} on {res['cpu']}, onnxruntime {res.get('ort', '')} {res['threads']} thread(s), "
             f"`PYTHONPATH=src python3 bench/precision_accuracy.py --n {res.get('images', {}).get('n', 0)}`.", ""]
    if res.get("cnns"):
        im = res["images"]
        lines += [f"Images: {im['n']} crops of {len(im['photos'])} photos of scikit-image's data "
                  f"({', '.join(p.rsplit('.', 1)[0] for p in im['photos'])}).", "",
                  "| model | config | nodes narrowed | non-finite | rel. err. median | p99 | max | top-1 agr. | top-5 agr. |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in res["cnns"]:
            for label, r in c["rows"].items():
                f = lambda v: "-" if v is None else f"{v:.2e}"
                lines.append(f"| {c['model']} | {label} | {r['narrowed']} | {r['non_finite']} | {f(r['rel_err_median'])} "
                             f"| {f(r['rel_err_p99'])} | {f(r['rel_err_max'])} | {100 * r['top1_agreement']:.1f} % "
                             f"| {100 * r['top5_agreement']:.1f} % |")
        lines += ["", "What the policy kept float32, per model (of the Conv/MatMul/Gemm nodes; reason: count):", ""]
        for c in res["cnns"]:
            for fmt, pol in c["policy"].items():
                lines.append(f"- {c['model']} {fmt}: {pol['narrowed']} of {pol['contractions']} narrowed"
                             + (f"; kept: {', '.join(f'{k}: {v}' for k, v in pol['kept'].items())}" if pol["kept"] else "")
                             + f" (search: {pol['search']})")
    b = res.get("bert")
    if b:
        lines += ["", f"BERT: {b['model']}, {b['inputs']} sentences of the standard library's docstrings, S = {b['seq']}, "
                  f"output `{b['output']}`.", "",
                  "| config | nodes narrowed | non-finite | cosine min | cosine mean | rel. err. median |", "|---|---|---|---|---|---|"]
        for label, r in b["rows"].items():
            lines.append(f"| {label} | {r['narrowed']} | {r['non_finite']} | {r['cosine_min']:.7f} | {r['cosine_mean']:.7f} "
                         f"| {r['rel_err_median']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(CNNS))
    ap.add_argument("--n", type=int, default=1000, help="images (and sentences) (default 1000)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--search", type=int, default=0,
                    help="counterexample search budget per policy run (default 0: refused and unknown nodes both stay "
                         "float32, so the search changes the verdicts' wording, not what is narrowed)")
    ap.add_argument("--no-bert", action="store_true")
    ap.add_argument("--bert-layers", type=int, default=0, help="BERT-base width with this many layers (this "
                    "repository's Hugging Face graph, seeded) instead of the 2-layer fixture export")
    ap.add_argument("--bert-seq", type=int, default=32)
    ap.add_argument("--cuvil", action="store_true",
                    help="also compile and run the x86 libraries: float32 and --precision bf16 (the real kernels "
                         "where this CPU has AVX512_BF16)")
    ap.add_argument("--cuvil-only", action="store_true", help="only the compiled libraries (no simulation)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--md", default=None, help="also write the tables as Markdown (to paste into bench/PRECISION.md)")
    ap.add_argument("--from-json", default=None, help="render --md from an earlier --out file instead of running")
    a = ap.parse_args(argv)
    if a.from_json:
        text = render_md(json.loads(Path(a.from_json).read_text()))
        Path(a.md).write_text(text) if a.md else print(text)
        return 0
    import onnxruntime
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_label(),
           "threads": a.threads, "ort": onnxruntime.__version__, "cnns": [], "bert": None}
    if not a.no_bert:   # first: the quickest
        res["bert"] = bench_bert(a.n, a.threads, a.search, a.bert_seq, a.bert_layers)
    models = [m for m in a.models.split(",") if m]
    if models:
        xs, src, pics = image_inputs(a.n)
        res["images"] = {"n": len(xs), "photos": pics, "source": "scikit-image data (skimage/data), random crops"}
        print(f"{len(xs)} crops of {len(pics)} photos; cpu {res['cpu']}", flush=True)
        for m in models:
            res["cnns"].append(bench_cnn(m, xs, a.threads, a.search, a.cuvil or a.cuvil_only, a.cuvil_only))
            if a.out:   # after each model: a long run's partial results are kept
                Path(a.out).write_text(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.out}")
    if a.md:
        Path(a.md).write_text(render_md(res))
        print(f"wrote {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
