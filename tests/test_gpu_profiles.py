"""GPU bundles for a shape profile (issue 22): one bundle, a specialisation per bucket compiled ahead of
time (PTX that ptxas assembles for each), the bucket a call runs, when padding is legal (proved on the
graph), the bounded graph cache's policy (a pure module, tested directly), and the x86 fail-safe (GPU
missing is real on a machine without one; the injected faults run on a GPU). The GPU tests at the end run
only where a GPU is present (bench/gpu/profiles.py runs them on the device)."""
import json
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import cuvil
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError, ShapeError
from cuvil.targets.ptx import buckets as bk
from cuvil.targets.ptx import runtime as rt
from cuvil.targets.ptx.failsafe import FailSafeModel
from cuvil.targets.ptx.graph_cache import GraphCache
from cuvil.kernels.batch_rows import batch_like
from cuvil.testing.requires import NO_GPU, needs_gpu, needs_libdevice, needs_ptxas

TARGET = "nvptx64-nvidia-cuda"


def net(tail: str = "none", batch="N") -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv 3x3 -> Relu -> Flatten -> MatMul -> y[N,5], then ``tail``: "none", "batch_mean"
    (subtract the mean over the batch: rows depend on each other), "softmax0" (softmax over the batch)."""
    rng = np.random.default_rng(0)
    W = nh.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    G = nh.from_array((rng.standard_normal((4 * 8 * 8, 5)) / 16).astype(np.float32), "G")
    nodes = [h.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
             h.make_node("Flatten", ["r"], ["f"], axis=1), h.make_node("MatMul", ["f", "G"], ["y0"])]
    if tail == "batch_mean":
        nodes += [h.make_node("ReduceMean", ["y0"], ["m"], axes=[0], keepdims=1), h.make_node("Sub", ["y0", "m"], ["y"])]
    elif tail == "softmax0":
        nodes += [h.make_node("Softmax", ["y0"], ["y"], axis=0)]
    else:
        nodes += [h.make_node("Softmax", ["y0"], ["y"], axis=1)]
    g = h.make_graph(nodes, "net", [h.make_tensor_value_info("x", T.FLOAT, [batch, 3, 8, 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, [batch, 5])], [W, G])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def profile_bundle():
    p = Pipeline.from_onnx(net()).optimize()
    return p, p.compile(TARGET, arch="sm_90", shape_profiles={"N": (1, 4, 8)}, cache=False)


# --- buckets: pure -------------------------------------------------------------------------------------------

def test_default_buckets_are_powers_of_two_with_min_and_max():
    assert bk.default_buckets(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert bk.default_buckets(3, 100) == [3, 4, 8, 16, 32, 64, 100]
    assert bk.default_buckets(7, 7) == [7]
    assert bk.default_buckets(32, 192, multiple=32) == [32, 64, 128, 192]
    assert all(v % 32 == 0 for v in bk.default_buckets(256, 2048, multiple=32))


def test_given_buckets_are_checked_and_end_at_the_max():
    prof = {"N": (1, 8, 64, 1)}
    assert bk.resolve_buckets(prof, [1, 8, 32]) == {"N": [1, 8, 32, 64]}     # the max is added
    assert bk.resolve_buckets(prof, {"N": [64, 2, 2]}) == {"N": [2, 64]}
    with pytest.raises(CuvilError, match="not in the profile"):
        bk.resolve_buckets(prof, [0, 8])
    with pytest.raises(CuvilError, match="name the symbol"):
        bk.resolve_buckets({"B": (1, 1, 8, 1), "S": (16, 128, 512, 1)}, [1, 2])
    with pytest.raises(CuvilError, match="does not have"):
        bk.resolve_buckets(prof, {"M": [1]})
    assert bk.parse_bucket_flag("1,2,4") == (1, 2, 4)
    assert bk.parse_bucket_flag("N=1,8;S=128,512") == {"N": (1, 8), "S": (128, 512)}
    with pytest.raises(CuvilError, match="integers"):
        bk.parse_bucket_flag("1,x")


def test_bucket_choice_pads_up_only_where_legal():
    b = [1, 2, 4, 8, 16, 32, 64]
    assert [bk.choose(b, v, True) for v in (1, 3, 5, 8, 33, 64)] == [1, 4, 8, 8, 64, 64]
    assert [bk.choose(b, v, False) for v in (1, 3, 8, 33)] == [1, None, 8, None]
    assert bk.choose(b, 65, True) is None
    pts = bk.bucket_points({"B": [1, 8], "S": [128, 512]})
    assert pts == [{"B": 1, "S": 128}, {"B": 1, "S": 512}, {"B": 8, "S": 128}, {"B": 8, "S": 512}]
    assert bk.choose_point({"B": [1, 8], "S": [128, 512]}, {"B": True, "S": False}, {"B": 3, "S": 512}) == \
        {"B": 8, "S": 512}
    with pytest.raises(ShapeError, match="cannot be padded") as e:
        bk.choose_point({"B": [1, 8], "S": [128, 512]}, {"B": True, "S": False}, {"B": 3, "S": 200})
    assert "--graph-buckets S=128,200,512" in e.value.hint


# --- padding legality, on the graph -------------------------------------------------------------------------

def _graph(model):
    return Pipeline.from_onnx(model).optimize().graph


def test_batch_is_paddable_where_rows_are_independent():
    assert batch_like(_graph(net()), "N") == (True, "")


@pytest.mark.parametrize("tail, why", [("batch_mean", "reduces over N"), ("softmax0", "normalises along N")])
def test_batch_is_not_paddable_where_rows_mix(tail, why):
    ok, reason = batch_like(_graph(net(tail)), "N")
    assert not ok and why in reason


def _shape_model(data_use: bool):
    """x[N, 4, 2] reshaped to [N, 8] by a shape computed from Shape(x) (paddable), or (``data_use``) divided
    by its element count Size(x) = 8*N, a value that changes with the padding (not paddable)."""
    i64 = lambda name, v: h.make_tensor(name, T.INT64, [len(v)], v)  # noqa: E731
    if data_use:
        nodes = [h.make_node("Size", ["x"], ["n"]), h.make_node("Cast", ["n"], ["nf"], to=T.FLOAT),
                 h.make_node("Div", ["x", "nf"], ["y"])]
        out = [h.make_tensor_value_info("y", T.FLOAT, ["N", 4, 2])]
    else:
        nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "zero"], ["n"], axis=0),
                 h.make_node("Concat", ["n", "eight"], ["shape"], axis=0), h.make_node("Reshape", ["x", "shape"], ["y"])]
        out = [h.make_tensor_value_info("y", T.FLOAT, ["N", 8])]
    g = h.make_graph(nodes, "s", [h.make_tensor_value_info("x", T.FLOAT, ["N", 4, 2])], out,
                     [i64("zero", [0]), i64("eight", [8])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_a_shape_read_as_a_shape_keeps_padding_legal_and_as_data_does_not():
    g = _graph(_shape_model(False))
    assert any(n.op == "Reshape" for n in g.nodes)
    assert batch_like(g, "N") == (True, "")
    ok, why = batch_like(_graph(_shape_model(True)), "N")
    assert not ok and "as data" in why


def test_a_symbol_off_axis_0_is_not_paddable():
    g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "t", [h.make_tensor_value_info("x", T.FLOAT, [2, "S"])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, "S"])])
    ok, why = batch_like(_graph(h.make_model(g, opset_imports=[h.make_opsetid("", 17)])), "S")
    assert not ok and "axis 1" in why


# --- the graph cache's policy: pure --------------------------------------------------------------------------

def test_graph_cache_is_a_bounded_lru_with_per_bucket_stats():
    gone = []
    c = GraphCache(2, gone.append)
    assert c.get(1) is None                      # a miss for bucket 1
    c.put(1, "g1", 100, seconds=0.002, nodes=7)
    assert c.get(2) is None
    c.put(2, "g2", 50, seconds=0.001, nodes=7)
    assert c.get(1) == "g1"                      # 1 is now the most recent
    assert c.get(3) is None
    c.put(3, "g3", 10, nodes=7)                  # evicts 2, the least recently used
    assert gone == ["g2"] and c.keys() == [1, 3] and len(c) == 2
    assert c.get(2) is None                      # a miss again: it was evicted
    c.put(2, "g2b", 60)                          # evicts 1
    assert gone == ["g2", "g1"] and c.keys() == [3, 2]
    per = c.per_bucket()
    assert per["1"] == {"captures": 1, "capture_ms": 2.0, "last_capture_ms": 2.0, "nodes": 7, "graph_bytes": 100,
                        "hits": 1, "misses": 1, "evictions": 1, "alive": False}
    assert per["2"]["captures"] == 2 and per["2"]["misses"] == 2 and per["2"]["evictions"] == 1 and per["2"]["alive"]
    st = c.stats()
    assert (st["graphs"], st["captures"], st["hits"], st["misses"], st["evictions"], st["bytes"]) == (2, 4, 1, 4, 2, 70)
    c.clear()
    assert sorted(gone) == ["g1", "g2", "g2b", "g3"] and len(c) == 0
    with pytest.raises(CuvilError, match="max_graphs"):
        GraphCache(0, gone.append)


def test_graph_cache_never_holds_more_than_its_bound_over_random_buckets():
    rng = np.random.default_rng(0)
    alive, c = set(), None

    def destroy(v):
        alive.remove(v)
    c = GraphCache(3, destroy)
    for _ in range(2000):
        k = int(rng.integers(0, 7))
        if c.get(k) is None:
            alive.add(("g", k, c.captures))
            c.put(k, ("g", k, c.captures))
        assert len(c) <= 3 and len(alive) == len(c)
    st = c.stats()
    assert st["hits"] + st["misses"] == 2000 and st["captures"] == st["misses"]
    assert st["evictions"] == st["captures"] - len(c)


# --- the bundle ---------------------------------------------------------------------------------------------

@needs_libdevice
def test_one_bundle_holds_every_bucket(profile_bundle):
    _, b = profile_bundle
    man = b.manifest
    assert man["graph_buckets"] == {"N": [1, 2, 4, 8]}
    assert man["profile"]["N"] == {"min": 1, "opt": 4, "max": 8, "multiple": 1, "buckets": [1, 2, 4, 8],
                                   "paddable": True}
    assert man["weights_shared"] and sorted(e["point"]["N"] for e in man["buckets"]) == [1, 2, 4, 8]
    with open(os.path.join(b.path, "plan.json")) as f:
        plan = json.load(f)
    assert plan["inputs"][0]["dims"] == ["N", 3, 8, 8] and plan["outputs"][0]["dims"] == ["N", 5]
    for e in plan["buckets"]:
        with open(os.path.join(b.path, e["dir"], "plan.json")) as f:
            sub = json.load(f)
        assert sub["inputs"][0]["shape"] == [e["point"]["N"], 3, 8, 8]
        assert not os.path.exists(os.path.join(b.path, e["dir"], "weights.bin"))   # stored once, at the top
    sig = rt.bundle_signature(b.path)
    assert sig.symbols["N"].min == 1 and sig.symbols["N"].max == 8 and sig.inputs[0].dims == ("N", 3, 8, 8)


@needs_libdevice
def test_the_manifest_counts_every_bucket(profile_bundle):
    """Kernels by tensor-core kind, the memory-safety proof, rules: over every bucket, not the opt bucket's alone."""
    _, b = profile_bundle
    man = b.manifest
    kinds, n = {}, 0
    for e in man["buckets"]:
        with open(os.path.join(b.path, e["dir"], "plan.json")) as f:
            ks = json.load(f)["kernels"]
        n += len(ks)
        for k in ks:
            if "mma" in k["kind"] or k["kind"].startswith("matmul_"):
                kinds[k["kind"]] = kinds.get(k["kind"], 0) + 1
        assert e["launch_graph"]["kernels"] == len(ks) and e["memory_safety"].endswith("kernels proved in bounds")
    assert man["tensor_core_kernels"] == dict(sorted(kinds.items()))
    ms = man["memory_safety"]
    assert man["kernels"] == n and ms["kernels"] >= len(man["buckets"])
    assert ms["summary"] == f"{ms['kernels_proved']}/{ms['kernels']} kernels proved in bounds (4 buckets)"
    assert {k["bucket"] for k in ms["per_kernel"]} == {"N=1", "N=2", "N=4", "N=8"} and len(ms["per_kernel"]) == ms["kernels"]
    assert "launch_graph" not in man


