"""Fused attention on x86 (rules/attention.rule, cuvil.ir.ops.attention, cuvil.kernels.lower.attention): the
rules fire on the real exports, and the online-softmax kernel matches onnxruntime running the unfused ops at
several (B, S) from one library: S = 1, S not a multiple of the key block nor of the query block, padded and fully
masked rows (-inf: NaN without the guard, 0 with it; -FLT_MAX as the dynamo exporter writes it), a mask per head
(causal on one), NaN and infinite inputs (NaN where onnxruntime gives NaN), head sizes that are not whole vectors,
and the same bits at 1 and 2 threads (every row's sums run in a fixed order)."""
import json
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cuvil import Pipeline
from cuvil.ir.ops.attention import fused_attention_reference
from cuvil.kernels.bounds import BoundsProver, prove_stage
from cuvil.kernels.lower.attention import KEY_BLOCK, QUERY_BLOCK
from cuvil.kernels.schedule import schedule
from cuvil.targets.x86.gemm import tile_cols, tile_shapes
from cuvil.targets.x86.target import choose_algorithms
from cuvil.targets.x86.tuning import DEFAULT_TUNING
from cuvil.testing.attention_models import D, attention_model, feeds
from cuvil.testing.oracles import max_rel_error, ort_session
from test_real_exports import compare, symbols_of

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "exports"
# every export: torch's scaled_dot_product_attention as both exporters write it (BERT, DistilBERT, RoBERTa, GPT-2,
# ViT), T5's unscaled attention, Whisper's unmasked one
ATTENTION_EXPORTS = [e["file"] for e in json.loads((FIXTURES / "exports.json").read_text()) if e["status"] == "ok"]
RTOL = 1e-4     # tests/test_real_exports.py's tolerance


@pytest.mark.parametrize("name", ATTENTION_EXPORTS)
def test_rules_fuse_every_attention_of_the_export(name):
    p = Pipeline.from_onnx(onnx.load(FIXTURES / name)).optimize()
    softmaxes = sum(n.op == "Softmax" for n in p.graph.nodes)
    g, report = choose_algorithms(p.graph)
    assert softmaxes > 0 and sum(n.op == "FusedAttention" for n in g.nodes) == softmaxes
    assert not any(n.op == "Softmax" for n in g.nodes)
    _, off = choose_algorithms(p.graph, fused_attention=False)
    assert not any(r.startswith("fused_attention") for r, k in off.applied.items() if k)


SHAPES = [(1, 1), (2, 1), (1, KEY_BLOCK - 1), (4, KEY_BLOCK), (3, KEY_BLOCK + 1), (2, 3 * KEY_BLOCK + 5),
          (1, QUERY_BLOCK), (2, QUERY_BLOCK + 1)]


def tiled(art, variant: str = "generic") -> bool:
    """The library's kernels for any shape of the profile (``variant``; "opt": those for the opt point) run the
    tiled attention kernel (cuvil.targets.x86.attention), not the sequential form."""
    return any(st["kernel"] == "attention" for st in art.manifest["steps"] if st.get("variant", "generic") == variant)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("guard,mask_rank,fill", [(True, 2, float("-inf")), (False, 2, float("-inf")),
                                                  (True, 4, -3.4028235e38)])
def test_fused_kernel_matches_onnxruntime_from_one_library(guard, mask_rank, fill):
    model = attention_model(guard, mask_rank, fill)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"B": (1, 1, 4), "S": (1, 64, 128)},
                                                       cache=False)
    assert "FusedAttention" not in {n.op_type for n in model.graph.node}
    assert any(r.startswith("fused_attention") for r in art.manifest["rules_applied"])
    assert tiled(art)
    for batch, seq in SHAPES:
        f = feeds(batch, seq, mask_rank)
        want = ort_session(model).run(None, f)[0]
        got = art.run(f, num_threads=1)["y"]
        assert same_bits(got, art.run(f, num_threads=2)["y"]), (batch, seq)
        nan = np.isnan(want)
        # a fully masked row: NaN from the Softmax (no guard; -inf mask), as onnxruntime gives
        assert np.array_equal(np.isnan(got), nan), (batch, seq)
        assert nan.any() == (not guard and fill == float("-inf") and batch > 1)
        err = max_rel_error(np.where(nan, 0, got), np.where(nan, 0, want))
        assert err <= RTOL, (batch, seq, err)


