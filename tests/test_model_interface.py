"""`cuvil.load` gives one Model interface whatever the target: the same call forms (positional, keywords, one
dict), the same return rule (a dict in, a dict out; otherwise a list), metadata of one form, and the same
input checks with the same messages, on an x86 library and on a GPU bundle of one model.

The GPU side runs here without a GPU up to the device launch: a bundle compiles without one (ptxas checks
it), and its inputs are checked by the code `GpuModel.run` calls first (`bundle_signature(...).prepare`),
read from the bundle alone. The launch itself runs only where a GPU is."""
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil import CuvilError, Pipeline, ShapeError
from cuvil.targets.model_api import RUNTIME_ERRORS, Signature, SymbolProfile, TensorSpec
from cuvil.targets.ptx import runtime as rt
from cuvil.testing.requires import LIBDEVICE, needs_gpu, needs_libdevice

GPU = "nvptx64-nvidia-cuda"
TARGETS = ("x86", "gpu")


def masked_model():
    """Two int64 inputs as a transformer export names them, both [batch, sequence]; two float outputs."""
    dims = ["batch", "sequence"]
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["ids_f", "mask_f"], ["scores"]),
             helper.make_node("ReduceSum", ["scores", "axes"], ["total"], keepdims=0)]
    g = helper.make_graph(nodes, "masked",
                          [helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
                           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims)],
                          [helper.make_tensor_value_info("scores", TensorProto.FLOAT, dims),
                           helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"])],
                          [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("iface")
    p = Pipeline.from_onnx(masked_model()).optimize()
    art = p.compile(shape_profiles={"batch": (1, 2, 4), "sequence": (1, 8, 32)})
    so = art.save(str(d / "libmasked.so"))
    bundle = None
    if LIBDEVICE is not None:
        bundle = p.compile(GPU, fixed={"batch": 2, "sequence": 8}).save(str(d / "masked.cuvil"))
    return {"art": art, "so": so, "bundle": bundle}


def signature(built, target) -> Signature:
    """What `run` checks the inputs against: the loaded library's, or the bundle's (read without a driver)."""
    if target == "x86":
        return cuvil.load(built["so"]).signature
    if built["bundle"] is None:
        pytest.skip("libdevice.10.bc not found: no bundle to check")
    return rt.bundle_signature(built["bundle"])


def feeds(batch=2, seq=8):
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, 100, (batch, seq)), "attention_mask": rng.integers(0, 2, (batch, seq))}


def expected(f):
    scores = (f["input_ids"] * f["attention_mask"]).astype(np.float32)
    return {"scores": scores, "total": scores.sum(axis=1)}


def refusal(sig: Signature, *args, **named) -> CuvilError:
    with pytest.raises(ShapeError) as ei:
        sig.prepare(args, named)
    e = ei.value
    assert e.message.startswith(sig.artifact + ": ") and e.hint, str(e)
    return e


def test_both_models_implement_the_one_interface():
    assert issubclass(rt.GpuModel, cuvil.Model) and issubclass(cuvil.targets.x86.loader.X86Model, cuvil.Model)
    assert cuvil.targets.x86.loader.Model is cuvil.targets.x86.loader.X86Model   # the old name still imports


@pytest.mark.parametrize("target", TARGETS)
def test_metadata_has_one_form(built, target):
    sig = signature(built, target)
    assert [d.name for d in sig.inputs] == ["input_ids", "attention_mask"]
    assert [d.name for d in sig.outputs] == ["scores", "total"]
    assert all(isinstance(d, TensorSpec) for d in sig.inputs + sig.outputs)
    assert all(isinstance(p, SymbolProfile) for p in sig.symbols.values())
    assert [(d.dtype, d.code, d.ndim) for d in sig.inputs] == [(np.dtype(np.int64), 7, 2)] * 2
    assert [(d.dtype, d.code) for d in sig.outputs] == [(np.dtype(np.float32), 1)] * 2
    if target == "x86":   # symbolic dims: None in shape, the symbol in dims; the profile by symbol
        assert sig.inputs[0].shape == (None, None) and sig.inputs[0].dims == ("batch", "sequence")
        assert str(sig.inputs[1]) == "attention_mask: int64[batch, sequence]"
        assert sig.symbols == {"batch": SymbolProfile(1, 2, 4), "sequence": SymbolProfile(1, 8, 32)}
    else:                 # a bundle's shapes are static: its symbols were fixed (min = opt = max)
        assert sig.inputs[0].shape == sig.inputs[0].dims == (2, 8)
        assert str(sig.inputs[1]) == "attention_mask: int64[2, 8]"
        assert sig.symbols == {"batch": SymbolProfile(2, 2, 2), "sequence": SymbolProfile(8, 8, 8)}


