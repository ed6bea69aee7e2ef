"""Random shapes inside a shape profile: one library per model (compiled once for the module) serves them all and
agrees with onnxruntime; the result does not depend on the number of threads."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuvil.testing.artifacts import close_and_remove, compile_and_load
from cuvil.testing.models import SYMBOLIC_CNN_PROFILE, TRANSFORMER_PROFILE, symbolic_batch_cnn, transformer_block
from cuvil.testing.oracles import max_rel_error, ort_session

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _inside(profile):
    lo, _, hi = profile
    return st.integers(lo, hi)


@pytest.fixture(scope="module")
def cnn():
    model = symbolic_batch_cnn(seed=1)
    art, m = compile_and_load(model, SYMBOLIC_CNN_PROFILE)
    yield m, ort_session(model)
    close_and_remove(art, m)


@pytest.fixture(scope="module")
def transformer():
    model = transformer_block(d_model=32, heads=4, d_ff=64, batch="B", seq="S", seed=3)
    art, m = compile_and_load(model, TRANSFORMER_PROFILE)
    yield m, ort_session(model)
    close_and_remove(art, m)


@SETTINGS
@given(n=_inside(SYMBOLIC_CNN_PROFILE["N"]), seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_cnn_random_batches_match_onnxruntime(cnn, n, seed, scale):
    m, sess = cnn
    x = (scale * np.random.default_rng(seed).standard_normal((n, 3, 16, 16))).astype(np.float32)
    (want,) = sess.run(None, {"x": x})
    y1, y2 = m.run(x, num_threads=1)[0], m.run(x, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    assert y1.shape == (n, 10)
    assert max_rel_error(y1, want) <= 1e-4


@SETTINGS
@given(b=_inside(TRANSFORMER_PROFILE["B"]), s=_inside(TRANSFORMER_PROFILE["S"]), seed=st.integers(0, 2**16))
def test_transformer_random_shapes_match_onnxruntime(transformer, b, s, seed):
    m, sess = transformer
    x = np.random.default_rng(seed).standard_normal((b, s, 32)).astype(np.float32)
    (want,) = sess.run(None, {"x": x})
    y1, y2 = m.run(x, num_threads=1)[0], m.run(x, num_threads=2)[0]
    np.testing.assert_array_equal(y1, y2)
    assert y1.shape == (b, s, 32)
    assert max_rel_error(y1, want) <= 1e-4
