"""LoRA slots: adapters swapped at run time in a library compiled with ``lora_slots=`` (issue 23, part 2).

The model is the committed BERT export (tests/fixtures/exports/bert.torchscript.onnx: hidden 32, 2 layers); the
adapters are random numpy tensors in PEFT's layout (A [r, in], B [out, r]). The reference for an adapter is
the model with its weights merged in float64 (W + s·(B·A)ᵀ for the exporter's [in, out] MatMul weights), run by
onnxruntime.
"""
from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import cuvil
from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.lora.slots import DEFAULT_TARGETS, add_lora_slots, linear_layers, select_targets
from cuvil.targets.x86.header import ERROR_CODES
from cuvil.targets.x86.loader import CTensor

ort = pytest.importorskip("onnxruntime")

MODEL = os.path.join(os.path.dirname(__file__), "fixtures", "exports", "bert.torchscript.onnx")
GPT2 = os.path.join(os.path.dirname(__file__), "fixtures", "exports", "gpt2.torchscript.onnx")
PROFILE = {"batch": (1, 1, 2), "sequence": (1, 8, 16)}
RANK = 4
CODES = {name: code for name, code, _ in ERROR_CODES}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """(slotted library, base library): the same optimized graph compiled with and without rank-4 slots."""
    p = Pipeline.from_onnx(MODEL).optimize()
    slotted = p.compile(lora_slots=RANK, shape_profiles=PROFILE, cache=False)
    base = p.compile(shape_profiles=PROFILE, cache=False)
    return slotted, base


@pytest.fixture
def model(libs):
    m = cuvil.load(libs[0].path)
    yield m
    m.close()


