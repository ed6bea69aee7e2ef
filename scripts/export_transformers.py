"""Export Hugging Face transformers to ONNX with both torch.onnx exporters, as users do.

The models of the real-exports tests (``tests/fixtures/exports/``) and, with ``--size full``, the benchmark
models of the performance work. Every model is exported twice: the dynamo exporter
(``torch.onnx.export(..., dynamo=True)``, opset 18, ``dynamic_shapes``) and the TorchScript exporter
(``dynamo=False``, opset 17, ``dynamic_axes``), with symbolic batch and sequence dims. Each export is then
checked against torch with onnxruntime at a shape other than the one it was traced with, so a fixture that
silently specialised a dim is caught here, not in Cuvil's tests.

Needs torch and transformers (the GPU machine has both; no GPU is used)::

    python3 scripts/export_transformers.py --out DIR                  # small configs, random weights
    python3 scripts/export_transformers.py --out DIR --size full      # full-size configs, weights in DIR/*.data

``DIR/exports.json`` lists every export: file, exporter, opset, inputs with their dims, and either the
onnxruntime-vs-torch check (max relative error per output at two shapes) or the exporter's error.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings

import numpy as np
import onnx
import torch
import transformers
from transformers import (BertConfig, BertModel, DistilBertConfig, DistilBertModel, GPT2Config, GPT2LMHeadModel,
                          RobertaConfig, RobertaModel, T5Config, T5EncoderModel, ViTConfig, ViTModel, WhisperConfig,
                          WhisperModel)

SMALL = dict(vocab=512, hidden=32, layers=2, heads=4, ffn=64)
FULL = dict(vocab=None, hidden=768, layers=12, heads=12, ffn=3072)
MAX_BATCH, MAX_SEQ = 8, 512


def _config(kind: str, size: dict):
    """The model's config: the library default for ``full``, a small one (same structure) otherwise."""
    small = size["vocab"] is not None
    s = size
    if kind in ("bert", "roberta"):
        cls = BertConfig if kind == "bert" else RobertaConfig
        if not small:
            return cls()
        return cls(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                   num_attention_heads=s["heads"], intermediate_size=s["ffn"],
                   max_position_embeddings=MAX_SEQ + (2 if kind == "roberta" else 0))
    if kind == "distilbert":
        if not small:
            return DistilBertConfig()
        return DistilBertConfig(vocab_size=s["vocab"], dim=s["hidden"], n_layers=s["layers"], n_heads=s["heads"],
                                hidden_dim=s["ffn"], max_position_embeddings=MAX_SEQ)
    if kind == "gpt2":
        if not small:
            return GPT2Config()
        return GPT2Config(vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
                          n_inner=s["ffn"], n_positions=2048, bos_token_id=1, eos_token_id=2)
    if kind == "vit":
        if not small:
            return ViTConfig()
        return ViTConfig(image_size=32, patch_size=8, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], intermediate_size=s["ffn"])
    if kind == "whisper":
        if not small:
            return WhisperConfig()
        return WhisperConfig(vocab_size=s["vocab"], d_model=s["hidden"], encoder_layers=s["layers"],
                             decoder_layers=1, encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"],
                             encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"], num_mel_bins=80,
                             max_source_positions=64, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None,
                             suppress_tokens=None)
    if kind == "t5":
        if not small:
            return T5Config()
        return T5Config(vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["hidden"] // s["heads"], d_ff=s["ffn"],
                        num_layers=s["layers"], num_heads=s["heads"], relative_attention_num_buckets=32)
    raise ValueError(kind)


class _Outputs(torch.nn.Module):
    """A model called with keyword inputs, returning a tuple of named tensors (what the exporters want)."""

    def __init__(self, model, input_names, output_fn, **fixed):
        super().__init__()
        self.model, self.input_names, self.output_fn, self.fixed = model, input_names, output_fn, fixed

    def forward(self, *args):
        return self.output_fn(self.model(**dict(zip(self.input_names, args)), **self.fixed))