@pytest.mark.parametrize("head", [64, 20, 4])
def test_fused_kernel_head_sizes(head):
    """Head size 64 (BERT's, four whole AVX-512 vectors per value row), 20 (a whole vector and a partial one:
    the output's last columns stored under a mask, the values padded with zeros) and 4 (padded to one 8-lane
    vector; 8, the other tests' size, is read in place as 8-lane vectors)."""
    model = attention_model(True, 4, float("-inf"), D=head)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"B": (1, 1, 2), "S": (1, 16, 64)}, cache=False)
    assert tiled(art)
    for batch, seq in [(1, 7), (2, KEY_BLOCK + 3)]:
        f = feeds(batch, seq, 4, D=head)
        want = ort_session(model).run(None, f)[0]
        got = art.run(f)["y"]
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert max_rel_error(got, want) <= RTOL, (head, batch, seq)


@pytest.mark.parametrize("guard", [True, False])
def test_fused_kernel_nan_and_inf_inputs_as_onnxruntime(guard):
    """A NaN query element (its row's scores NaN), a NaN value element under a masked key (0 * NaN is NaN in
    every row's P·V), a +inf key element (an infinite score: exp(inf - inf) is NaN), -inf everywhere on one
    batch row, a NaN key element in the second key panel (one NaN score in rows whose other scores are finite:
    the kernel's ``vmaxps`` max may drop it, its probability still makes the row NaN): the NaN elements are
    exactly onnxruntime's."""
    model = attention_model(guard, 2, float("-inf"))
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"B": (1, 1, 4), "S": (1, 40, 80)}, cache=False)
    assert tiled(art)
    seq = KEY_BLOCK + 7
    f = feeds(4, seq, 2)
    f["q"][0, 0, 3, 1] = np.nan
    f["v"][0, 1, seq - 1, 2] = np.nan        # row 0's keys past seq // 2 are masked
    f["k"][2, 2, 5, 0] = np.inf
    f["q"][2, 2, :, 0] = np.abs(f["q"][2, 2, :, 0])  # +inf * q > 0: +inf scores
    f["q"][2, 2, 4, 0] = 0.0                 # 0 * inf: a NaN score
    f["k"][3, 1, KEY_BLOCK + 3, 2] = np.nan  # batch row 3 masks no key: head 1's rows each one NaN score
    want = ort_session(model).run(None, f)[0]
    got = art.run(f)["y"]
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    assert max_rel_error(np.where(nan, 0, got), np.where(nan, 0, want)) <= RTOL


def test_symbolic_head_size_takes_the_sequential_form():
    """A head size that is a symbol has no tile layout: the sequential form (one program per query row) runs,
    with the same NaN rows as onnxruntime (guarded: a fully masked row is sum_j 0 * V[j])."""
    model = attention_model(True, 2, float("-inf"))
    for vi in list(model.graph.input)[:3]:
        vi.type.tensor_type.shape.dim[3].dim_param = "D"
    model.graph.output[0].type.tensor_type.shape.dim[3].dim_param = "D"
    art = Pipeline.from_onnx(model).optimize().compile(
        shape_profiles={"B": (1, 1, 4), "S": (1, 16, 64), "D": (1, 8, 16)}, cache=False)
    assert any(r.startswith("fused_attention") for r in art.manifest["rules_applied"])
    assert not tiled(art) and tiled(art, "opt")     # D = 8 at the opt point: tiles there
    for batch, seq in [(2, 7), (4, KEY_BLOCK + 1)]:
        f = feeds(batch, seq, 2)
        f["v"][1, 0, 0, 0] = np.inf           # batch row 1 is fully masked: its column 0 of head 0 is NaN
        want = ort_session(model).run(None, f)[0]
        got = art.run(f)["y"]
        assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want)), (batch, seq)
        assert max_rel_error(np.nan_to_num(got), np.nan_to_num(want)) <= RTOL, (batch, seq)