@needs_libdevice
@needs_ptxas
def test_every_bucket_assembles(profile_bundle):
    _, b = profile_bundle
    for e in b.manifest["buckets"]:
        assert e["ptxas"] and os.path.isfile(os.path.join(b.path, e["dir"], e["ptxas"]["cubin"]))
        assert all(k["spill_stores"] == 0 for k in e["ptxas"]["kernels"].values())


@needs_libdevice
def test_graph_buckets_need_a_profile_and_the_cli_takes_them(tmp_path, capsys):
    p = Pipeline.from_onnx(net()).optimize()
    with pytest.raises(CuvilError, match="needs a shape profile"):
        p.compile(TARGET, fixed={"N": 2}, graph_buckets=[1, 2], cache=False)
    onnx.save(net("batch_mean"), str(tmp_path / "m.onnx"))
    rc = cli_main(["compile", str(tmp_path / "m.onnx"), "--target", TARGET, "-o", str(tmp_path / "m.cuvil"),
                   "--shape-profile", "N=1:2:4", "--graph-buckets", "2,4", "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "buckets 2,4; only the bucket values run (ReduceMean" in out
    with open(tmp_path / "m.cuvil" / "manifest.json") as f:
        assert json.load(f)["graph_buckets"] == {"N": [2, 4]}
    assert cli_main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "libm.so"),
                     "--graph-buckets", "2,4", "-q"]) != 0