def inputs(batch: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq // 2:] = 0   # padding in the last row
    return {"input_ids": rng.integers(0, 500, (batch, seq)), "attention_mask": mask,
            "token_type_ids": np.zeros((batch, seq), np.int64)}


def make_adapter(slots, suffixes, rank: int, seed: int, scale: float = 2.0) -> dict:
    """{module: (A, B, scale)} on the slots whose module ends with one of ``suffixes``, named as PEFT names
    them (without the exporter's ``model.`` wrapper)."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in slots:
        if s["module"].endswith(suffixes):
            out[s["module"].removeprefix("model.")] = (
                (rng.standard_normal((rank, s["in"])) * 0.3).astype(np.float32),
                (rng.standard_normal((s["out"], rank)) * 0.3).astype(np.float32), scale)
    return out


def merged_reference(manifest: dict, adapter: dict, x: dict, weight: float = 1.0) -> dict:
    """onnxruntime on the model whose targeted weights are merged in float64 and rounded once."""
    mo = onnx.load(MODEL)
    inits = {i.name: i for i in mo.graph.initializer}
    for s in manifest["lora_slots"]:
        module = s["module"].removeprefix("model.")
        if module in adapter:
            a, b, scale = adapter[module]
            w = numpy_helper.to_array(inits[s["weight"]]).astype(np.float64)
            w = w + weight * scale * (b.astype(np.float64) @ a.astype(np.float64)).T   # [in, out]
            inits[s["weight"]].CopyFrom(numpy_helper.from_array(w.astype(np.float32), s["weight"]))
    sess = ort.InferenceSession(mo.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, x)))


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


# -- the graph pass ---------------------------------------------------------------------------------------

def test_default_targets_are_the_attention_projections():
    g = Pipeline.from_onnx(MODEL).optimize().graph
    chosen = [t[2] for t in select_targets(g)]
    assert chosen == [f"model.encoder.layer.{i}.attention.{m}" for i in range(2)
                      for m in ("self.query", "self.key", "self.value", "output.dense")]
    # GPT-2: c_attn and the attention's c_proj, not the MLP's c_proj
    g2 = Pipeline.from_onnx(GPT2).graph
    chosen = [t[2] for t in select_targets(g2)]
    assert chosen == [f"model.transformer.h.{i}.attn.{m}" for i in range(2) for m in ("c_attn", "c_proj")]
    assert "attn.c_proj" in DEFAULT_TARGETS


def test_targets_by_suffix_and_by_regex():
    g = Pipeline.from_onnx(MODEL).optimize().graph
    assert [t[2] for t in select_targets(g, ["layer.1.attention.self.value"])] == [
        "model.encoder.layer.1.attention.self.value"]
    assert [t[2] for t in select_targets(g, [r".*layer\.0\.(intermediate|output)\.dense"])] == [
        "model.encoder.layer.0.intermediate.dense", "model.encoder.layer.0.output.dense"]
    with pytest.raises(CuvilError, match="matches no linear layer") as e:
        select_targets(g, ["query", "qkv"])
    assert "model.encoder.layer.0" in str(e.value)
    with pytest.raises(CuvilError, match="not a valid regular expression"):
        select_targets(g, ["query(["])


def test_slot_graph_has_guarded_branches_and_hidden_inputs():
    g = Pipeline.from_onnx(MODEL).optimize().graph
    g2, slots = add_lora_slots(g, 8, ["query"])
    assert [s.module for s in slots] == ["model.encoder.layer.0.attention.self.query",
                                         "model.encoder.layer.1.attention.self.query"]
    assert [v.name for v in g2.inputs[-6:]] == ["lora.0.A", "lora.0.B", "lora.0.on", "lora.1.A", "lora.1.B", "lora.1.on"]
    assert tuple(g2.inputs[-6].shape) == (32, 8) and tuple(g2.inputs[-5].shape) == (8, 32)
    guarded = [n for n in g2.nodes if n.guard is not None]
    assert len(guarded) == 6 and all(n.guard[0].name.endswith(".on") for n in guarded)
    assert len(g.inputs) == 3   # the input graph is left alone
    with pytest.raises(CuvilError, match="smaller dimension"):
        add_lora_slots(g, 33, ["query"])
    assert len(linear_layers(g)) == 13   # 6 per layer and the pooler's Gemm


# -- the library ------------------------------------------------------------------------------------------

def test_no_adapter_is_the_base_model_bit_for_bit(libs, model):
    base = cuvil.load(libs[1].path)
    for batch, seq in ((1, 8), (2, 13), (1, 1)):   # the opt point's kernels and the generic ones
        x = inputs(batch, seq)
        y, yb = model.run(x), base.run(x)
        for k in yb:
            assert y[k].tobytes() == yb[k].tobytes(), (k, batch, seq)
    # after an adapter was active and set back to None, too
    model.load_adapter("a", make_adapter(model.lora_slots, ("query",), RANK, 1))
    model.set_adapter("a")
    x = inputs(2, 13)
    assert not np.array_equal(model.run(x)["last_hidden_state"], base.run(x)["last_hidden_state"])
    model.set_adapter(None)
    assert model.run(x)["last_hidden_state"].tobytes() == base.run(x)["last_hidden_state"].tobytes()
    base.close()


def test_each_adapter_matches_the_merged_model(libs, model):
    manifest = libs[0].manifest
    full = make_adapter(model.lora_slots, ("query", "key", "value", "dense"), RANK, 2)       # rank = slot rank
    small = make_adapter(model.lora_slots, ("query", "value"), 2, 3, scale=4.0)              # rank 2 < 4, zero-padded
    model.load_adapter("full", full)
    model.load_adapter("small", small, weight=0.5)
    assert model.adapters == ["full", "small"]
    for name, adapter, weight in (("full", full, 1.0), ("small", small, 0.5)):
        model.set_adapter(name)
        for batch, seq in ((1, 8), (2, 13)):
            x = inputs(batch, seq, seed=batch)
            y, ref = model.run(x), merged_reference(manifest, adapter, x, weight)
            base_ref = merged_reference(manifest, {}, x)
            for k in ref:
                assert rel_err(y[k], ref[k]) <= 1e-4, (name, k)
                assert rel_err(base_ref[k], ref[k]) > 1e-3   # the adapter does change the output


def test_peft_adapters_match_the_merged_library(libs, model, tmp_path):
    """PEFT directories (the issue's goal): an adapter hot-swapped in the slot library against the library
    compiled with it merged at compile time (Pipeline.with_lora), with another adapter loaded beside it."""
    pytest.importorskip("safetensors")
    from cuvil.testing.lora import model_modules, write_peft_adapter
    attn = model_modules(MODEL, r"attention\.(self\.(query|key|value)|output\.dense)$")
    qv = {k: v for k, v in attn.items() if k.endswith(("query", "value"))}
    d1 = write_peft_adapter(tmp_path / "a1", attn, r=RANK, lora_alpha=16, seed=1, scale_b=0.3)
    d2 = write_peft_adapter(tmp_path / "a2", qv, r=2, lora_alpha=8, seed=2, scale_b=0.3)
    model.load_adapter("a1", d1)
    model.load_adapter("a2", str(d2), weight=0.7)
    x = inputs(2, 13)
    base = model.run(x, adapter=None)["last_hidden_state"]
    for name, d, weight in (("a2", d2, 0.7),):    # rank 2 < 4 (padded), weighted; a1 is the ORT test's kind
        merged = Pipeline.from_onnx(MODEL).with_lora(d, weight).optimize().compile(
            shape_profiles=PROFILE, opt_kernels=False, cache=False)
        ref = cuvil.load(merged.path).run(x)
        y = model.run(x, adapter=name)
        for k in ref:
            assert rel_err(y[k], ref[k]) <= 1e-4, (name, k)
        assert rel_err(base, ref["last_hidden_state"]) > 1e-3


def test_switching_per_call(model):
    a = make_adapter(model.lora_slots, ("query", "value"), RANK, 4)
    b = make_adapter(model.lora_slots, ("key", "dense"), 3, 5)
    model.load_adapter("a", a)
    model.load_adapter("b", b)
    x = inputs(2, 11)
    alone = {}
    for name in ("a", "b", None):
        model.set_adapter(name)
        alone[name] = model.run(x)["last_hidden_state"]
    assert not np.array_equal(alone["a"], alone["b"])
    model.set_adapter("b")
    for name in ("a", None, "b", "a", "a", None):
        assert model.run(x, adapter=name)["last_hidden_state"].tobytes() == alone[name].tobytes(), name
    assert model.active_adapter == "b"   # a per-call adapter leaves set_adapter's choice alone
    assert model.run(x)["last_hidden_state"].tobytes() == alone["b"].tobytes()
    # a new session (another thread count) starts from the model's choice too
    assert model.run(x, num_threads=1)["last_hidden_state"].tobytes() == alone["b"].tobytes()


def test_unload(model, libs):
    base = cuvil.load(libs[1].path)
    model.load_adapter("a", make_adapter(model.lora_slots, ("query",), RANK, 6))
    model.set_adapter("a")
    x = inputs(1, 8)
    model.unload_adapter("a")
    assert model.adapters == [] and model.active_adapter is None
    assert model.run(x)["pooler_output"].tobytes() == base.run(x)["pooler_output"].tobytes()
    with pytest.raises(CuvilError, match="no adapter named 'a' is loaded"):
        model.set_adapter("a")
    with pytest.raises(CuvilError, match="no adapter named 'a'"):
        model.unload_adapter("a")
    model.load_adapter("a", make_adapter(model.lora_slots, ("key",), RANK, 7))   # the name is free again
    base.close()


def test_memory_is_the_adapters_size(model):
    slots = model.lora_slots
    model.load_adapter("qv", make_adapter(slots, ("query", "value"), 2, 8))
    n = sum(1 for s in slots if s["module"].endswith(("query", "value")))
    per_slot = (32 + 32) * RANK * 4
    assert per_slot * n <= model.adapter_bytes("qv") <= (per_slot + 64) * n


def test_errors_name_the_next_step(model, libs):
    slots = model.lora_slots
    with pytest.raises(CuvilError, match="rank 8, above the library's slot rank 4") as e:
        model.load_adapter("big", make_adapter(slots, ("query",), 8, 9))
    assert "--lora-slots 8" in e.value.hint
    ffn = make_adapter([{"module": "model.encoder.layer.0.intermediate.dense", "in": 32, "out": 64}], ("dense",), 2, 1)
    with pytest.raises(CuvilError, match="has no LoRA slot") as e:
        model.load_adapter("ffn", ffn)
    assert "--lora-targets" in e.value.hint
    bad = make_adapter(slots, ("layer.0.attention.self.query",), 2, 1)
    module = next(iter(bad))
    bad[module] = (bad[module][0][:, :16], bad[module][1], 1.0)
    with pytest.raises(CuvilError, match=r"A is \[2, 16\].*takes A \[r, 32\]"):
        model.load_adapter("bad", bad)
    nan = make_adapter(slots, ("query",), 2, 1)
    nan[next(iter(nan))][0][0, 0] = np.nan
    with pytest.raises(CuvilError, match="non-finite"):
        model.load_adapter("nan", nan)
    model.load_adapter("ok", make_adapter(slots, ("query",), 2, 1))
    with pytest.raises(CuvilError, match="already loaded"):
        model.load_adapter("ok", make_adapter(slots, ("query",), 2, 1))
    with pytest.raises(CuvilError, match="no adapter named 'nope'"):
        model.run(inputs(1, 4), adapter="nope")
    assert model.adapters == ["ok"]   # failed loads leave nothing behind
    base = cuvil.load(libs[1].path)
    assert base.lora_slots == []
    with pytest.raises(CuvilError, match="has no LoRA slots") as e:
        base.load_adapter("ok", make_adapter(slots, ("query",), 2, 1))
    assert "--lora-slots" in e.value.hint
    base.close()


def test_compile_errors():
    p = Pipeline.from_onnx(MODEL).optimize()
    with pytest.raises(CuvilError, match="matches no linear layer"):
        p.compile(lora_slots=4, lora_targets=["qkv_proj"], shape_profiles=PROFILE, cache=False)
    with pytest.raises(CuvilError, match="without --lora-slots"):
        p.compile(lora_targets=["query"], shape_profiles=PROFILE, cache=False)
    with pytest.raises(CuvilError, match="lora_slots takes a rank"):
        p.compile(lora_slots=-1, shape_profiles=PROFILE, cache=False)


# -- the C ABI, through ctypes ------------------------------------------------------------------------------

def _tensor(a: np.ndarray, keep: list) -> CTensor:
    shape = (ctypes.c_int64 * a.ndim)(*a.shape)
    keep += [a, shape]
    return CTensor(a.ctypes.data, 1 if a.dtype == np.float32 else 7, a.ndim, shape)


def test_c_abi(libs):
    """The adapter calls from C's point of view: slot info, load (copied: the caller's buffers are freed),
    activate, unload while active (the session keeps the adapter until it switches away), the codes."""
    m = cuvil.load(libs[0].path)   # for running; the raw calls go to the same library
    lib = m.lib
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.cuvil_num_lora_slots.restype = ctypes.c_int
    lib.cuvil_lora_slot_info.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p, i64p]
    lib.cuvil_adapter_load.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32),
                                       ctypes.POINTER(CTensor), ctypes.POINTER(CTensor), ctypes.POINTER(ctypes.c_float)]
    lib.cuvil_adapter_activate.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.cuvil_adapter_unload.argtypes = [ctypes.c_char_p]
    lib.cuvil_last_error.restype = ctypes.c_char_p
    assert lib.cuvil_num_lora_slots() == 8
    name, d_in, d_out, rank = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    assert lib.cuvil_lora_slot_info(2, ctypes.byref(name), ctypes.byref(d_in), ctypes.byref(d_out),
                                    ctypes.byref(rank)) == 0
    assert (name.value, d_in.value, d_out.value, rank.value) == (b"model.encoder.layer.0.attention.self.value", 32, 32, 4)
    assert lib.cuvil_lora_slot_info(8, None, None, None, None) == CODES["CUVIL_ERR_INDEX"]

    rng = np.random.default_rng(11)
    a = (rng.standard_normal((3, 32)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((32, 3)) * 0.3).astype(np.float32)

    def load(nm: bytes, slot: int, a, b, scale=1.5) -> int:
        keep = []
        ta, tb = (CTensor * 1)(_tensor(a, keep)), (CTensor * 1)(_tensor(b, keep))
        return lib.cuvil_adapter_load(nm, 1, (ctypes.c_int32 * 1)(slot), ta, tb, (ctypes.c_float * 1)(scale))

    assert load(b"c", 0, a, b) == 0
    assert load(b"c", 0, a, b) == CODES["CUVIL_ERR_ADAPTER_EXISTS"]
    big = np.zeros((5, 32), np.float32)
    assert load(b"big", 0, big, np.zeros((32, 5), np.float32)) == CODES["CUVIL_ERR_LORA_RANK"]
    assert b"--lora-slots 5" in lib.cuvil_last_error()
    assert load(b"bad", 0, a[:, :16].copy(), b) == CODES["CUVIL_ERR_DIM"]
    assert load(b"bad", 9, a, b) == CODES["CUVIL_ERR_INDEX"]
    assert load(b"bad", 0, a.astype(np.int64), b) == CODES["CUVIL_ERR_DTYPE"]
    assert load(None, 0, a, b) == CODES["CUVIL_ERR_NULL_ARGUMENT"]
    assert lib.cuvil_adapter_load(b"bad", 1, None, None, None, None) == CODES["CUVIL_ERR_NULL_ARGUMENT"]
    assert lib.cuvil_adapter_load(b"bad", -1, None, None, None, None) == CODES["CUVIL_ERR_INDEX"]
    assert lib.cuvil_adapter_unload(None) == CODES["CUVIL_ERR_NULL_ARGUMENT"]
    assert lib.cuvil_adapter_activate(None, b"c") == CODES["CUVIL_ERR_NULL_SESSION"]
    assert lib.cuvil_adapter_activate(ctypes.c_void_p(12345), b"c") == CODES["CUVIL_ERR_BAD_SESSION"]

    x = inputs(1, 8)
    base_y = m.run(x)["last_hidden_state"]
    s = ctypes.c_void_p(m._get_session(None))   # the model's session, driven by raw calls below
    assert lib.cuvil_adapter_activate(s, b"nope") == CODES["CUVIL_ERR_ADAPTER_NAME"]
    assert lib.cuvil_adapter_activate(s, b"c") == 0
    outs = _raw_run(m, s, x)
    assert not np.array_equal(outs, base_y)
    assert lib.cuvil_adapter_unload(b"c") == 0                  # active in s: kept alive until s switches away
    assert lib.cuvil_adapter_unload(b"c") == CODES["CUVIL_ERR_ADAPTER_NAME"]
    assert _raw_run(m, s, x).tobytes() == outs.tobytes()
    assert lib.cuvil_adapter_activate(s, None) == 0             # frees it; the base model again
    assert _raw_run(m, s, x).tobytes() == base_y.tobytes()
    # the same tensors through Python (its names live in their own namespace: "c" does not clash)
    m.load_adapter("c", {"model.encoder.layer.0.attention.self.query": (a, b, 1.5)})
    assert m.run(x, adapter="c")["last_hidden_state"].tobytes() == outs.tobytes()
    m.close()

    base = cuvil.load(libs[1].path).lib
    base.cuvil_adapter_load.argtypes = lib.cuvil_adapter_load.argtypes
    base.cuvil_adapter_activate.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    assert base.cuvil_num_lora_slots() == 0
    assert base.cuvil_adapter_load(b"c", 0, None, None, None, None) == CODES["CUVIL_ERR_NO_LORA_SLOTS"]


def _raw_run(m, s, x) -> np.ndarray:
    """last_hidden_state of one cuvil_run on session s with the given inputs (no adapter switching)."""
    keep = []
    ins = (CTensor * 3)(*[_tensor(np.ascontiguousarray(x[k]), keep)
                          for k in ("input_ids", "attention_mask", "token_type_ids")])
    b, sq = x["input_ids"].shape
    y0, y1 = np.empty((b, sq, 32), np.float32), np.empty((b, 32), np.float32)
    outs = (CTensor * 2)(_tensor(y0, keep), _tensor(y1, keep))
    rc = m.lib.cuvil_run(s, ins, outs)
    assert rc == 0, m.lib.cuvil_last_error()
    return y0


# -- the CLI ----------------------------------------------------------------------------------------------------

SHAPES = ["--input-shape", "input_ids=1x1:1x8:2x16", "--input-shape", "attention_mask=1x1:1x8:2x16",
          "--input-shape", "token_type_ids=1x1:1x8:2x16"]


def test_cli_refusals(tmp_path, capsys):
    from cuvil.cli import main as cli_main
    out = str(tmp_path / "libm.so")
    assert cli_main(["compile", MODEL, "-o", out, "--lora-slots", "4", "--lora-targets", "qkv", *SHAPES, "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--lora-targets qkv matches no linear layer" in err and "next: " in err
    assert cli_main(["compile", MODEL, "-o", out, "--lora-targets", "query", *SHAPES, "-q"]) == 2
    assert "next: add --lora-slots RANK" in capsys.readouterr().err
    assert cli_main(["compile", MODEL, "-o", str(tmp_path / "m.cuvil"), "--target", "nvptx64-nvidia-cuda",
                     "--lora-slots", "4", "-q"]) == 2
    assert "apply to the x86 target only" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_activate_during_a_run_on_another_thread(libs):
    """A session running on one thread while another activates adapters on it: each activate returns 0 or
    CUVIL_ERR_BUSY, and every run computes entirely with the adapter active when it started (its output is
    exactly the base model's or the adapter's)."""
    import threading
    m = cuvil.load(libs[0].path, num_threads=1)
    m.load_adapter("a", make_adapter(m.lora_slots, ("query", "key", "value", "dense"), RANK, 12))
    x = inputs(2, 16)
    expected = {m.run(x, adapter=None)["last_hidden_state"].tobytes(), m.run(x, adapter="a")["last_hidden_state"].tobytes()}
    assert len(expected) == 2
    lib, s = m.lib, ctypes.c_void_p(m._get_session(None))
    lib.cuvil_adapter_activate.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    seen, codes, stop = [], set(), threading.Event()

    def runner():
        while not stop.is_set():
            seen.append(_raw_run(m, s, x).tobytes())
            time.sleep(0.001)   # the session idle between runs (and the GIL free): activates land there too

    t = threading.Thread(target=runner)
    t.start()
    try:
        deadline, i = time.monotonic() + 60, 0
        while time.monotonic() < deadline and not (len(codes) >= 2 and len(seen) >= 20):
            codes.add(lib.cuvil_adapter_activate(s, m._c_name("a") if i % 2 else None))
            i += 1
            time.sleep(0.0002)
    finally:
        stop.set()
        t.join()
    assert codes <= {0, CODES["CUVIL_ERR_BUSY"]} and CODES["CUVIL_ERR_BUSY"] in codes and 0 in codes
    assert seen and set(seen) <= expected
    m._session_adapter = "unknown"   # raw calls switched it behind the model's back
    m.close()


def test_gpt2_gemm_layers(tmp_path):
    """GPT-2's attention projections are Gemms over [tokens, in] with Conv1D weights [in, out]
    (fan_in_fan_out): the slot adds s·(x·Aᵀ)·Bᵀ whatever the layout, and matches the numpy-merged model."""
    pytest.importorskip("safetensors")
    from cuvil.testing.lora import model_modules, numpy_merged_model, write_peft_adapter
    mods = model_modules(GPT2, r"attn\.(c_attn|c_proj)$")
    d = write_peft_adapter(tmp_path / "g", mods, r=3, lora_alpha=6, seed=4, scale_b=0.3,
                           config={"fan_in_fan_out": True})
    art = Pipeline.from_onnx(GPT2).optimize().compile(lora_slots=RANK, shape_profiles=PROFILE, opt_kernels=False,
                                                      cache=False)
    assert [s["module"] for s in art.manifest["lora_slots"]] == [f"model.transformer.h.{i}.attn.{m}"
                                                                 for i in range(2) for m in ("c_attn", "c_proj")]
    m = cuvil.load(art.path)
    m.load_adapter("g", d)
    rng = np.random.default_rng(5)
    x = {"input_ids": rng.integers(0, 500, (2, 9)), "attention_mask": np.ones((2, 9), np.int64)}
    base = m.run(x)["logits"]
    sess = ort.InferenceSession(numpy_merged_model(onnx.load(GPT2), [(d, 1.0)]).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    ref = sess.run(None, x)[0]
    assert rel_err(m.run(x, adapter="g")["logits"], ref) <= 1e-4
    assert rel_err(base, ref) > 1e-3
    m.close()