@pytest.mark.parametrize("head", [32, 8])
def test_tile_accesses_are_proved_and_a_widened_tile_refuted(head):
    """The tile kernel's accesses (kernels/bounds.py, family "attention") are proved on a real schedule and
    refuted once its key panels or value rows are read one vector wider than stored: the stage is then
    guarded back to its plain expression. Head size 8: the values read in place, rows of 8."""
    p = Pipeline.from_onnx(attention_model(True, 2, float("-inf"), D=head)).optimize().specialize({"B": 2, "S": 40})
    p = p.choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    prover = BoundsProver()
    st = next(st for st in sched.stages if st.expr.op == "attention")
    assert prove_stage(prover, sched, st)[1] == []
    spec = st.expr.attr
    assert spec.dvp == head and spec.v_axes is not None        # the values read in place
    for field in ("kb", "dvp"):
        old = getattr(spec, field)
        setattr(spec, field, old + 16)
        failed = prove_stage(prover, sched, st)[1]
        assert any(a.kind == "family:attention" for a, _ in failed), field
        setattr(spec, field, old)


def test_reference_is_the_unfused_composite():
    model = attention_model(True, 4, float("-inf"))
    f = feeds(3, 7, 4)
    want = ort_session(model).run(None, f)[0]
    mask = np.where(f["keep"], np.float32(0), np.float32("-inf"))
    got = fused_attention_reference(f["q"], f["k"].transpose(0, 1, 3, 2), f["v"], np.float32(D ** -0.5), mask, 1)
    assert max_rel_error(got, want) <= RTOL


@pytest.mark.parametrize("name", ["bert.dynamo.onnx", "gpt2.torchscript.onnx"])
def test_real_export_fused_from_one_library_at_s1_and_odd_s(name):
    """The issue's profile (B = 1..8, S = 1..512, opt S = 128), one library, padded masks (tests/test_real_exports.py's
    feeds: a row half padded, a row with one token): S = 1, S not a multiple of the key block, B up to 4."""
    model = onnx.load(FIXTURES / name)
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(shape_profiles=symbols_of(p, batch=(1, 1, 8), sequence=(1, 128, 512)))
    assert art.manifest["rules_applied"]["fused_attention_guarded"]["applied"] == 2
    for batch, seq in [(1, 1), (4, 1), (2, KEY_BLOCK + 1), (4, 100)]:
        compare(model, art, batch, seq)


@pytest.fixture(scope="module")
def tiny_decode():
    """A GPT-2 decode step (hidden 64, 4 heads of 16; one layer) compiled once for batch 1..2, past 1..200."""
    from cuvil.testing.hf_models import gpt2_decode_model
    model = gpt2_decode_model(vocab=512, hidden=64, layers=1, heads=4, ffn=128, max_pos=256)
    art = Pipeline.from_onnx(model).compile(
        shape_profiles={"batch": (1, 1, 2), "past_sequence": (1, 32, 200), "total_sequence": (2, 33, 201)}, cache=False)
    return model, art