@needs_libdevice
def test_max_graphs_is_checked_before_the_driver_and_only_for_bundles(profile_bundle, tmp_path, capsys):
    p, b = profile_bundle
    with pytest.raises(CuvilError, match="max_graphs must be at least 1"):
        cuvil.load(b.path, max_graphs=0)
    so = p.compile(shape_profiles={"N": (1, 4, 8)}).save(str(tmp_path / "libnet.so"))
    assert cli_main(["run", so, "--input-shape", "x=3x3x8x8", "--max-graphs", "2"]) != 0
    assert "apply to GPU bundles" in capsys.readouterr().err


# --- the runtime's plumbing for buckets, against test_gpu_bundle's fake driver (no GPU claim) ----------------

@needs_libdevice
def test_runtime_runs_the_bucket_of_a_call_padded(profile_bundle, monkeypatch):
    from test_gpu_bundle import FakeDriver
    drv = FakeDriver()
    memsets = []
    drv.cuMemsetD8Async = lambda p, v, n, s: (memsets.append(n), (drv.CUresult.CUDA_SUCCESS,))[1]
    monkeypatch.setattr(rt, "driver", lambda: drv)
    _, b = profile_bundle
    m = rt.load_bundle(b.path, max_graphs=2)
    assert m.module_loads == 4 and len(m._variants) == 4
    grids = {v.point["N"]: [tuple(k["grid"]) for k in v.plan["kernels"] if int(k["n"]) > 0] for v in m._variants}
    assert grids[4] != grids[8]
    (y,) = m.run(np.zeros((3, 3, 8, 8), np.float32))
    assert y.shape == (3, 5) and memsets == [1 * 3 * 8 * 8 * 4]        # one zero row of padding
    drv.log.clear()
    m.run(np.zeros((4, 3, 8, 8), np.float32))                          # N=4 exactly: no padding, a replay
    assert [e[1] for e in drv.log] == grids[4] and memsets == [3 * 8 * 8 * 4]
    for n in (8, 1, 4):
        m.run(np.zeros((n, 3, 8, 8), np.float32))
    st = m.stats()
    assert st["graphs_alive"] == 2 and st["buckets"]["N=4"]["evictions"] == 1 and st["buckets"]["N=4"]["captures"] == 2
    assert st["buckets"]["N=4"]["hits"] == 1 and st["buckets"]["N=2"]["captures"] == 0
    with pytest.raises(ShapeError, match="needs the values of N"):
        m.run_device([1], [2])
    with pytest.raises(ShapeError, match="no bucket"):
        m.run_device([1], [2], symbols={"N": 3})                          # caller memory is never padded
    m.close()


