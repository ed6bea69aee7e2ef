"""Random transformer pieces through the x86 kernels agree with onnxruntime, with 1 and 2 threads alike, on the
host's vectors and compiled for AVX2 (x86-64-v3, the documented portable target: 8-lane tiles, masks and
vector math; a wide masked load LLVM 22 miscompiled there once gave silent wrong answers, tests/test_winograd.py):

* the fused attention kernel (rules/attention.rule, the tiled form) from one library for a (B, S) profile, at a
  drawn point (the generic kernels, or the opt point's specialised ones where it is drawn) and at the opt point: head
  sizes that are and are not whole vectors, additive masks per batch row (padded, fully masked, one key masked,
  none; cuvil.testing.attention_models.feeds) or per head and query (causal on one head), -inf, -FLT_MAX or
  -10000 fills, with and without the exporters' NaN guard: the NaN elements exactly onnxruntime's, the rest
  within 1e-4 (tests/test_real_exports.py's tolerance);
* a dense layer with constant weights, bias and erf GELU (the FFN's first product with its epilogue fused;
  the vector erf) and Gemm(transB) with a residual, at drawn row counts, reductions and widths (tails of rows
  and columns; the register-blocked product where the shape takes it, else the loop nest: both are checked)."""
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil import Pipeline
from cuvil.kernels.lower.attention import KEY_BLOCK
from cuvil.testing.attention_models import attention_model, feeds
from cuvil.testing.matmul_models import gemm_transb_residual, linear_gelu
from cuvil.testing.oracles import max_rel_error, ort_run, random_feeds

RTOL = 1e-4
CPUS = [None, None, "x86-64-v3"]


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 4))
    seq = draw(st.integers(1, 2 * KEY_BLOCK + 9))
    return dict(guard=draw(st.booleans()), mask_rank=draw(st.sampled_from([2, 4])),
                fill=draw(st.sampled_from([float("-inf"), -3.4028235e38, -10000.0])),
                D=draw(st.sampled_from([4, 8, 12, 20, 64]))), batch, seq, draw(st.sampled_from(CPUS))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=12, deadline=None)
@given(case=attention_cases(), seed=st.integers(0, 2**16))
def test_random_attention_matches_onnxruntime(case, seed):
    geo, batch, seq, cpu = case
    model = attention_model(**geo)
    # the opt point (2, 16): its kernels are specialised; every other point runs the generic ones
    art = Pipeline.from_onnx(model).optimize().compile(
        shape_profiles={"B": (1, 2, 4), "S": (1, 16, 2 * KEY_BLOCK + 9)}, cpu=cpu, cache=False)
    assert any(r.startswith("fused_attention") for r in art.manifest["rules_applied"])
    assert cpu is None or art.manifest["target"]["vector_bits"] == 256
    for variant in ("generic", "opt"):   # the tiled kernel, not the sequential form (tests/test_attention.py)
        assert any(s["kernel"] == "attention" for s in art.manifest["steps"] if s.get("variant", "generic") == variant)
    for b, s in {(batch, seq), (2, 16)}:
        f = feeds(b, s, geo["mask_rank"], seed=seed, D=geo["D"])
        want = ort_run(model, f)
        got = art.run(f, num_threads=1)["y"]
        np.testing.assert_array_equal(got.view(np.uint32), art.run(f, num_threads=2)["y"].view(np.uint32))
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), (b, s)
        assert max_rel_error(np.where(nan, 0, got), np.where(nan, 0, want)) <= RTOL, (b, s)


@st.composite
def dense_cases(draw):
    kind = draw(st.sampled_from(["gelu", "gemm"]))
    rows, k, n = draw(st.integers(1, 21)), draw(st.integers(1, 90)), draw(st.integers(1, 70))
    return kind, rows, k, n, draw(st.sampled_from(CPUS))


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=25, deadline=None)
@given(case=dense_cases(), seed=st.integers(0, 2**16))
def test_random_dense_layers_match_onnxruntime(case, seed):
    kind, rows, k, n, cpu = case
    if kind == "gelu":
        model, _ = linear_gelu(b=1 + rows % 2, m=rows, k=k, n=n, seed=seed)
    else:
        model, _ = gemm_transb_residual(m=rows, k=k, n=n, seed=seed)
    f = random_feeds(model, seed)
    want = ort_run(model, f)
    art = Pipeline.from_onnx(model).optimize().compile(cpu=cpu, cache=False)
    assert cpu is None or art.manifest["target"]["vector_bits"] == 256
    got = art.run(f, num_threads=1)["y"]
    np.testing.assert_array_equal(got, art.run(f, num_threads=2)["y"])
    assert got.shape == want.shape
    assert max_rel_error(got, want) <= RTOL
