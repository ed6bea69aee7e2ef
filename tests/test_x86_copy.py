"""Block copies (cuvil.targets.x86.copy): a concatenation's pieces as memmove runs, bit-exact at 1 and 2 threads,
with cached stores and with streaming ones (a destination run starting off a 64-byte line, a run cut into
blocks mid-line, NaN payloads and -0.0 moved as bits)."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil.targets.x86.codegen as codegen
import cuvil.targets.x86.copy as copy_mod
from cuvil import Pipeline
from cuvil.targets.x86.copy import BLOCK_BYTES, MIN_RUN_BYTES


def _concat(shapes, axis):
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    names = [f"x{k}" for k in range(len(shapes))]
    g = helper.make_graph([helper.make_node("Concat", names, ["y"], axis=axis)], "g",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(names, shapes)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def copies(monkeypatch):
    """The kernels the copy emitter took, per compile."""
    taken = []
    emit = codegen.emit_copy_stage

    def spy(km, st, sym):
        done = emit(km, st, sym)
        if done is not None:
            taken.append((st.name, done))
        return done
    monkeypatch.setattr(codegen, "emit_copy_stage", spy)
    return taken


@pytest.mark.parametrize("shapes, axis, n_copies", [
    ([(1, 12, 127, 64), (1, 12, 1, 64)], 2, 1),       # a decode step's present = Concat(past, new): the past
    ([(1, 3, 1023, 64), (1, 3, 1, 64)], 2, 1),        # runs longer than a block (1023 x 64 floats: 4 blocks)
    ([(2, 5, 33, 17), (2, 7, 33, 17)], 1, 2),         # whole (33 x 17) planes behind a channel slice
    ([(300, 40), (5, 40)], 0, 1),                     # one run of the whole first input; 5 rows: generic loop
    ([(3, 4, 9), (3, 4, 2)], 2, 0),                   # rows of 36 bytes: every piece keeps the loop nest
    ([(1, 4, 1023, 17), (1, 4, 2, 17)], 2, 1),        # runs of 69,564 bytes, each starting 4 bytes past a line
])
@pytest.mark.parametrize("stream_bytes", [None, 1], ids=["cached", "streamed"])
def test_concatenation_pieces_copy_bit_exactly(copies, monkeypatch, shapes, axis, n_copies, stream_bytes):
    monkeypatch.setattr(copy_mod, "STREAM_BYTES", stream_bytes)
    rng = np.random.default_rng(axis)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    bits = xs[0].view(np.uint32)
    bits.reshape(-1)[:3] = [0x7FC00001, 0xFFA00000, 0x80000000]   # NaN payloads and -0.0: moved as bits
    art = Pipeline.from_onnx(_concat(shapes, axis)).compile(cache=False)
    assert len(copies) == n_copies, copies
    want = np.concatenate(xs, axis)
    m = art.model()
    for t in (1, 2):
        assert m.run(*xs, num_threads=t)[0].tobytes() == want.tobytes(), t


def test_a_long_run_is_cut_into_blocks_for_the_threads(copies):
    """A run of 1023 x 64 floats per (batch, head) is cut into BLOCK_BYTES blocks: 2 x 3 runs of 4 blocks."""
    Pipeline.from_onnx(_concat([(2, 3, 1023, 64), (2, 3, 1, 64)], 2)).compile(cache=False)
    run = 1023 * 64 * 4
    assert run >= MIN_RUN_BYTES
    assert copies == [(copies[0][0], (2 * 3 * -(-run // BLOCK_BYTES), 1))]