@needs_libdevice
def test_a_signed_profile_bundle_covers_every_bucket_and_loads_the_verified_bytes(profile_bundle, tmp_path,
                                                                                 monkeypatch):
    pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install 'cuvil[sign]')")
    from test_gpu_bundle import FakeDriver
    from cuvil.signing import SignatureError
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    _, b = profile_bundle
    path = b.save(str(tmp_path / "net.cuvil"))
    cuvil.keygen(tmp_path / "key.pem", tmp_path / "pub.pem")
    cuvil.sign(path, tmp_path / "key.pem")
    m = cuvil.load(path, verify=tmp_path / "pub.pem")
    assert m.module_loads == 4
    m.close()
    with open(os.path.join(path, "b2", "kernels.ptx"), "a") as f:      # one bucket's kernels changed
        f.write("// edited\n")
    with pytest.raises(SignatureError):
        cuvil.load(path, verify=tmp_path / "pub.pem")


# --- the fail-safe -------------------------------------------------------------------------------------------

@needs_libdevice
@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: the missing-GPU path runs by injection on the GPU")
def test_gpu_missing_runs_the_x86_fallback_at_every_profile_shape(profile_bundle, tmp_path):
    p, b = profile_bundle
    so = p.compile(shape_profiles={"N": (1, 4, 8)}).save(str(tmp_path / "libnet.so"))
    with pytest.warns(RuntimeWarning, match="running the x86 artifact"):
        m = cuvil.load(b.path, fallback=so)
    assert isinstance(m, FailSafeModel) and m.active == "fallback"
    for n in (1, 3, 8):
        x = np.random.default_rng(n).standard_normal((n, 3, 8, 8)).astype(np.float32)
        (y,) = m.run(x)
        np.testing.assert_allclose(y, p.run_reference({"x": x})["y"], rtol=1e-5, atol=1e-6)
    st = m.stats()
    assert st["fallbacks"]["load"] == 1 and st["fallbacks"]["calls"] == 3 and st["gpu"] is None
    assert list(st["fallbacks"]["errors"]) == ["NoGpuError"]
    with pytest.raises(ShapeError, match="outside the profile"):
        m.run(np.zeros((9, 3, 8, 8), np.float32))
    m.close()


