"""GPU bundles (``NAME.cuvil/``) without a GPU: what compile writes (PTX that ptxas accepts, weights as the
schedule laid them out, plan, manifest), loading without a driver (a clear error, or the x86 fallback), the
CLI, and the runtime's driver plumbing against a fake ``cuda.bindings.driver`` that records what it is asked
to do (argument packing, capture once then replay, eager launches, pointer table, LRU of graphs, error
names). Execution on a real GPU runs only where one is present."""
import ctypes
import enum
import os
import types

import numpy as np
import pytest

import cuvil
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError, ShapeError
from cuvil.targets.ptx import runtime as rt
from cuvil.targets.ptx.bundle import read_bundle
from cuvil.targets.ptx.codegen import gpu_schedule
from cuvil.testing import light_model, small_cnn
from cuvil.testing.requires import NO_GPU, PTXAS, needs_gpu, needs_libdevice, needs_ptxas

TARGET = "nvptx64-nvidia-cuda"


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    p = Pipeline.from_onnx(small_cnn()).optimize()
    return p, p.compile(TARGET, arch="sm_90", cache=False)


# --- what compile writes -------------------------------------------------------------------------------------

@needs_libdevice
def test_bundle_files_plan_and_manifest(small_bundle):
    p, b = small_bundle
    names = sorted(os.listdir(b.path))
    assert {"kernels.ptx", "weights.bin", "plan.json", "manifest.json"} <= set(names)
    plan, man = read_bundle(b.path)
    sched = gpu_schedule(p.graph)
    assert plan["arena_bytes"] == sched.arena_bytes and plan["weights_bytes"] == sched.weights_bytes
    assert [k["stage"] for k in plan["kernels"]] == [s.name for s in sched.stages]
    assert [k["name"] for k in plan["kernels"]] == [f"cuvil_k{i}" for i in range(len(sched.stages))]
    for k in plan["kernels"]:   # the convolution's implicit-GEMM kernel: one 16 x 64 tile per block of 64 threads
        block = 64 if k["kind"] == "conv" else 256
        assert k["block"] == [block, 1, 1] and k["grid"] == [-(-k["n"] // block), 1, 1] and k["args"] == ["bufs", "n"]
    assert [k["kind"] for k in plan["kernels"]].count("conv") == 1
    assert plan["inputs"] == [{"name": "x", "dtype": "float32", "dtype_code": 1, "shape": [2, 3, 10, 10], "buffer": 2}]
    assert plan["outputs"] == [{"name": "y", "dtype": "float32", "dtype_code": 1, "shape": [2, 8, 10, 10], "buffer": 3}]
    assert plan["buffers"]["count"] == 4
    ptx = open(os.path.join(b.path, "kernels.ptx")).read()
    assert ".target sm_90" in ptx and all(f".entry {k['name']}(" in ptx for k in plan["kernels"])
    # every constant sits in weights.bin at the offset the schedule's weights plan gave it
    blob = np.fromfile(os.path.join(b.path, "weights.bin"), dtype=np.uint8)
    assert blob.nbytes == sched.weights_bytes > 0
    for buf, arr in sched.weights:
        a = np.ascontiguousarray(arr, dtype=buf.dtype.numpy)
        assert blob[buf.offset:buf.offset + a.nbytes].tobytes() == a.tobytes(), buf.name
    assert man["model"] == "small" and man["target"] == {"triple": TARGET, "arch": "sm_90"}
    assert man["cuvil_version"] == cuvil.__version__ and man["float16_tensors"] == []
    assert man["kernels"] == len(plan["kernels"])
    if PTXAS:
        assert set(man["ptxas"]["kernels"]) == {k["name"] for k in plan["kernels"]}
        assert all(0 < v["registers"] <= 255 for v in man["ptxas"]["kernels"].values())
        assert os.path.getsize(os.path.join(b.path, man["ptxas"]["cubin"])) > 0
    else:
        assert man["ptxas"] is None


@needs_ptxas
@needs_libdevice
@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_light_model_bundle(name, tmp_path):
    """A light architecture's bundle: ptxas accepted the module (compile assembles it) and reports every kernel."""
    b = Pipeline.from_onnx(light_model(name)).optimize().compile(TARGET, cache=False)
    out = b.save(str(tmp_path / f"{name}.cuvil"))
    plan, man = read_bundle(out)
    assert len(plan["kernels"]) == man["kernels"] > 10
    assert set(man["ptxas"]["kernels"]) == {k["name"] for k in plan["kernels"]}
    assert os.path.getsize(os.path.join(out, "weights.bin")) == plan["weights_bytes"] == man["weights_bytes"]
    regs = [v["registers"] for v in man["ptxas"]["kernels"].values()]
    print(f"\n{name}: {len(regs)} kernels, registers max {max(regs)}, arena {plan['arena_bytes']:,} B")


@needs_libdevice
def test_compile_is_cached_and_rejects_bad_arch(small_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    p, _ = small_bundle
    first = p.compile(TARGET, arch="sm_80")
    again = p.compile(TARGET, arch="sm_80")
    assert not first.cached and again.cached and again.path == first.path
    assert again.manifest["target"]["arch"] == "sm_80"
    with pytest.raises(CuvilError, match="sm_"):
        p.compile(TARGET, arch="compute_90")
    with pytest.raises(CuvilError, match="unknown target"):
        p.compile("riscv64")


# --- loading without a GPU -----------------------------------------------------------------------------------

@needs_libdevice
@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: the no-GPU error cannot be seen")
def test_load_without_gpu_is_a_clear_error(small_bundle):
    _, b = small_bundle
    with pytest.raises(rt.NoGpuError, match="^no CUDA driver/GPU: "):
        cuvil.load(b.path)


@needs_libdevice
def test_load_falls_back_to_the_x86_library(small_bundle, tmp_path, monkeypatch):
    p, b = small_bundle
    so = p.compile(fixed={}).save(str(tmp_path / "libsmall.so"))

    def no_gpu():
        raise rt.NoGpuError("no CUDA driver/GPU: (test)")
    monkeypatch.setattr(rt, "driver", no_gpu)
    with pytest.warns(RuntimeWarning, match="running the x86 artifact"):
        m = cuvil.load(b.path, fallback=so)
    x = np.random.default_rng(1).standard_normal((2, 3, 10, 10)).astype(np.float32)
    (y,) = m.run(x)
    np.testing.assert_allclose(y, p.run_reference({"x": x})["y"], rtol=1e-5, atol=1e-6)
    with pytest.raises(rt.NoGpuError):
        cuvil.load(b.path)


def test_load_of_a_non_bundle_names_it(tmp_path):
    (tmp_path / "x.cuvil").mkdir()
    with pytest.raises(CuvilError, match="missing kernels.ptx"):
        cuvil.load(str(tmp_path / "x.cuvil"))


# --- the command line ----------------------------------------------------------------------------------------

@needs_libdevice
def test_cli_compile_nvptx(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    import onnx
    onnx.save(small_cnn(), str(tmp_path / "small.onnx"))
    out = tmp_path / "build" / "small.cuvil"
    rc = cli_main(["compile", "--input", str(tmp_path / "small.onnx"), "--target", TARGET, "--arch", "sm_90",
                   "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"wrote {out}/" in text and "kernels for sm_90" in text
    plan, man = read_bundle(str(out))
    assert man["target"]["arch"] == "sm_90" and len(plan["kernels"]) == man["kernels"]
    assert cli_main(["compile", "--input", str(tmp_path / "small.onnx"), "--target", TARGET,
                     "--output", str(tmp_path / "libsmall.so")]) == 2
    assert "DIR/NAME.cuvil" in capsys.readouterr().err


# --- the runtime's driver plumbing, against a fake driver ----------------------------------------------------

class FakeDriver:
    """Just enough of ``cuda.bindings.driver``: results are tuples ``(CUresult, values...)``; device memory is
    host memory; a launch records (kernel, grid, block, the two argument values it was given); stream
    capture records launches into a graph that cuGraphLaunch replays into the same log."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_LAUNCH_FAILED = 719

    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=types.SimpleNamespace(value=1))
    CUevent_flags = types.SimpleNamespace(CU_EVENT_DEFAULT=types.SimpleNamespace(value=0),
                                          CU_EVENT_DISABLE_TIMING=types.SimpleNamespace(value=2))
    CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_NUM_REGS=4)
    CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
                                               CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
                                               CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT=16)

    def __init__(self):
        self.mem = {}          # address -> bytearray-backed numpy array
        self.log = []          # launches, in order
        self.calls = []
        self.capturing = None
        self.fail = {}         # function name -> CUresult to return
        self.module_image = None
        self.streams = []      # streams created, in order
        self.host = {}         # page-locked host allocations: address -> array
        self.waits = []        # (stream, event) of each cuStreamWaitEvent
        self.order = []        # ("launch", stream, kernel) / ("record", event, stream) / ("wait", stream, event)
        S = self.CUresult.CUDA_SUCCESS

        def ok(*vals):
            return (S, *vals)

        def rec(name, fn):
            def wrapped(*a):
                self.calls.append(name)
                if name in self.fail:
                    return (self.fail[name],) + (None,) * (1 if name not in ("cuLaunchKernel", "cuGraphLaunch") else 0)
                return fn(*a)
            return wrapped

        def alloc(n):
            buf = np.zeros(n, dtype=np.uint8)
            self.mem[buf.ctypes.data] = buf
            return ok(buf.ctypes.data)

        def stream_create(flags):
            self.streams.append(f"stream{len(self.streams)}")
            return ok(self.streams[-1])

        def host_alloc(n, flags):
            buf = np.zeros(n, dtype=np.uint8)
            self.host[buf.ctypes.data] = buf
            return ok(buf.ctypes.data)

        def htod(dst, src, n, stream=None):
            ctypes.memmove(int(dst), int(src), n)
            return ok()

        def dtoh(dst, src, n, stream=None):
            ctypes.memmove(int(dst), int(src), n)
            return ok()

        def load(image):
            self.module_image = ctypes.string_at(image, 16)
            return ok("module")

        def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
            p = (ctypes.c_uint64 * 2).from_address(params)
            vals = (ctypes.c_uint64.from_address(p[0]).value, ctypes.c_int64.from_address(p[1]).value)
            entry = (f, (gx, gy, gz), (bx, by, bz), vals)
            self.order.append(("launch", stream, f))
            (self.capturing if self.capturing is not None else self.log).append(entry)
            return ok()

        def begin(stream, mode):
            self.capturing = []
            return ok()

        def end(stream):
            g, self.capturing = self.capturing, None
            return ok(g)

        def graph_launch(exe, stream):
            self.log.extend(exe)
            return ok()

        table = {
            "cuInit": lambda flags: ok(), "cuDeviceGetCount": lambda: ok(1), "cuDeviceGet": lambda i: ok(i),
            "cuDevicePrimaryCtxRetain": lambda d: ok("ctx"), "cuCtxSetCurrent": lambda c: ok(),
            "cuDeviceGetAttribute": lambda a, d: ok({75: 9, 76: 0, 16: 132}[a]),
            "cuDeviceGetName": lambda n, d: ok(b"Fake GPU\0\0"), "cuDriverGetVersion": lambda: ok(13000),
            "cuDeviceTotalMem": lambda d: ok(1 << 34), "cuStreamCreate": stream_create,
            "cuMemHostAlloc": host_alloc, "cuMemFreeHost": lambda p: (self.host.pop(p), ok())[1],
            "cuStreamWaitEvent": lambda s, e, f: (self.waits.append((s, e)), self.order.append(("wait", s, e)), ok())[2],
            "cuEventSynchronize": lambda e: ok(),
            "cuModuleLoadData": load, "cuModuleGetFunction": lambda m, name: ok(name.decode()),
            "cuFuncGetAttribute": lambda a, f: ok(32), "cuMemAlloc": alloc, "cuMemcpyHtoD": htod,
            "cuMemcpyHtoDAsync": htod, "cuMemcpyDtoHAsync": dtoh, "cuLaunchKernel": launch,
            "cuStreamSynchronize": lambda s: ok(), "cuMemGetInfo": lambda: ok(1 << 30, 1 << 34),
            "cuStreamBeginCapture": begin, "cuStreamEndCapture": end,
            "cuGraphGetNodes": lambda g, n=0: ok(None, len(g)), "cuGraphInstantiate": lambda g, flags: ok(list(g)),
            "cuGraphLaunch": graph_launch, "cuGraphExecDestroy": lambda e: ok(), "cuGraphDestroy": lambda g: ok(),
            "cuMemFree": lambda p: ok(), "cuModuleUnload": lambda m: ok(), "cuStreamDestroy": lambda s: ok(),
            "cuDevicePrimaryCtxRelease": lambda d: ok(), "cuEventCreate": lambda f: ok(object()),
            "cuEventRecord": lambda e, s: (self.order.append(("record", e, s)), ok())[1], "cuEventElapsedTime": lambda a, b: ok(0.5),
            "cuEventDestroy": lambda e: ok(), "CUstream": lambda h: ("user stream", h),
            "cuGetErrorName": lambda e: ok(self.CUresult(e).name.encode()),
        }
        for name, fn in table.items():
            setattr(self, name, rec(name, fn) if name.startswith("cu") else fn)


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    return drv


@needs_libdevice
def test_runtime_captures_once_then_replays(small_bundle, fake):
    _, b = small_bundle
    plan, _ = read_bundle(b.path)
    m = rt.load_bundle(b.path, max_graphs=2)
    assert m.module_source == ("kernels.sm_90.cubin" if PTXAS else "kernels.ptx")
    assert m.registers == {k["name"]: 32 for k in plan["kernels"]}
    # the weights were uploaded once into their own allocation
    blob = np.fromfile(os.path.join(b.path, "weights.bin"), dtype=np.uint8)
    assert np.array_equal(fake.mem[m.weights][:blob.nbytes], blob)
    x = np.random.default_rng(0).standard_normal((2, 3, 10, 10)).astype(np.float32)
    (y,) = m.run(x)
    assert y.shape == (2, 8, 10, 10) and y.dtype == np.float32
    n = len(plan["kernels"])
    # first run: one eager pass (loads and checks the kernels), then the captured graph's replay
    assert len(fake.log) == 2 * n and fake.calls.count("cuStreamBeginCapture") == 1
    expect = [(k["name"], tuple(k["grid"]), tuple(k["block"]), (m._table, k["n"])) for k in plan["kernels"]]
    assert fake.log[:n] == expect and fake.log[n:] == expect
    # the input went to its staging buffer, which the pointer table names at index 2
    assert fake.mem[m._in_stage[0]].view(np.float32).reshape(x.shape).tolist() == x.tolist()
    table = fake.mem[m._table].view(np.uint64)
    assert table.tolist() == [m.arena, m.weights, m._in_stage[0], m._out_stage[0]]
    fake.log.clear()
    m.run(x=x)
    assert fake.log == expect and fake.calls.count("cuStreamBeginCapture") == 1
    assert fake.calls.count("cuGraphLaunch") == 2
    st = m.graph_stats()
    assert st["graphs"] == 1 and st["captures"] == 1 and st["hits"] == 1 and st["buckets"] == [[[2, 3, 10, 10]]]
    fake.log.clear()
    m.run(x, mode="eager")
    assert fake.log == expect and fake.calls.count("cuGraphLaunch") == 2
    m.close()
    assert fake.calls[-1] == "cuDevicePrimaryCtxRelease"
    with pytest.raises(CuvilError, match="closed"):
        m.run(x)


@needs_libdevice
def test_runtime_device_pointers_retarget_the_table(small_bundle, fake):
    _, b = small_bundle
    m = rt.load_bundle(b.path)
    xin, yout = np.zeros(600, np.float32), np.zeros(1600, np.float32)
    m.run_device([xin.ctypes.data], [yout.ctypes.data], stream=1234)
    table = fake.mem[m._table].view(np.uint64)
    assert table.tolist() == [m.arena, m.weights, xin.ctypes.data, yout.ctypes.data]
    writes = fake.calls.count("cuMemcpyHtoDAsync")
    m.run_device([xin.ctypes.data], [yout.ctypes.data])
    assert fake.calls.count("cuMemcpyHtoDAsync") == writes, "same pointers: the table is not copied again"
    m.run(np.zeros((2, 3, 10, 10), np.float32))
    assert table.tolist()[2:] == [m._in_stage[0], m._out_stage[0]]
    with pytest.raises(ShapeError, match="1 input and 1 output pointers"):
        m.run_device([1, 2], [3])
    with pytest.raises(ShapeError, match="null device pointer"):
        m.run_device([0], [yout.ctypes.data])


@needs_libdevice
def test_runtime_checks_inputs_and_names_driver_errors(small_bundle, fake):
    _, b = small_bundle
    m = rt.load_bundle(b.path)
    x = np.zeros((2, 3, 10, 10), np.float32)
    assert isinstance(m, cuvil.Model) and [str(d) for d in m.inputs] == ["x: float32[2, 3, 10, 10]"]
    out = m.run({"x": x})                       # the one interface: a dict in, a dict out
    assert list(out) == ["y"] and out["y"].shape == (2, 8, 10, 10)
    with pytest.raises(ShapeError, match=r"dtype is 11 \(double\), expected 1 \(float\) .*\n  next: convert it with "
                                         r"\.astype\(numpy\.float32\)"):
        m.run(x.astype(np.float64))
    with pytest.raises(ShapeError, match=r"dim 0 is 1, expected 2 .*\n  next: pass an array of shape \[2, 3, 10, 10\]"):
        m.run(x[:1])
    with pytest.raises(ShapeError, match="unknown input 'z'"):
        m.run(z=x)
    with pytest.raises(ShapeError, match="missing input"):
        m.run()
    fake.fail["cuLaunchKernel"] = FakeDriver.CUresult.CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(rt.CudaError, match=r"cuLaunchKernel\(cuvil_k0, stage .*\) failed: CUDA_ERROR_LAUNCH_FAILED"):
        m.run(x, mode="eager")
    fake.fail = {"cuMemAlloc": FakeDriver.CUresult.CUDA_ERROR_INVALID_VALUE}
    with pytest.raises(rt.CudaError, match=r"cuMemAlloc\(weights, \d+ B\) failed: CUDA_ERROR_INVALID_VALUE"):
        rt.load_bundle(b.path)
    fake.fail.clear()
    profile = m.profile_kernels(repeats=3)
    assert [p["name"] for p in profile] == [k["name"] for k in m.plan["kernels"]] and profile[0]["ms"] == 0.5


def test_graph_cache_is_a_bounded_lru():
    gone = []
    c = rt.GraphCache(2, gone.append)
    c.put("a", "A", 100)
    c.put("b", "B", 50)
    assert c.get("a") == "A"          # a is now the most recent
    c.put("c", "C", 10)               # evicts b
    assert gone == ["B"] and c.keys() == ["a", "c"] and c.get("b") is None
    st = c.stats()
    assert st["graphs"] == 2 and st["bytes"] == 110 and st["evictions"] == 1 and st["captures"] == 3
    c.clear()
    assert sorted(gone) == ["A", "B", "C"] and len(c) == 0
    with pytest.raises(CuvilError, match="max_graphs"):
        rt.GraphCache(0, gone.append)


# --- on a real GPU -------------------------------------------------------------------------------------------

@needs_gpu
@needs_libdevice
def test_gpu_matches_reference(small_bundle):
    p, b = small_bundle
    x = np.random.default_rng(2).standard_normal((2, 3, 10, 10)).astype(np.float32)
    ref = p.run_reference({"x": x})["y"]
    with rt.load_bundle(b.path) as m:
        (y_graph,) = m.run(x)
        (y_eager,) = m.run(x, mode="eager")
        np.testing.assert_allclose(y_graph, ref, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(y_graph, y_eager)
        assert m.graph_stats()["graphs"] == 1


@needs_gpu
@needs_libdevice
def test_gpu_run_device_on_caller_memory(small_bundle):
    _, b = small_bundle
    drv = rt.driver()
    x = np.random.default_rng(3).standard_normal((2, 3, 10, 10)).astype(np.float32)
    with rt.load_bundle(b.path, max_graphs=1) as m:
        (expect,) = m.run(x)
        d_in = int(rt._call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
        d_out = int(rt._call(drv, "cuMemAlloc", drv.cuMemAlloc(expect.nbytes)))
        try:
            rt._call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
            m.run_device([d_in], [d_out])
            y = np.empty_like(expect)
            rt._call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(y.ctypes.data, d_out, y.nbytes))
        finally:
            drv.cuMemFree(d_in)
            drv.cuMemFree(d_out)
        np.testing.assert_array_equal(y, expect)
        st = m.graph_stats()
        assert st["graphs"] == 1 and st["captures"] == 1 and st["hits"] >= 1
