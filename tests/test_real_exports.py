"""Transformers as users export them: torch.onnx exports (both exporters) of small Hugging Face configs,
committed under tests/fixtures/exports/ (exports.json lists them), compiled for x86 and compared with
onnxruntime within 1e-4 relative, with padded attention masks (B = 1 padded too: the dynamo exporter's
mask indexing is all constants there), at several (B, S).

Where the library can serve a profile (B = 1..8, S = 1..512) one library is checked at every shape;
the others (Slice bounds or Expand targets computed from Shape at run time, see rtshapes in issue 19)
compile once per shape with the symbols fixed.
"""
import json
import pathlib

import numpy as np
import onnx
import pytest

from cuvil import Pipeline
from cuvil.targets.ptx import assemble, find_libdevice, find_ptxas, generate_ptx
from cuvil.targets.ptx.codegen import gpu_schedule
from cuvil.testing.oracles import max_rel_error, ort_session

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "exports"
EXPORTS = [e["file"] for e in json.loads((FIXTURES / "exports.json").read_text()) if e["status"] == "ok"]
RTOL = 1e-4
# B = 1..8, S = 1..512 (a decode step: a past of 1..511); BERT's position table has 512 rows.
PROFILE = {"batch": (1, 2, 8), "sequence": (1, 16, 512), "past_sequence": (1, 16, 511), "total_sequence": (2, 17, 512)}
# One library serves the whole profile.
ONE_LIBRARY = set(EXPORTS)  # every export, both exporters (run-time Slice bounds and Expand targets: item 3)
# (B, S): the first row of each batch is padded from the middle on; with B > 1 the second keeps one token.
SHAPES = [(1, 1), (1, 16), (3, 9), (8, 33), (2, 511)]   # S = 1: one token (a decode step: a past of one)
FIXED_SHAPES = [(1, 16)]


def attention_mask(batch: int, length: int, left: bool) -> np.ndarray:
    """Ones, with padding: row 0 half padded, row 1 (if any) all padding but one token, row 2 two pads."""
    m = np.ones((batch, length), np.int64)
    keep = [max(1, length // 2), 1, max(1, length - 2)]
    for b in range(batch):
        k = keep[b % 3]
        if left:    # a decode step's past: padding before the tokens, as generation pads batches
            m[b, :length - k] = 0
        else:
            m[b, k:] = 0
    return m


def feeds(model: onnx.ModelProto, batch: int, seq: int, seed: int = 0):
    """Inputs for every graph input; ``seq`` is the sequence length (a decode step's past length)."""
    rng = np.random.default_rng(seed)
    env = {"batch": batch, "sequence": seq, "past_sequence": seq, "total_sequence": seq + 1}
    out = {}
    for vi in model.graph.input:
        shape = [env[d.dim_param] if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            out[vi.name] = rng.integers(0, 512, shape).astype(np.int64)
        elif vi.name == "token_type_ids":
            out[vi.name] = rng.integers(0, 2, shape).astype(np.int64)
        elif vi.name == "attention_mask":
            decode = any(d.dim_param == "total_sequence" for d in vi.type.tensor_type.shape.dim)
            out[vi.name] = attention_mask(shape[0], shape[1], left=decode)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def compare(model, art, batch, seq):
    f = feeds(model, batch, seq)
    want = ort_session(model).run(None, f)
    got = art.run(f)
    errors = {o.name: max_rel_error(got[o.name], w) for o, w in zip(model.graph.output, want)}
    print(f"B={batch} S={seq}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= RTOL}
    assert not bad, f"B={batch} S={seq}: relative error above {RTOL}: {bad}"


def symbols_of(p: Pipeline, **values):
    return {k: v for k, v in values.items() if k in p.graph.symbols}


@pytest.mark.parametrize("name", sorted(ONE_LIBRARY))
def test_one_library_serves_the_profile(name):
    model = onnx.load(FIXTURES / name)
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(shape_profiles=symbols_of(p, **PROFILE))
    for batch, seq in SHAPES:
        compare(model, art, batch, seq)


@pytest.mark.parametrize("name", EXPORTS)
@pytest.mark.parametrize("batch,seq", FIXED_SHAPES)
def test_fixed_shapes(name, batch, seq):
    """Every symbol fixed, as the GPU target compiles: shape computations fold to constants (where the
    Concat fold of the dynamo exporter's mask index once went wrong at B = 1)."""
    model = onnx.load(FIXTURES / name)
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(fixed=symbols_of(p, batch=batch, sequence=seq, past_sequence=seq, total_sequence=seq + 1))
    compare(model, art, batch, seq)


@pytest.mark.skipif(find_ptxas() is None or find_libdevice() is None,
                    reason="ptxas / libdevice not found (no CUDA toolkit): PTX cannot be assembled here")
@pytest.mark.parametrize("name", EXPORTS)
def test_gpu_graph_matches_and_assembles(name):
    # The GPU target fixes every symbol (here B = 1, S = 128, the first row half padded): the graph it lowers
    # must still compute what onnxruntime does (the B = 1 mask-index fold broke exactly there), and its
    # kernels must assemble for sm_90. Running them needs the GPU machine (bench/gpu/real_exports.py).
    model = onnx.load(FIXTURES / name)
    p = Pipeline.from_onnx(model)
    g = p.specialize(symbols_of(p, batch=1, sequence=128, past_sequence=128, total_sequence=129)).optimize()
    f = feeds(model, 1, 128)
    want = ort_session(model).run(None, f)
    got = g.run_reference(f)
    for o, w in zip(model.graph.output, want):
        assert max_rel_error(got[o.name], w) <= RTOL, o.name
    ptx, descs = generate_ptx(gpu_schedule(g.graph), "sm_90")
    _, info = assemble(ptx, "sm_90", find_ptxas())
    assert descs and all(d.name in info for d in descs)


def test_every_export_is_checked():
    assert len(EXPORTS) == 16 and ONE_LIBRARY <= set(EXPORTS)