def test_injected_faults_fail_the_next_matching_driver_call(monkeypatch):
    class R:   # the two CUresults _call compares with
        CUDA_SUCCESS = 0

    class Drv:
        CUresult = R
    rt.clear_faults()
    rt.inject_fault("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY")
    assert rt._call(Drv, "cuStreamSynchronize", (0,)) is None          # another call is untouched
    with pytest.raises(rt.CudaError, match="CUDA_ERROR_OUT_OF_MEMORY") as e:
        rt._call(Drv, "cuMemAlloc(arena, 64 B)", (0, 1234))
    assert e.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert rt._call(Drv, "cuMemAlloc(arena, 64 B)", (0, 1234)) == 1234   # once only
    monkeypatch.setenv(rt.FAULT_ENV, "cuInit=CUDA_ERROR_NO_DEVICE")
    with pytest.raises(rt.NoGpuError, match="CUDA_ERROR_NO_DEVICE"):
        rt.driver()
    with pytest.raises(CuvilError, match="CUresult"):
        rt.inject_fault("cuMemAlloc", "out of memory")
    rt.clear_faults()


class _Stub:
    """A model that answers with ``value``, or raises the CudaError ``fail`` once (the fail-safe's policy)."""
    run_options = ("mode",)

    def __init__(self, value, fail=None):
        self.value, self.fail, self.closed = value, fail, False
        self.signature = cuvil.targets.model_api.Signature(
            "stub", (cuvil.targets.model_api.tensor_spec("x", 1, [2]),), (cuvil.targets.model_api.tensor_spec("y", 1, [2]),))

    def _run_arrays(self, arrays, **options):
        if self.fail:
            err, self.fail = self.fail, None
            raise rt.CudaError("cuGraphLaunch", err, "injected")
        return [np.full(2, self.value, np.float32)]

    def close(self):
        self.closed = True


@pytest.mark.parametrize("error, sticky", [("CUDA_ERROR_OUT_OF_MEMORY", False), ("CUDA_ERROR_ILLEGAL_ADDRESS", True)])
def test_a_run_time_fault_falls_back_with_a_warning_and_a_count(error, sticky):
    gpu = _Stub(1.0, fail=error)
    m = FailSafeModel("b.cuvil", lambda: gpu, lambda: _Stub(2.0), "libb.so")
    x = np.zeros(2, np.float32)
    with pytest.warns(RuntimeWarning, match=error):
        assert m.run(x)[0][0] == 2.0                     # the faulting call ran on the fallback
    assert m.run(x)[0][0] == (2.0 if sticky else 1.0)     # OOM: the GPU again; a fault: the fallback for good
    st = m.fallbacks
    assert st["run"] == 1 and st["errors"] == {error: 1} and st["calls"] == 1 + sticky
    assert gpu.closed == sticky and m.active == ("fallback" if sticky else "gpu")