def decode_feeds(batch: int, past: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = {"input_ids": rng.integers(0, 512, (batch, 1)).astype(np.int64),
         "attention_mask": np.ones((batch, past + 1), np.int64)}
    for kv in ("key", "value"):
        f[f"past_key_values.0.{kv}"] = rng.standard_normal((batch, 4, past, 16)).astype(np.float32)
    return f


@pytest.mark.parametrize("past", [1, 2, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 3 * KEY_BLOCK + 5])
def test_decode_step_reads_the_key_cache_in_place(tiny_decode, past):
    """One query row (a decode step): the kernel reads the keys in the cache's own layout (no attention_keys
    stage copying the whole cache into panels each call), every key's score a dot product of its row; same
    bits at 1 and 2 threads; onnxruntime's outputs at past lengths around the key panel (1, odd, 31/32/33)."""
    model, art = tiny_decode
    kernels = [st["kernel"] for st in art.manifest["steps"]]
    assert "attention" in kernels and "attention_keys" not in kernels
    assert art.manifest["memory_safety"]["guarded"] == []
    for batch in (1, 2):
        f = decode_feeds(batch, past, seed=past)
        if batch == 2:      # padded keys on row 1 (its last past key and the first)
            f["attention_mask"][1, [0, past - 1]] = 0
        want = dict(zip([o.name for o in model.graph.output], ort_session(model).run(None, f)))
        got = art.run(f, num_threads=1)
        again = art.run(f, num_threads=2)
        for name, w in want.items():
            assert same_bits(got[name], again[name]), (past, batch, name)
            assert max_rel_error(got[name], w) <= RTOL, (past, batch, name)


def test_decode_step_in_place_nan_inf_and_masked_rows(tiny_decode):
    """Keys read in place keep the tile kernel's NaN semantics: a NaN key element under a masked key (its score
    NaN + -inf is NaN: the row's probabilities NaN, the guard makes them 0), an infinite value, a row whose
    every key is masked (sum_j 0 * V[j]); the NaN elements are exactly onnxruntime's."""
    model, art = tiny_decode
    past = KEY_BLOCK + 3
    f = decode_feeds(2, past, seed=1)
    f["attention_mask"][0, 5] = 0
    f["past_key_values.0.key"][0, 2, 5, 3] = np.nan      # batch 0 head 2: masked NaN key -> guarded row
    f["past_key_values.0.value"][0, 1, 7, 0] = np.inf    # batch 0 head 1: inf in a value column
    f["attention_mask"][1, :] = 0                        # batch 1: every key masked
    want = ort_session(model).run(None, f)
    got = art.run(f)
    for o, w in zip(model.graph.output, want):
        g = got[o.name]
        assert np.array_equal(np.isnan(g), np.isnan(w)), o.name
        assert max_rel_error(np.nan_to_num(g), np.nan_to_num(w)) <= RTOL, o.name


def test_in_place_key_accesses_are_proved_and_a_widened_row_refuted():
    """kernels/bounds.py's "attention" family for keys read in place: each key row (clamped to the last key)
    proved inside the cache; reading rows one vector wider than the head size, or panels past the last key
    without the clamp's bound (a key count one larger), is refuted."""
    from cuvil.testing.hf_models import gpt2_decode_model
    model = gpt2_decode_model(vocab=64, hidden=32, layers=1, heads=2, ffn=64, max_pos=64)
    p = Pipeline.from_onnx(model).optimize().specialize({"batch": 1, "past_sequence": 40, "total_sequence": 41})
    p = p.choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    assert not any(st.expr.op == "attention_keys" for st in sched.stages)
    st = next(st for st in sched.stages if st.expr.op == "attention")
    spec = st.expr.attr
    assert spec.k_axes is not None and spec.v_axes is not None
    prover = BoundsProver()
    assert prove_stage(prover, sched, st)[1] == []
    for field, delta in (("d", 16), ("keys", 1)):
        old = getattr(spec, field)
        setattr(spec, field, old + delta)
        failed = prove_stage(prover, sched, st)[1]
        assert any(a.kind == "family:attention" and a.buf is spec.kt for a, _ in failed), field
        setattr(spec, field, old)


def cache_attention_model(sq: int, heads: int = 2, d: int = 32) -> onnx.ModelProto:
    """``sq`` new tokens against a KV cache: present = Concat(past, new) (outputs), attention over it, unmasked."""
    a = np.float32(d ** -0.25)
    nodes = [helper.make_node("Concat", ["pk", "k"], ["K"], axis=2), helper.make_node("Concat", ["pv", "v"], ["V"], axis=2),
             helper.make_node("Transpose", ["K"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["q", "a"], ["qs"]), helper.make_node("Mul", ["kt", "a"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "V"], ["y"])]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, heads, "P" if n.startswith("p") else sq, d])
           for n in ("q", "pk", "pv", "k", "v")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, heads, sq, d])] + \
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "KV"]
    g = helper.make_graph(nodes, "cache_attention", ins, outs, [helper.make_tensor("a", TensorProto.FLOAT, [], [a])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("sq", [1, 2, 3])
def test_few_new_tokens_read_keys_in_place(sq):
    """Up to IN_PLACE_ROWS static query rows read the cache's keys in place (no attention_keys stage), more take
    the key panels; onnxruntime's output at past 1, 31-33 (around a key panel) and 70, same bits at 1 and 2
    threads."""
    from cuvil.kernels.lower.attention import IN_PLACE_ROWS
    model = cache_attention_model(sq)
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"P": (1, 16, 100)}, cache=False)
    kernels = [st["kernel"] for st in art.manifest["steps"]]
    assert "attention" in kernels and ("attention_keys" in kernels) == (sq > IN_PLACE_ROWS)
    for past in (1, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 70):
        rng = np.random.default_rng(past)
        f = {n: rng.standard_normal((1, 2, past if n.startswith("p") else sq, 32)).astype(np.float32)
             for n in ("q", "pk", "pv", "k", "v")}
        want = ort_session(model).run(None, f)[0]
        got = art.run(f, num_threads=1)["y"]
        assert same_bits(got, art.run(f, num_threads=2)["y"]), past
        assert max_rel_error(got, want) <= RTOL, past


