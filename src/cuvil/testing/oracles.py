"""onnxruntime as the oracle of the tests, seeded inputs for a model, and the error measures that compare
Cuvil's outputs with the oracle's. Needs onnxruntime (the ``test`` extra)."""
from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort


def ort_session(model, options: "ort.SessionOptions | None" = None) -> ort.InferenceSession:
    """An onnxruntime CPU session for an ``onnx.ModelProto`` (``options``: its SessionOptions, e.g. the thread
    counts a benchmark sets). A model that an onnx newer than the installed onnxruntime stamped with a newer IR
    version than it reads (the GPU machine's pairing) is run at the IR version onnxruntime names, the ops and
    their opsets unchanged."""
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:      # onnxruntime's own Fail exception; only the IR-version refusal is retried
        m = re.search(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)", str(e))
        if m is None:
            raise
    older = type(model)()
    older.CopyFrom(model)
    older.ir_version = int(m.group(2))
    return ort.InferenceSession(older.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_run(model, feeds):
    """onnxruntime's first output for ``feeds``."""
    return ort_session(model).run(None, feeds)[0]


def random_feeds(model, seed=0):
    """Standard-normal float32 inputs of every graph input's (static) shape."""
    rng = np.random.default_rng(seed)
    return {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
            for vi in model.graph.input}


def normwise_error(a, b):
    """||a - b|| / ||b||; ||a - b|| when b is all zeros (a Relu can zero a small output)."""
    diff, ref = np.linalg.norm(a.astype(np.float64) - b), np.linalg.norm(b)
    return float(diff / ref) if ref > 0 else float(diff)


def max_rel_error(got, want):
    """max|got - want| / max|want| (shapes must agree)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got.astype(np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))
