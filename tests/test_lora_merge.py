"""Issue 23: LoRA adapters merged at compile time. Adapters are made with numpy in PEFT's exact layout and names
(cuvil.testing.lora) against the BERT and GPT-2 exports of tests/fixtures/exports (both exporters); the merged
library must match the model merged in numpy and run by onnxruntime within rtol 1e-5, every merged weight must
be the correctly rounded exact merge, and the merge must be recorded as the proved lora_merge_* rules."""
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, TensorProto

from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.lora import map_adapter, read_adapter
from cuvil.lora.rounding import round_exact_sum, round_fraction
from cuvil.testing.lora import model_modules, numpy_merged_model, write_peft_adapter
from cuvil.testing.oracles import max_rel_error, ort_session

ROOT = Path(__file__).resolve().parent.parent
EXPORTS = ROOT / "tests" / "fixtures" / "exports"
RTOL = 1e-5          # the goal: merged library vs the numpy-merged model in onnxruntime
TARGETS = {"bert": r"attention\.self\.(query|value)$|output\.dense$|pooler\.dense$",
           "gpt2": r"c_attn$|c_proj$|lm_head$"}


def _feeds(model, batch=2, seq=7, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [batch if d.dim_param == "batch" else seq for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(0, 512, shape).astype(np.int64)
        elif vi.name == "token_type_ids":
            out[vi.name] = rng.integers(0, 2, shape).astype(np.int64)
        else:
            m = np.ones(shape, np.int64)
            m[0, seq // 2:] = 0
            out[vi.name] = m
    return out


def _fixed(p, batch=2, seq=7):
    return {k: v for k, v in {"batch": batch, "sequence": seq}.items() if k in p.graph.symbols}


def _adapter(tmp_path, model, arch, name="ad", **kw):
    return write_peft_adapter(tmp_path / name, model_modules(model, TARGETS[arch]), **kw)


def _merged_weight(p: Pipeline, node_name: str) -> np.ndarray:
    node, = [n for n in p.graph.nodes if n.name == node_name]
    v = node.inputs[1]
    while not v.is_const:
        v = v.producer.inputs[0]
    return v.const


def _exact_merge(w, updates, fmt):
    """The merge by the definition, in rational arithmetic, element by element: W + Σ s·(B·A) in W's layout,
    with each s rounded to W's type as the graph holds it; then rounded once to ``fmt``."""
    out = np.empty(w.shape, np.float64)
    terms = []
    for lm, weight, layout in updates:
        s = Fraction(float(np.asarray(weight * lm.scale, w.dtype)))
        A = lm.A.astype(w.dtype).astype(np.float64)
        B = lm.B.astype(w.dtype).astype(np.float64)
        terms.append((s, A, B, layout))
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            x = Fraction(float(w[i, j]))
            for s, A, B, layout in terms:
                o, k = (j, i) if layout == "in_out" else (i, j)    # W[o, k] in torch's [out, in]
                x += s * sum(Fraction(float(B[o, t])) * Fraction(float(A[t, k])) for t in range(A.shape[0]))
            out[i, j] = round_fraction(x, fmt)
    return out


# ---- the goal: merged library vs numpy-merged onnxruntime --------------------------------------------------
@pytest.mark.parametrize("fixture", ["bert.torchscript", "bert.dynamo", "gpt2.dynamo", "gpt2.torchscript"])
def test_merged_library_matches_numpy_merge(tmp_path, fixture):
    model = onnx.load(EXPORTS / f"{fixture}.onnx")
    arch = fixture.split(".")[0]
    ad = _adapter(tmp_path, model, arch, r=4, lora_alpha=8, scale_b=0.5)
    p = Pipeline.from_onnx(model).with_lora(ad)
    art = p.optimize().compile(fixed=_fixed(p))
    f = _feeds(model)
    want = ort_session(numpy_merged_model(model, [(ad, 1.0)])).run(None, f)
    base = ort_session(model).run(None, f)
    got = art.run(f)
    for o, w, b in zip(model.graph.output, want, base):
        err = max_rel_error(got[o.name], w)
        print(f"{fixture} {o.name}: merged library vs numpy-merged onnxruntime {err:.2e}; "
              f"update size {max_rel_error(b, w):.2e}")
        assert err <= RTOL, (o.name, err)
        assert max_rel_error(b, w) > 1e-2   # the adapter changes the outputs: the comparison can fail
    # the merge is recorded as the rules that did it, with their verdicts, and per weight
    rules = art.manifest["rules_applied"]
    lora = {k: v for k, v in rules.items() if k.startswith("lora_merge")}
    n_targets = len(map_adapter(model, read_adapter(ad)))
    assert sum(v["applied"] for v in lora.values()) == n_targets
    for v in lora.values():
        # proved over the reals for every shape (the generic prover's nested sums), not a bounded check
        assert v["obligation"] == "real" and v["verdict"] == "proved" and "every non-empty shape" in v["coverage"], v
    assert len(art.manifest["lora"]) == n_targets
    assert all(r["rounding"] == "correctly rounded to float32" for r in art.manifest["lora"])


def test_every_merged_weight_is_the_correctly_rounded_exact_merge(tmp_path):
    """All weights of a BERT merge, two adapters with weights, checked against the exact rational merge."""
    model = onnx.load(EXPORTS / "bert.torchscript.onnx")
    mods = model_modules(model, r"layer\.0\.attention\.self\.(query|value)$|layer\.0\.output\.dense$")
    d1 = write_peft_adapter(tmp_path / "a1", mods, r=3, lora_alpha=7, seed=1, scale_b=0.3)
    d2 = write_peft_adapter(tmp_path / "a2", {k: v for k, v in mods.items() if "query" in k}, r=2,
                            lora_alpha=5, seed=2, scale_b=0.3)
    p = Pipeline.from_onnx(model).with_lora(d1, 0.5).with_lora(d2, -1.25)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    a1, a2 = read_adapter(d1), read_adapter(d2)
    per_node = {}
    for ad, weight in ((a1, 0.5), (a2, -1.25)):
        for t in map_adapter(model, ad):
            per_node.setdefault(t.node, (t, []))[1].append((ad.modules[t.module], weight, t.layout))
    assert len(per_node) == 3
    for node, (t, updates) in per_node.items():
        got = _merged_weight(p, node)
        want = _exact_merge(inits[t.initializer], updates, "float32")
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=t.module)


def test_chained_with_lora_rounds_once(tmp_path):
    """with_lora(a).with_lora(b) rounds W + a + b once, which merging a then b separately would not."""
    model = onnx.load(EXPORTS / "bert.torchscript.onnx")
    mods = model_modules(model, r"layer\.0\.attention\.self\.query$")
    d1 = write_peft_adapter(tmp_path / "a1", mods, seed=1)
    d2 = write_peft_adapter(tmp_path / "a2", mods, seed=2)
    t, = map_adapter(model, read_adapter(d1))
    chained = _merged_weight(Pipeline.from_onnx(model).with_lora(d1).with_lora(d2), t.node)
    w = numpy_helper.to_array({i.name: i for i in model.graph.initializer}[t.initializer])
    want = _exact_merge(w, [(read_adapter(d).modules[t.module], 1.0, t.layout) for d in (d1, d2)], "float32")
    np.testing.assert_array_equal(chained.astype(np.float64), want)


# ---- scale variants --------------------------------------------------------------------------------------
def test_rslora_scale_and_fan_in_fan_out(tmp_path):
    model = onnx.load(EXPORTS / "gpt2.torchscript.onnx")
    mods = model_modules(model, r"h\.0\.attn\.c_attn$")
    plain = write_peft_adapter(tmp_path / "plain", mods, r=4, lora_alpha=8, config={"fan_in_fan_out": True})
    rs = write_peft_adapter(tmp_path / "rs", mods, r=4, lora_alpha=8,
                            config={"fan_in_fan_out": True, "use_rslora": True})
    ad = read_adapter(rs)
    lm, = ad.modules.values()
    assert lm.fan_in_fan_out and lm.scale == 8 / math.sqrt(4)
    t, = map_adapter(model, ad)
    assert t.layout == "in_out" and t.shape == (32, 96)   # Conv1D: W [in, out], the update is (B·A)ᵀ
    w = numpy_helper.to_array({i.name: i for i in model.graph.initializer}[t.initializer])
    got = _merged_weight(Pipeline.from_onnx(model).with_lora(rs), t.node)
    np.testing.assert_array_equal(got.astype(np.float64), _exact_merge(w, [(lm, 1.0, "in_out")], "float32"))
    other = _merged_weight(Pipeline.from_onnx(model).with_lora(plain), t.node)
    # rslora doubles the update here (alpha/sqrt(4) = 4 against alpha/4 = 2)
    np.testing.assert_allclose(got - w, 2 * (other - w), rtol=1e-5, atol=1e-7)


# ---- correct rounding: the exact decisions ---------------------------------------------------------------
def test_rounding_decides_midpoints_exactly():
    one = np.array([[1.0]], np.float32)
    # 1 + 2^-24 is a midpoint between 1 and 1 + 2^-23: ties to even gives 1
    out, n = round_exact_sum(one, np.array([[1.0]], np.float32), np.array([1.0], np.float32),
                             np.array([[2.0 ** -24]], np.float32), "float32")
    assert out[0, 0] == 1.0 and n == 1
    # 1 + 2^-24 + 2^-80: just above the midpoint, so 1 + 2^-23, though float64 rounds the sum to the midpoint
    # first (and float32(float64) would then give 1)
    a = np.array([[1.0, 2.0 ** -40]], np.float32)
    b = np.array([[2.0 ** -24], [2.0 ** -40]], np.float32)
    s = np.array([1.0, 1.0], np.float32)
    naive = np.float32(np.float64(1.0) + (a.astype(np.float64) * s) @ b.astype(np.float64))
    out, n = round_exact_sum(one, a, s, b, "float32")
    assert naive[0, 0] == 1.0 and out[0, 0] == 1.0 + 2.0 ** -23 and n == 1
    # the same in float16 and bfloat16 (1 + 2^-11 and 1 + 2^-8 are their midpoints)
    for fmt, half in (("float16", 2.0 ** -11), ("bfloat16", 2.0 ** -8)):
        b = np.array([[half], [2.0 ** -40]], np.float32)
        out, n = round_exact_sum(one, a, s, b, fmt)
        assert out[0, 0] == 1.0 + 2 * half and n == 1


def test_rounding_matches_rational_arithmetic_on_random_sums():
    rng = np.random.default_rng(3)
    for fmt in ("float32", "float16", "bfloat16"):
        w = rng.standard_normal((6, 5)).astype(np.float32)
        a = rng.standard_normal((6, 3)).astype(np.float32)
        s = np.array([0.5, 3.0, -1.0], np.float32)
        b = rng.standard_normal((3, 5)).astype(np.float32)
        out, _ = round_exact_sum(w, a, s, b, fmt)
        for i in range(6):
            for j in range(5):
                x = Fraction(float(w[i, j])) + sum(Fraction(float(a[i, t])) * Fraction(float(s[t]))
                                                   * Fraction(float(b[t, j])) for t in range(3))
                assert out[i, j] == round_fraction(x, fmt)


def test_fp16_base_weights_round_to_fp16(tmp_path):
    """A float16 model: the merged weight is the exact merge rounded to float16 (A, B, s held in float16)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 6)).astype(np.float16)   # MatMul: [in, out]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "lin.weight"], ["y"], name="/lin/MatMul")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 6])],
                          [numpy_helper.from_array(w, "lin.weight")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    d = write_peft_adapter(tmp_path / "a", {"lin": (8, 6)}, r=2, lora_alpha=3, scale_b=0.5)
    p = Pipeline.from_onnx(model).with_lora(d)
    got = _merged_weight(p, "/lin/MatMul")
    assert got.dtype == np.float16
    lm, = read_adapter(d).modules.values()
    np.testing.assert_array_equal(got.astype(np.float64), _exact_merge(w, [(lm, 1.0, "in_out")], "float16"))
    x = rng.standard_normal((2, 8)).astype(np.float16)
    want = ort_session(numpy_merged_model(model, [(d, 1.0)])).run(None, {"x": x})[0]
    out = p.optimize().compile().run({"x": x})["y"]
    assert max_rel_error(out, want) <= 1e-3


# ---- errors -----------------------------------------------------------------------------------------------
def test_with_lora_after_optimize_is_refused(tmp_path):
    model = onnx.load(EXPORTS / "bert.torchscript.onnx")
    d = _adapter(tmp_path, model, "bert")
    with pytest.raises(CuvilError, match="before optimize") as ei:
        Pipeline.from_onnx(model).optimize().with_lora(d)
    assert "with_lora" in ei.value.hint
    with pytest.raises(CuvilError, match="before optimize"):
        Pipeline.from_onnx(model).with_lora(d).optimize().with_lora(d)


def test_with_lora_shape_mismatch_names_the_module(tmp_path):
    model = onnx.load(EXPORTS / "bert.torchscript.onnx")
    d = write_peft_adapter(tmp_path / "a", {"encoder.layer.0.attention.self.query": (64, 32)})
    with pytest.raises(CuvilError, match=r"encoder\.layer\.0\.attention\.self\.query.*\[64, 32\].*\[32, 32\]"):
        Pipeline.from_onnx(model).with_lora(d)


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    from cuvil.cli import main

    def run(*args):
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:   # argparse's own refusals
            rc = e.code
        out = capsys.readouterr()
        return _Run(rc, out.out, out.err)
    return run


def test_cli_compile_with_loras(tmp_path, cli):
    model = EXPORTS / "bert.torchscript.onnx"
    m = onnx.load(model)
    d1 = _adapter(tmp_path, m, "bert", name="a1", seed=1)
    d2 = write_peft_adapter(tmp_path / "a2", model_modules(m, r"attention\.self\.query$"), seed=2)
    out = tmp_path / "out" / "libm.so"
    r = cli("compile", str(model), "--lora", str(d1), "--lora", str(d2), "--lora-weight", "0.5",
             "--fix", "batch=2", "--fix", "sequence=7", "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert "lora: 9 weights merged" in r.stdout, r.stdout
    manifest = json.loads(out.with_suffix(".manifest.json").read_text())
    assert {"lora_merge_matmul", "lora_merge_gemm_transposed"} <= set(manifest["rules_applied"])
    # the second adapter has weight 1.0 (the default for the weights not given)
    import cuvil
    lib = cuvil.load(str(out))
    f = _feeds(m)
    want = ort_session(numpy_merged_model(m, [(d1, 0.5), (d2, 1.0)])).run(None, f)
    got = lib.run(f)
    for o, w in zip(m.graph.output, want):
        assert max_rel_error(got[o.name], w) <= RTOL
    # bad flags: exit 2 / 1 with the next step
    r = cli("compile", str(model), "--lora", str(d1), "--lora-weight", "1", "--lora-weight", "2", "-o", str(out))
    assert r.returncode in (1, 2) and "2 --lora-weight for 1 --lora" in r.stderr and "next:" in r.stderr
    r = cli("compile", str(model), "--lora", str(tmp_path / "missing"), "-o", str(out))
    assert r.returncode in (1, 2) and "does not exist" in r.stderr and "next:" in r.stderr


# ---- a PEFT-free torch reference of the same merge --------------------------------------------------------
def test_against_torch_reference(tmp_path):
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed (pip install 'cuvil[torch]'): the torch reference merge is skipped")
    model = onnx.load(EXPORTS / "bert.dynamo.onnx")
    d = _adapter(tmp_path, model, "bert", r=8, lora_alpha=16, config={"use_rslora": True})
    ad = read_adapter(d)
    p = Pipeline.from_onnx(model).with_lora(d)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    rng = np.random.default_rng(0)
    for t in map_adapter(model, ad):
        lm = ad.modules[t.module]
        w = inits[t.initializer]
        w_torch = torch.from_numpy(w.T.copy() if t.layout == "in_out" else w.copy())   # Linear: [out, in]
        A, B = torch.from_numpy(lm.A), torch.from_numpy(lm.B)
        scale = 16 / math.sqrt(8)
        merged_torch = w_torch + scale * (B @ A)          # PEFT's merge, in float32
        ours = _merged_weight(p, t.node)
        ours_torch_layout = ours.T if t.layout == "in_out" else ours
        assert max_rel_error(ours_torch_layout, merged_torch.numpy().astype(np.float64)) <= 1e-6, t.module
        # the unmerged forward, as PEFT computes it, against x · merged
        x = torch.from_numpy(rng.standard_normal((5, lm.in_features)).astype(np.float32))
        unmerged = x @ w_torch.T + scale * ((x @ A.T) @ B.T)
        merged_out = x.numpy() @ ours_torch_layout.T
        assert max_rel_error(merged_out, unmerged.numpy().astype(np.float64)) <= RTOL, t.module


# ---- cuvil lora check ---------------------------------------------------------------------------------------
def test_lora_check(tmp_path, cli, monkeypatch):
    model = EXPORTS / "gpt2.torchscript.onnx"
    d = _adapter(tmp_path, onnx.load(model), "gpt2", scale_b=0.02)
    r = cli("lora", "check", str(model), str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    for needle in ("transformer.h.0.attn.c_attn", "model.transformer.h.0.attn.c_attn.weight", "32x96", "4x32",
                   "96x4", "output logits: merged (Cuvil library) vs unmerged (reference)", "lora check: ok"):
        assert needle in r.stdout, (needle, r.stdout)
    # the gate decides the exit status
    import cuvil.cli.lora as lora_cli
    monkeypatch.setattr(lora_cli, "GATES", {"float32": 0.0})
    r = cli("lora", "check", str(model), str(d))
    assert r.returncode == 1 and "lora check: FAILED" in r.stdout
    # an error: one line naming it, the next step, exit 1
    bad = write_peft_adapter(tmp_path / "bad", {"transformer.h.0.attn.c_atn": (32, 96)})
    r = cli("lora", "check", str(model), str(bad))
    assert r.returncode == 1 and "'transformer.h.0.attn.c_atn' maps to no weight" in r.stderr and "next:" in r.stderr


def test_onnx_adapter_merges_like_peft(tmp_path):
    """An onnxruntime .onnx_adapter (no config: scale 1) merges to the same weight as the PEFT adapter with its
    scale folded into B."""
    ort = pytest.importorskip("onnxruntime")
    if not hasattr(ort, "AdapterFormat"):
        pytest.skip(f"onnxruntime {ort.__version__} has no AdapterFormat")
    model = onnx.load(EXPORTS / "gpt2.dynamo.onnx")
    d = write_peft_adapter(tmp_path / "peft", model_modules(model, r"h\.1\.mlp\.c_fc$|lm_head$"), r=4, lora_alpha=4)
    ad = read_adapter(d)   # scale alpha / r = 1: the same tensors written as an .onnx_adapter merge the same
    fmt = ort.AdapterFormat()
    fmt.set_parameters({f"{m}.lora_{w}.weight": ort.OrtValue.ortvalue_from_numpy(getattr(lm, w))
                        for m, lm in ad.modules.items() for w in "AB"})
    path = tmp_path / "x.onnx_adapter"
    fmt.export_adapter(str(path))
    a = Pipeline.from_onnx(model).with_lora(path)
    b = Pipeline.from_onnx(model).with_lora(d)
    for t in map_adapter(model, ad):
        np.testing.assert_array_equal(_merged_weight(a, t.node), _merged_weight(b, t.node))
    # the tied lm_head: the embedding's Gather still reads the original table
    t, = [t for t in map_adapter(model, ad) if t.module == "lm_head"]
    gather = [n for n in a.graph.nodes if n.op == "Gather" and n.inputs[0].is_const
              and n.inputs[0].shape == (512, 32)]
    w = numpy_helper.to_array({i.name: i for i in model.graph.initializer}[t.initializer])
    assert gather and all(np.array_equal(n.inputs[0].const, w) for n in gather)
    assert not np.array_equal(_merged_weight(a, t.node), w)


def test_bf16_weights_round_to_bf16(tmp_path):
    import ml_dtypes
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "lin.weight"], ["y"], name="/lin/MatMul")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 6])],
                          [numpy_helper.from_array(w, "lin.weight")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    d = write_peft_adapter(tmp_path / "a", {"lin": (8, 6)}, r=2, lora_alpha=3, scale_b=0.5)
    got = _merged_weight(Pipeline.from_onnx(model).with_lora(d), "/lin/MatMul")
    assert got.dtype == ml_dtypes.bfloat16
    lm, = read_adapter(d).modules.values()
    np.testing.assert_array_equal(got.astype(np.float64), _exact_merge(w, [(lm, 1.0, "in_out")], "bfloat16"))