@pytest.mark.parametrize("target", TARGETS)
def test_positional_keyword_and_dict_calls_give_the_same_inputs(built, target):
    sig, f = signature(built, target), feeds()
    ids, mask = f["input_ids"], f["attention_mask"]
    calls = {"positional": ((ids, mask), {}), "keywords": ((), f), "dict": ((f,), {}),
             "mixed": ((ids,), {"attention_mask": mask}), "lists": ((ids.tolist(), mask.tolist()), {})}
    for how, (args, named) in calls.items():
        prep = sig.prepare(args, named)
        assert prep.as_dict == (how == "dict"), how
        assert [a.dtype for a in prep.arrays] == [np.int64] * 2, how
        assert all(np.array_equal(a, b) for a, b in zip(prep.arrays, (ids, mask))), how
    assert sig.prepare((f,), {}).bindings == ({"batch": 2, "sequence": 8} if target == "x86" else {})
    outs = [np.zeros(d.shape if None not in d.shape else (2,) * d.ndim, d.dtype) for d in sig.outputs]
    assert sig.package(outs, as_dict=True).keys() == {"scores", "total"}
    assert isinstance(sig.package(outs, as_dict=False), list)


# (case, call args, call keywords) -> the same message (after the artifact's name) on both targets
def _cases():
    f = feeds()
    ids, mask = f["input_ids"], f["attention_mask"]
    return {
        "unknown name": ((), {**f, "input_idz": ids},
                         "unknown input 'input_idz'; the model's inputs are 'input_ids', 'attention_mask'"),
        "unknown name in a dict": (({"input_ids": ids, "mask": mask},), {},
                                   "unknown input 'mask'; the model's inputs are 'input_ids', 'attention_mask'"),
        "missing": (({"input_ids": ids},), {},
                    "missing input(s) 'attention_mask'; the model's inputs are 'input_ids', 'attention_mask'"),
        "twice": ((ids, mask), {"input_ids": ids}, "input 'input_ids' given twice"),
        "too many": ((ids, mask, mask), {}, "3 positional inputs, the model has 2 ('input_ids', 'attention_mask')"),
        "dict and keywords": ((f,), {"input_ids": ids}, "inputs given both in a dict and as keywords ('input_ids')"),
        "dict among arrays": ((f, mask), {}, "a dict of inputs among 2 positional arguments"),
        "a list as one input": (([ids, mask],), {}, "a list of 2 arrays given as one input"),
        "dtype": ((ids.astype(np.int32), mask), {},
                  "tensor dtype does not match the model: input 0 'input_ids': dtype is 6 (int32), expected 7 "
                  "(int64) (code -6)"),
        "object": ((ids, np.array([None, 1], dtype=object)), {},
                   "tensor dtype does not match the model: input 1 'attention_mask': dtype is 0 (object), "
                   "expected 7 (int64) (code -6)"),
        "rank": ((ids[..., None], mask), {},
                 "tensor rank (ndim) does not match the model: input 0 'input_ids': ndim is 3, expected 2 (code -7)"),
        "not an array": ((ids, [[1, 2], [3]]), {}, "input 1 'attention_mask' is not an array"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_refusals_read_the_same_on_both_targets(built, case):
    args, named, want = _cases()[case]
    got = {}
    for target in TARGETS:
        sig = signature(built, target)
        e = refusal(sig, *args, **named)
        got[target] = e.message[len(sig.artifact) + 2:]
        assert got[target].startswith(want), (target, got[target])
    assert got["x86"] == got["gpu"]


def test_refusals_name_the_next_step(built):
    x86, gpu = signature(built, "x86"), signature(built, "gpu")
    f = feeds()
    ids, mask = f["input_ids"], f["attention_mask"]
    for sig in (x86, gpu):
        assert refusal(sig, ids.astype(np.int32), mask).hint == "convert it with .astype(numpy.int64)"
        assert refusal(sig, ids, input_idz=mask).hint == "name the inputs as listed (m.inputs)"
        assert refusal(sig, {"input_ids": ids}).hint == "pass every input: run({'input_ids': ..., 'attention_mask': ...})"
    assert refusal(x86, ids[..., None], mask).hint == "reshape it to [?, ?]"
    assert refusal(gpu, ids[..., None], mask).hint == "reshape it to [2, 8]"
    # a sequence outside the library's profile: the profile and the flag that widens it
    e = refusal(x86, np.zeros((2, 40), np.int64), np.zeros((2, 40), np.int64))
    assert e.message.endswith("input 0 'input_ids': dim 1 is sequence = 40, outside the profile sequence in [1, 32] "
                              "(code -19)")
    assert "--shape-profile sequence=MIN:OPT:MAX covering 40" in e.hint
    # the bundle was compiled for one shape: the shape it takes and the compile that would take this one
    e = refusal(gpu, np.zeros((2, 40), np.int64), np.zeros((2, 40), np.int64))
    assert e.message.endswith("input 0 'input_ids': dim 1 is 40, expected 8 (code -8)")
    assert e.hint == ("pass an array of shape [2, 8]; the artifact was compiled for batch=2, sequence=8: for this "
                      "shape compile it again with --input-shape input_ids=2x40 --target nvptx64-nvidia-cuda")
    # one symbol, two values: the library binds sequence from the first input that has it
    e = refusal(x86, ids, np.zeros((2, 9), np.int64))
    assert e.message.endswith("input 1 'attention_mask': dim 1 is sequence = 9, but input 0 'input_ids' dim 1 bound "
                              "sequence = 8 (code -8)")
    assert e.hint == "give every dim named sequence one value (here 8, as input 0 'input_ids' dim 1 has)"
    e = refusal(gpu, ids, np.zeros((2, 9), np.int64))
    assert e.message.endswith("input 1 'attention_mask': dim 1 is 9, expected 8 (code -8)")


def test_the_python_checks_speak_the_runtime_words(built):
    m = cuvil.load(built["so"])
    for code, text in RUNTIME_ERRORS.items():
        assert m.lib.cuvil_strerror(code).decode() == text, code


def test_the_x86_model_runs_every_call_form(built):
    f, want = feeds(), expected(feeds())
    with cuvil.load(built["so"]) as m:
        assert isinstance(m, cuvil.Model)
        by_name = m.run(f)
        assert isinstance(by_name, dict) and list(by_name) == ["scores", "total"]
        for name in want:
            np.testing.assert_array_equal(by_name[name], want[name])
        for outs in (m.run(f["input_ids"], f["attention_mask"]), m.run(**f), m.run(f, num_threads=1)):
            outs = list(outs.values()) if isinstance(outs, dict) else outs
            assert all(np.array_equal(a, b) for a, b in zip(outs, want.values()))
        (scores, total) = m.run(**feeds(3, 20))       # another shape in the profile
        assert scores.shape == (3, 20) and total.shape == (3,)
    with pytest.raises(CuvilError, match="was closed") as ei:
        m.run(f)
    assert ei.value.hint.startswith("load it again with cuvil.load(")


def test_artifact_run_goes_through_the_model(built):
    art, f = built["art"], feeds()
    out = art.run(f)
    assert isinstance(out, dict) and np.array_equal(out["total"], expected(f)["total"])
    scores, total = art.run([f["input_ids"], f["attention_mask"]])
    assert np.array_equal(scores, out["scores"])
    with pytest.raises(ShapeError) as ei:
        art.run({"input_ids": f["input_ids"]})
    assert ei.value.message == os.path.basename(art.path) + (
        ": missing input(s) 'attention_mask'; the model's inputs are 'input_ids', 'attention_mask'")


@needs_libdevice
@needs_gpu
def test_the_gpu_model_runs_every_call_form_like_the_x86_model(built):
    f = feeds()
    with cuvil.load(built["so"]) as cpu, cuvil.load(built["bundle"]) as gpu:
        assert isinstance(gpu, cuvil.Model)
        assert [str(d) for d in gpu.outputs] == ["scores: float32[2, 8]", "total: float32[2]"]
        want, got = cpu.run(f), gpu.run(f)
        assert list(got) == list(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
        for outs in (gpu.run(f["input_ids"], f["attention_mask"]), gpu.run(**f), gpu.run(f, mode="eager")):
            outs = list(outs.values()) if isinstance(outs, dict) else outs
            assert all(np.allclose(a, b) for a, b in zip(outs, want.values()))
    with pytest.raises(CuvilError, match="was closed"):
        gpu.run(f)