class _GPT2Decode(torch.nn.Module):
    """One GPT-2 decode step: ``past_key_values`` in as tensors, logits and the ``present`` tensors out."""

    def __init__(self, model, n_layer):
        super().__init__()
        self.model, self.n_layer = model, n_layer

    def forward(self, input_ids, attention_mask, *past):
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache()
        for i in range(self.n_layer):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        present = []
        pkv = out.past_key_values
        for i in range(self.n_layer):
            if hasattr(pkv, "layers"):
                present += [pkv.layers[i].keys, pkv.layers[i].values]
            else:
                present += [pkv.key_cache[i], pkv.value_cache[i]]
        return (out.logits, *present)


def _text_inputs(cfg, b: int, s: int, names, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.int64)
    if b > 1:
        mask[1, s // 2:] = 0                     # a padded row
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros(b, s, dtype=torch.int64)}
    return [feed[n] for n in names]


def _specs(size: dict):
    """(name, module, input names, output names, inputs(b, s, seed), dynamic dims per input)."""
    text = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            "token_type_ids": {0: "batch", 1: "sequence"}}
    specs = []
    for kind, cls, names in (("bert", BertModel, ["input_ids", "attention_mask", "token_type_ids"]),
                             ("distilbert", DistilBertModel, ["input_ids", "attention_mask"]),
                             ("roberta", RobertaModel, ["input_ids", "attention_mask"])):
        cfg = _config(kind, size)
        outs = ["last_hidden_state", "pooler_output"] if kind != "distilbert" else ["last_hidden_state"]
        fn = (lambda o, k=kind: (o.last_hidden_state,) if k == "distilbert" else (o.last_hidden_state,
                                                                                   o.pooler_output))
        specs.append((kind, _Outputs(cls(cfg), names, fn), names, outs,
                      lambda b, s, seed, c=cfg, n=names: _text_inputs(c, b, s, n, seed), {n: text[n] for n in names}))
    cfg = _config("gpt2", size)
    lm = GPT2LMHeadModel(cfg)
    names = ["input_ids", "attention_mask"]
    specs.append(("gpt2", _Outputs(lm, names, lambda o: (o.logits,), use_cache=False), names, ["logits"],
                  lambda b, s, seed, c=cfg: _text_inputs(c, b, s, names, seed), {n: text[n] for n in names}))
    hd = cfg.n_embd // cfg.n_head

    def decode_inputs(b, s, seed, c=cfg):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, c.vocab_size, (b, 1), generator=g)
        mask = torch.ones(b, s + 1, dtype=torch.int64)
        if b > 1:
            mask[1, : s // 2] = 0                # left padding in the cache of row 1
        past = [torch.randn(b, c.n_head, s, hd, generator=g) for _ in range(2 * c.n_layer)]
        return [ids, mask, *past]
    past_names = [f"past_key_values.{i}.{kv}" for i in range(cfg.n_layer) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(cfg.n_layer) for kv in ("key", "value")]
    dyn = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total_sequence"}}
    dyn.update({n: {0: "batch", 2: "past_sequence"} for n in past_names})
    specs.append(("gpt2_decode", _GPT2Decode(lm, cfg.n_layer), names + past_names, ["logits"] + present_names,
                  decode_inputs, dyn))
    cfg = _config("vit", size)
    specs.append(("vit", _Outputs(ViTModel(cfg), ["pixel_values"], lambda o: (o.last_hidden_state, o.pooler_output)),
                  ["pixel_values"], ["last_hidden_state", "pooler_output"],
                  lambda b, s, seed, c=cfg: [torch.randn(b, 3, c.image_size, c.image_size,
                                                         generator=torch.Generator().manual_seed(seed))],
                  {"pixel_values": {0: "batch"}}))
    cfg = _config("whisper", size)
    specs.append(("whisper_encoder", _Outputs(WhisperModel(cfg).encoder, ["input_features"],
                                              lambda o: (o.last_hidden_state,)),
                  ["input_features"], ["last_hidden_state"],
                  lambda b, s, seed, c=cfg: [torch.randn(b, c.num_mel_bins, 2 * c.max_source_positions,
                                                         generator=torch.Generator().manual_seed(seed))],
                  {"input_features": {0: "batch"}}))
    cfg = _config("t5", size)
    names = ["input_ids", "attention_mask"]
    specs.append(("t5_encoder", _Outputs(T5EncoderModel(cfg), names, lambda o: (o.last_hidden_state,)),
                  names, ["last_hidden_state"],
                  lambda b, s, seed, c=cfg: _text_inputs(c, b, s, names, seed), {n: text[n] for n in names}))
    return specs


def _export(module, args, path, input_names, output_names, dyn, dynamo: bool):
    if dynamo:
        dims = {}
        shapes = []
        for name, a in zip(input_names, args):
            axes = dyn.get(name, {})
            spec = {}
            for ax, sym in axes.items():
                if sym not in dims:
                    dims[sym] = torch.export.Dim(sym.replace(".", "_"),
                                                 max=MAX_BATCH if sym == "batch" else 4096)
                spec[ax] = dims[sym]
            shapes.append(spec or None)
        # dynamic_shapes follows forward's signature: (*args) or (input_ids, attention_mask, *past)
        fixed = 2 if isinstance(module, _GPT2Decode) else 0
        structure = (*shapes[:fixed], tuple(shapes[fixed:]))
        torch.onnx.export(module, tuple(args), path, dynamo=True, opset_version=18, input_names=input_names,
                          output_names=output_names, dynamic_shapes=structure, external_data=False)
    else:
        dyn_axes = dict(dyn)
        torch.onnx.export(module, tuple(args), path, dynamo=False, opset_version=17, input_names=input_names,
                          output_names=output_names, dynamic_axes=dyn_axes, do_constant_folding=True)


def _check(path, module, make_inputs, input_names):
    """onnxruntime vs torch at two shapes other than the traced one: max relative error per output."""
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    used = [i.name for i in sess.get_inputs()]
    result = {}
    for b, s in ((1, 5), (3, 23)):
        args = make_inputs(b, s, 7)
        with torch.no_grad():
            want = [t.numpy() for t in module(*args)]
        feed = {n: a.numpy() for n, a in zip(input_names, args) if n in used}
        got = sess.run(None, feed)
        errs = [float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)) for g, w in zip(got, want)]
        result[f"B={b},S={s}"] = max(errs)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", choices=("small", "full"), default="small")
    ap.add_argument("--only", nargs="*", help="model names to export (default: all)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    size = SMALL if args.size == "small" else FULL
    records = []
    for name, module, input_names, output_names, make_inputs, dyn in _specs(size):
        if args.only and name not in args.only:
            continue
        module.eval()
        example = make_inputs(2, 16, 0)
        for dynamo in (True, False):
            tag = "dynamo" if dynamo else "torchscript"
            fname = f"{name}.{tag}.onnx"
            path = os.path.join(args.out, fname)
            rec = {"model": name, "exporter": tag, "file": fname, "opset": 18 if dynamo else 17,
                   "torch": torch.__version__, "transformers": transformers.__version__}
            t0 = time.time()
            try:
                with warnings.catch_warnings(), torch.no_grad():
                    warnings.simplefilter("ignore")
                    _export(module, example, path, input_names, output_names, dyn, dynamo)
                m = onnx.load(path)
                if args.size == "full":
                    onnx.save_model(m, path, save_as_external_data=True, location=fname + ".data")
                rec["inputs"] = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                                 for i in m.graph.input}
                rec["outputs"] = [o.name for o in m.graph.output]
                rec["ops"] = sorted({n.op_type for n in m.graph.node})
                rec["bytes"] = os.path.getsize(path)
                rec["ort_vs_torch_rel_err"] = _check(path, module, make_inputs, input_names)
                rec["status"] = "ok"
            except Exception as e:                                   # record and go on to the next export
                rec["status"] = "failed"
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                rec["traceback"] = traceback.format_exc()[-3000:]
                if os.path.exists(path):
                    os.remove(path)
            rec["seconds"] = round(time.time() - t0, 1)
            print(f"{fname}: {rec['status']} {rec.get('ort_vs_torch_rel_err', rec.get('error', ''))}"[:400],
                  flush=True)
            records.append(rec)
    with open(os.path.join(args.out, "exports.json"), "w") as f:
        json.dump(records, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