# --- on a real GPU -------------------------------------------------------------------------------------------

@needs_gpu
@needs_libdevice
def test_gpu_profile_bundle_runs_every_shape_padded_or_exact(profile_bundle):
    p, b = profile_bundle
    with rt.load_bundle(b.path, max_graphs=2) as m:
        loads = m.module_loads
        for n in (1, 3, 8, 5, 2, 7, 4, 1):
            x = np.random.default_rng(n).standard_normal((n, 3, 8, 8)).astype(np.float32)
            (y,) = m.run(x)
            assert y.shape == (n, 5)
            np.testing.assert_allclose(y, p.run_reference({"x": x})["y"], rtol=1e-4, atol=1e-6)
            assert m.stats()["graphs_alive"] <= 2
        st = m.stats()
        assert m.module_loads == loads == 4                       # nothing loaded or compiled at run time
        assert st["buckets"]["N=8"]["hits"] + st["buckets"]["N=8"]["misses"] == 3   # 8, 5, 7
        assert st["evictions"] >= 1 and all(b["nodes"] > 0 for b in st["buckets"].values() if b["captures"])


@needs_gpu
@needs_libdevice
@pytest.mark.parametrize("call, error, where", [
    ("cuInit", "CUDA_ERROR_NO_DEVICE", "load"),
    ("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY", "load"),
    ("cuGraphInstantiate", "CUDA_ERROR_OUT_OF_MEMORY", "run"),
    ("cuGraphLaunch", "CUDA_ERROR_ILLEGAL_ADDRESS", "run")])
def test_gpu_faults_fall_back_to_x86(profile_bundle, tmp_path, call, error, where):
    p, b = profile_bundle
    so = p.compile(shape_profiles={"N": (1, 4, 8)}).save(str(tmp_path / "libnet.so"))
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
    rt.clear_faults()
    try:
        if where == "load":
            rt.inject_fault(call, error)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = cuvil.load(b.path, fallback=so)
            if where == "run":
                rt.inject_fault(call, error)
            (y,) = m.run(x)
        assert any(error in str(w.message) for w in caught)
        np.testing.assert_allclose(y, p.run_reference({"x": x})["y"], rtol=1e-4, atol=1e-6)
        st = m.stats()["fallbacks"]
        assert st[where] == 1 and st["errors"] == {("NoGpuError" if call == "cuInit" else error): 1}
        (y2,) = m.run(x)                                   # and the next call still answers
        np.testing.assert_allclose(y2, y, rtol=1e-4, atol=1e-6)
        m.close()
    finally:
        rt.clear_faults()


# --- bucket points in parallel processes; weights that depend on a symbol ------------------------------------

def position_net() -> onnx.ModelProto:
    """x[1,S,4] + table[:S] (a position table sliced to the sequence length, as BERT's embeddings are): the
    folded constant differs per bucket of S."""
    table = nh.from_array(np.arange(16 * 4, dtype=np.float32).reshape(16, 4), "table")
    consts = [nh.from_array(np.array(v, np.int64), n) for n, v in (("one", 1), ("zero", [0]), ("ax0", [0]))]
    nodes = [h.make_node("Shape", ["x"], ["shp"]), h.make_node("Gather", ["shp", "one"], ["s"], axis=0),
             h.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
             h.make_node("Slice", ["table", "zero", "s1", "ax0"], ["pos"]), h.make_node("Add", ["x", "pos"], ["y"])]
    g = h.make_graph(nodes, "pos", [h.make_tensor_value_info("x", T.FLOAT, [1, "S", 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, "S", 4])], [table] + consts)
    return onnx.helper.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@needs_libdevice
