"""Issue 23: reading LoRA adapters (PEFT directories, .onnx_adapter files) and mapping their modules to the weights
of real torch exports (tests/fixtures/exports: both exporters), with every error one clear CuvilError."""
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from cuvil.errors import CuvilError
from cuvil.lora import load_lora_map, map_adapter, read_adapter
from cuvil.lora.mapping import linear_sites, suffix_score
from cuvil.testing.lora import model_modules, write_peft_adapter

EXPORTS = Path(__file__).parent / "fixtures" / "exports"
ALL_EXPORTS = sorted(p.name for p in EXPORTS.glob("*.onnx"))

# Per architecture: the adapted module names as PEFT writes them on the bare HF model (no `model.` wrapper).
TARGETS = {
    "bert": ["encoder.layer.0.attention.self.query", "encoder.layer.1.attention.self.value",
             "encoder.layer.0.attention.output.dense", "encoder.layer.1.output.dense"],
    "roberta": ["encoder.layer.0.attention.self.query", "encoder.layer.1.intermediate.dense"],
    "distilbert": ["transformer.layer.0.attention.q_lin", "transformer.layer.1.ffn.lin2"],
    "gpt2": ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"],
    "gpt2_decode": ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_proj"],
    "t5_encoder": ["encoder.block.0.layer.0.SelfAttention.q", "encoder.block.1.layer.1.DenseReluDense.wo"],
    "vit": ["layers.0.attention.q_proj", "layers.1.mlp.fc2"],
    "whisper_encoder": ["layers.0.self_attn.q_proj", "layers.1.fc1"],
}


def _adapter(tmp_path, model, modules, **kw):
    io = model_modules(model)
    return read_adapter(write_peft_adapter(tmp_path / "ad", {m: io[m] for m in modules}, **kw))


@pytest.mark.parametrize("fixture", ALL_EXPORTS)
def test_mapping_on_every_export(tmp_path, fixture):
    model = onnx.load(EXPORTS / fixture)
    arch = fixture.split(".")[0]
    ad = _adapter(tmp_path, model, TARGETS[arch])
    targets = map_adapter(model, ad)
    assert [t.module for t in targets] == sorted(TARGETS[arch])
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for t in targets:
        lm = ad.modules[t.module]
        assert inits[t.initializer] == t.shape
        want = (lm.in_features, lm.out_features) if t.layout == "in_out" else (lm.out_features, lm.in_features)
        assert t.shape == want
        node = nodes[t.node]
        assert node.op_type in ("MatMul", "Gemm")
        # the module's own name is what the site carries (initializer name or exporter scope)
        assert any(n.endswith(t.module) for n in t.names), (t.module, t.names)
    # distinct modules land on distinct nodes
    assert len({t.node for t in targets}) == len(targets)


def test_layouts_follow_the_consumer():
    m = onnx.load(EXPORTS / "gpt2.dynamo.onnx")
    by_init = {s.initializer: s for s in linear_sites(m)}
    # Conv1D weight [in, out] read by Gemm transB=0
    s = by_init["model.transformer.h.0.attn.c_attn.weight"]
    assert (s.layout, s.through_transpose, s.shape) == ("in_out", False, (32, 96))
    # lm_head: MatMul(x, Transpose(W)) with W [out, in]
    s = by_init["model.lm_head.weight"]
    assert (s.layout, s.through_transpose, s.shape) == ("out_in", True, (512, 32))
    # Gemm transB=1 (the pooler of BERT)
    s = by_init["model.pooler.dense.weight"] if "model.pooler.dense.weight" in by_init else None
    b = {x.initializer: x for x in linear_sites(onnx.load(EXPORTS / "bert.torchscript.onnx"))}
    assert b["model.pooler.dense.weight"].layout == "out_in"


def test_tied_weight_is_reported_shared(tmp_path):
    m = onnx.load(EXPORTS / "gpt2.dynamo.onnx")
    t, = map_adapter(m, _adapter(tmp_path, m, ["lm_head"]))
    assert t.initializer == "model.lm_head.weight" and t.shared_with  # also the token embedding's Gather