@pytest.mark.parametrize("past", [1, 127, 1023])
def test_decode_step_one_library_per_past(past):
    """The decode step as bench/decode_step.py builds it by default (one library per past length, static
    shapes): the `present` Concats take the block copies (x86/copy.py) wherever the past is a run of at least
    1 KiB, attention reads the keys in place; onnxruntime's outputs with and without padded keys in the mask,
    the same bits at 1 and 2 threads."""
    from cuvil.testing.hf_models import gpt2_decode_model
    model = gpt2_decode_model(vocab=512, hidden=64, layers=1, heads=4, ffn=128, max_pos=1100)
    art = Pipeline.from_onnx(model).compile(fixed={"batch": 2, "past_sequence": past, "total_sequence": past + 1},
                                            cache=False)
    kernels = [st["kernel"] for st in art.manifest["steps"]]
    assert "attention" in kernels and "attention_keys" not in kernels
    for masked in (False, True):
        f = decode_feeds(2, past, seed=past)
        if masked:
            f["attention_mask"][1, [0, past - 1]] = 0
        want = dict(zip([o.name for o in model.graph.output], ort_session(model).run(None, f)))
        got, again = art.run(f, num_threads=1), art.run(f, num_threads=2)
        for name, w in want.items():
            assert same_bits(got[name], again[name]), (past, masked, name)
            if name.startswith("present"):      # the past part is a copy of the input: its bits
                kv = "key" if name.endswith("key") else "value"
                assert got[name][:, :, :past].tobytes() == f[f"past_key_values.0.{kv}"].tobytes(), (past, name)
            assert max_rel_error(got[name], w) <= RTOL, (past, masked, name)


@pytest.mark.parametrize("name", ["bert.torchscript.onnx", "bert.dynamo.onnx"])
def test_exports_attention_reads_queries_in_place_and_stores_rows_where_heads_merge(name):
    """BERT as both exporters write it, S = 40 (two key panels, a partial query tile): the queries are read
    from the Q projection's output (no ``queries`` copy), the kernel stores its rows [B, S, H, D] (the heads'
    merge, Transpose [0, 2, 1, 3] then Reshape, a view: no copy stage between the attention and the output
    projection), and the outputs are onnxruntime's."""
    model = onnx.load(FIXTURES / name)
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(fixed=symbols_of(p, batch=2, sequence=40), cache=False)
    steps = art.manifest["steps"]
    attn = [k for k, st in enumerate(steps) if st["kernel"] == "attention"]
    assert attn and not any(st["stage"].endswith("_queries") for st in steps)
    for k in attn:
        assert steps[k]["shape"][1] == 40, steps[k]       # [B, S, H, D]: rows where the heads merge
        assert steps[k + 1]["kernel"] == "gemm", (steps[k], steps[k + 1])   # the output projection reads them
    compare(model, art, 2, 40)


def test_key_panels_rows_loaded_whole_are_proved_and_a_larger_key_count_refuted():
    """kernels/bounds.py's "attention_keys" family: BERT's key panels whose keys are all below the key count
    load their rows straight from the K projection's output (x86/attention.py); those loads are proved inside
    it, and refuted once the panel test trusts more keys than there are (S = 40: a key count of 64 makes the
    second panel, keys 32 .. 63, look whole)."""
    from cuvil.testing.hf_models import bert_model
    model = bert_model(vocab=64, hidden=32, layers=1, heads=2, ffn=64, max_pos=128, type_vocab=2)
    p = Pipeline.from_onnx(model).optimize().specialize({"batch": 1, "sequence": 40})
    p = p.choose_algorithms("x86_64-linux-gnu", None)
    sched = schedule(p.graph, gemm_cols=tile_cols(512), split_concat=True, gemm_tiles=tile_shapes(512),
                     row_kernels=True, channel_tile_cost=DEFAULT_TUNING.channel_tile_cost)
    st = next(st for st in sched.stages if st.expr.op == "attention_keys")
    assert st.expr.attr is not None        # the keys' stored rows: whole panels load them
    prover = BoundsProver()
    assert prove_stage(prover, sched, st)[1] == []
    kbuf, axes, keys = st.expr.attr
    st.expr.attr = (kbuf, axes, 2 * KEY_BLOCK)
    failed = prove_stage(prover, sched, st)[1]
    st.expr.attr = (kbuf, axes, keys)
    assert any(a.kind == "family:attention_keys" and a.buf is kbuf for a, _ in failed)