def test_buckets_compiled_in_processes_make_the_same_bundle_and_weights_are_kept_once_per_content(tmp_path,
                                                                                                   monkeypatch):
    p = Pipeline.from_onnx(position_net()).optimize()
    kw = dict(arch="sm_90", cache=False, shape_profiles={"S": (2, 4, 8)}, graph_buckets=[2, 4, 8])
    one = p.compile(TARGET, **kw).save(str(tmp_path / "one.cuvil"))
    par = p.compile(TARGET, jobs=2, **kw).save(str(tmp_path / "par.cuvil"))
    names = sorted(os.path.relpath(os.path.join(d, f), one) for d, _, fs in os.walk(one) for f in fs)
    assert names == sorted(os.path.relpath(os.path.join(d, f), par) for d, _, fs in os.walk(par) for f in fs)
    for n in names:
        if n.endswith((".ptx", ".bin", ".cubin")) or n.endswith("plan.json"):
            with open(os.path.join(one, n), "rb") as a, open(os.path.join(par, n), "rb") as b:
                assert a.read() == b.read(), n
    with open(os.path.join(one, "plan.json")) as f:
        plan = json.load(f)
    # each S folds its own slice of the table: three weight files, at the top, none left in the buckets
    assert [e["weights"] for e in plan["buckets"]] == ["weights.bin", "weights-1.bin", "weights-2.bin"]
    assert not any(n.startswith("b") and n.endswith("weights.bin") for n in names)
    assert json.load(open(os.path.join(one, "manifest.json")))["weights_shared"] is False
    # the runtime uploads each file once and points each bucket's table at its own
    from test_gpu_bundle import FakeDriver
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    with rt.load_bundle(one) as m:
        assert drv.calls.count("cuMemcpyHtoD") == 3 and len({v.weights for v in m._variants}) == 3
        for v in m._variants:
            blob = np.fromfile(os.path.join(one, v.weights_file), dtype=np.uint8)
            assert np.array_equal(drv.mem[v.weights][:blob.nbytes], blob)
    with pytest.raises(CuvilError, match="jobs"):
        p.compile(TARGET, jobs=-1, **kw)


@needs_libdevice
def test_cli_bucket_jobs_compiles_the_points_in_processes_and_is_refused_for_x86(tmp_path, capsys):
    onnx.save(position_net(), str(tmp_path / "pos.onnx"))
    out = tmp_path / "pos.cuvil"
    assert cli_main(["compile", str(tmp_path / "pos.onnx"), "--target", TARGET, "-o", str(out), "--shape-profile",
                     "S=2:4:8", "--graph-buckets", "2,4,8", "--bucket-jobs", "2"]) == 0
    with open(out / "plan.json") as f:
        assert [e["point"]["S"] for e in json.load(f)["buckets"]] == [2, 4, 8]
    capsys.readouterr()
    assert cli_main(["compile", str(tmp_path / "pos.onnx"), "-o", str(tmp_path / "libpos.so"), "--shape-profile",
                     "S=2:4:8", "--bucket-jobs", "0"]) != 0
    assert "--bucket-jobs applies to --target nvptx64-nvidia-cuda only" in capsys.readouterr().err


# --- symbols that vary together (a decode step's past and total lengths) ----------------------------------------

def test_buckets_of_symbols_that_vary_together_fail_with_the_point_and_the_next_step():
    """GPT-2's decode step has past_sequence and total_sequence (= past + 1, the mask's length): their buckets
    combine as a product, so the default buckets are too many and a given pair holds points no call can have
    (past 1023 with a 129-long mask). Both are refused before any kernel is built, naming the symbols."""
    from cuvil.testing.hf_models import gpt2_decode_model
    m = gpt2_decode_model(vocab=50, hidden=16, layers=1, heads=2, ffn=32)
    p = Pipeline.from_onnx(m).optimize()
    prof = {"past_sequence": (1, 128, 1023), "total_sequence": (2, 129, 1024)}
    with pytest.raises(CuvilError, match="110 bucket points") as e:
        p.compile(TARGET, cache=False, fixed={"batch": 1}, shape_profiles=prof)
    assert "past_sequence=128,1023" in str(e.value) and "total_sequence=129,1024" in str(e.value)
    with pytest.raises(ShapeError, match="bucket point total_sequence=129,past_sequence=1023: node 'mask.kv'") as e:
        p.compile(TARGET, cache=False, fixed={"batch": 1}, shape_profiles=prof,
                  graph_buckets={"past_sequence": [1023], "total_sequence": [129, 1024]})
    assert "every combination of the buckets of total_sequence, past_sequence is compiled" in str(e.value)