def test_wrapper_prefixes_match():
    assert suffix_score("encoder.layer.0.attention.self.query", "model.encoder.layer.0.attention.self.query") == 6
    assert suffix_score("bert.encoder.layer.0.attention.self.query", "model.encoder.layer.0.attention.self.query") == 6
    assert suffix_score("encoder.layer.0.attention.self.query", "model.encoder.layer.10.attention.self.query") == 0
    assert suffix_score("encoder.layer.0.output.dense", "model.encoder.layer.0.attention.output.dense") == 0


def test_peft_config_scale_rslora_and_patterns(tmp_path):
    mods = {"a.q": (8, 8), "a.v": (8, 8), "b.q": (8, 8)}
    ad = read_adapter(write_peft_adapter(tmp_path / "x", mods, r=4, lora_alpha=16,
                                         ranks={"a.v": 2}, config={"rank_pattern": {"a.v": 2},
                                                                   "alpha_pattern": {"q": 4}}))
    assert ad.modules["a.v"].rank == 2 and ad.modules["a.v"].scale == 16 / 2
    assert ad.modules["a.q"].scale == 4 / 4 and ad.modules["b.q"].scale == 4 / 4
    ad = read_adapter(write_peft_adapter(tmp_path / "y", mods, r=4, lora_alpha=16, config={"use_rslora": True}))
    assert ad.modules["a.q"].scale == 16 / math.sqrt(4)
    assert read_adapter(write_peft_adapter(tmp_path / "z", mods, config={"fan_in_fan_out": True})
                        ).modules["a.q"].fan_in_fan_out


def test_onnx_adapter_read(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    if not hasattr(ort, "AdapterFormat"):
        pytest.skip(f"onnxruntime {ort.__version__} has no AdapterFormat")
    rng = np.random.default_rng(1)
    A = rng.standard_normal((4, 32)).astype(np.float32)
    B = rng.standard_normal((96, 4)).astype(np.float16)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({"transformer.h.0.attn.c_attn.lora_A.weight": ort.OrtValue.ortvalue_from_numpy(A),
                        "transformer.h.0.attn.c_attn.lora_B.weight": ort.OrtValue.ortvalue_from_numpy(B)})
    path = tmp_path / "ad.onnx_adapter"
    fmt.export_adapter(str(path))
    ad = read_adapter(path)
    lm = ad.modules["transformer.h.0.attn.c_attn"]
    np.testing.assert_array_equal(lm.A, A)
    np.testing.assert_array_equal(lm.B, B)
    assert lm.B.dtype == np.float16 and lm.scale == 1.0
    t, = map_adapter(onnx.load(EXPORTS / "gpt2.torchscript.onnx"), ad)
    assert t.initializer == "model.transformer.h.0.attn.c_attn.weight"


# ---- every error: one CuvilError that names what failed ------------------------------------------------------
def _err(fn, *needles):
    with pytest.raises(CuvilError) as ei:
        fn()
    text = str(ei.value)
    for n in needles:
        assert n in text, (n, text)
    assert ei.value.hint
    return ei.value


def test_error_module_maps_to_nothing(tmp_path):
    m = onnx.load(EXPORTS / "bert.torchscript.onnx")
    ad = read_adapter(write_peft_adapter(tmp_path / "a", {"encoder.layer.0.attention.self.querry": (32, 32)}))
    _err(lambda: map_adapter(m, ad), "'encoder.layer.0.attention.self.querry'", "maps to no weight",
         "model.encoder.layer.0.attention.self.query")


def test_error_ambiguous(tmp_path):
    m = onnx.load(EXPORTS / "bert.torchscript.onnx")
    ad = read_adapter(write_peft_adapter(tmp_path / "a", {"query": (32, 32)}))
    _err(lambda: map_adapter(m, ad), "'query'", "matches 2 weights", "onnx::MatMul_335", "onnx::MatMul_352")


def test_error_shape_mismatch(tmp_path):
    m = onnx.load(EXPORTS / "bert.torchscript.onnx")
    ad = read_adapter(write_peft_adapter(tmp_path / "a", {"encoder.layer.0.intermediate.dense": (32, 32)}))
    _err(lambda: map_adapter(m, ad), "encoder.layer.0.intermediate.dense", "[32, 32]", "[32, 64]")


def test_error_rank_zero(tmp_path):
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8)}, r=0)
    _err(lambda: read_adapter(d), "'m.q'", "rank 0")


def test_error_non_finite(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8)})
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.m.q.lora_B.weight"][1, :2] = [np.nan, np.inf]
    save_file(t, str(d / "adapter_model.safetensors"))
    _err(lambda: read_adapter(d), "base_model.model.m.q.lora_B.weight", "2 non-finite")


def test_error_missing_key(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8), "m.v": (8, 8)})
    t = load_file(str(d / "adapter_model.safetensors"))
    del t["base_model.model.m.v.lora_A.weight"]
    save_file(t, str(d / "adapter_model.safetensors"))
    _err(lambda: read_adapter(d), "'m.v'", "no lora_A")


@pytest.mark.parametrize("key,needle", [("use_dora", "DoRA"), ("lora_bias", "lora_bias")])
def test_error_unsupported_config(tmp_path, key, needle):
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8)}, config={key: True})
    _err(lambda: read_adapter(d), needle, "not supported")


def test_error_rank_disagrees_with_config(tmp_path):
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8)}, r=4, ranks={"m.q": 2})
    _err(lambda: read_adapter(d), "rank 2", "r=4")


def test_error_extra_tensors_and_not_an_adapter(tmp_path):
    from safetensors.numpy import load_file, save_file
    d = write_peft_adapter(tmp_path / "a", {"m.q": (8, 8)})
    t = load_file(str(d / "adapter_model.safetensors"))
    t["base_model.model.classifier.modules_to_save.default.weight"] = np.zeros((2, 8), np.float32)
    save_file(t, str(d / "adapter_model.safetensors"))
    _err(lambda: read_adapter(d), "modules_to_save")
    _err(lambda: read_adapter(tmp_path / "nope"), "does not exist")
    (tmp_path / "empty").mkdir()
    _err(lambda: read_adapter(tmp_path / "empty"), "no adapter_model.safetensors")
    (tmp_path / "f.onnx_adapter").write_bytes(b"garbage!")
    _err(lambda: read_adapter(tmp_path / "f.onnx_adapter"), "TORT")


def test_lora_map_for_lost_names(tmp_path):
    """A graph whose names were lost (no scopes, anonymous initializers): --lora-map gives them."""
    m = onnx.load(EXPORTS / "bert.dynamo.onnx")
    for n in m.graph.node:
        del n.metadata_props[:]
    ad = read_adapter(write_peft_adapter(tmp_path / "a", {"encoder.layer.0.attention.self.query": (32, 32)}))
    _err(lambda: map_adapter(m, ad), "maps to no weight", "carry no module names")
    f = tmp_path / "map.yaml"
    f.write_text("encoder.layer.0.attention.self.query: val_49\n")
    t, = map_adapter(m, ad, load_lora_map(f))
    assert (t.initializer, t.node) == ("val_49", "node_MatMul_48")
    (tmp_path / "map.json").write_text(json.dumps({"encoder.layer.0.attention.self.query": "node_MatMul_48"}))
    t, = map_adapter(m, ad, load_lora_map(tmp_path / "map.json"))
    assert t.initializer == "val_49"
    _err(lambda: map_adapter(m, ad, {"encoder.layer.0.attention.self.query": "val_4"}), "'val_4'",
         "no initializer or node")
    _err(lambda: map_adapter(m, ad, {"encoder.layer.9.x": "val_49"}), "lacks")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    _err(lambda: load_lora_map(tmp_path / "bad.yaml"), "must map module names")
