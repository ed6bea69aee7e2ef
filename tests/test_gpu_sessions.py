"""Sessions of a GPU model (issue 22, part 4): several inferences in flight from several host threads, each on
its own stream with its own arena, staging and graphs, the modules and weights shared; page-locked host
staging; ``run_device`` ordering across streams. The plumbing runs against test_gpu_bundle's fake driver
(no GPU claim); the concurrent runs on a real GPU only where one is present."""
import threading
import time

import numpy as np
import pytest

import cuvil
from cuvil.errors import CuvilError
from cuvil.targets.ptx import runtime as rt
from cuvil.targets.ptx.session import GpuSession

from test_gpu_bundle import NO_GPU, FakeDriver, needs_gpu, needs_libdevice, small_bundle  # noqa: F401

X_SHAPE = (2, 3, 10, 10)


@pytest.fixture
def fake(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    return drv


def test_sessions_are_checked_before_the_driver(small_bundle, monkeypatch):
    _, b = small_bundle
    monkeypatch.setattr(rt, "driver", lambda: pytest.fail("the driver was touched"))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(CuvilError, match="sessions must be a positive integer") as e:
            rt.load_bundle(b.path, sessions=bad)
        assert "sessions=4" in str(e.value.hint)


@needs_libdevice
def test_each_session_has_its_own_stream_arena_staging_and_tables(small_bundle, fake):
    _, b = small_bundle
    m = rt.load_bundle(b.path, sessions=3)
    assert m.module_loads == 1 and len(m.sessions) == 3
    ss = m.sessions
    # one weights upload, one module; per session a stream, an arena, staging and a table
    assert fake.calls.count("cuMemcpyHtoD") == 1 and fake.calls.count("cuModuleLoadData") == 1
    assert len({s.stream for s in ss}) == 3 and len({s.arena for s in ss}) == 3
    assert len({s._in_stage[0] for s in ss}) == 3 and len({s._lanes[0].table for s in ss}) == 3
    x = np.random.default_rng(0).standard_normal(X_SHAPE).astype(np.float32)
    for s in ss:                                   # each session's launches name its own table
        fake.log.clear()
        s.run(x, mode="eager")
        assert {e[3][0] for e in fake.log} == {s._lanes[0].table}
        table = fake.mem[s._lanes[0].table].view(np.uint64)
        assert table.tolist() == [s.arena, m.weights, s._in_stage[0], s._out_stage[0]]
    st = m.stats()
    assert st["sessions"] == 3 and st["pinned"] is True
    assert m.device_bytes == m.weights_bytes + sum(s.device_bytes for s in ss)
    m.close()
    assert not fake.host, "the page-locked staging was freed"
    assert fake.calls.count("cuStreamDestroy") == 3 and fake.calls[-1] == "cuDevicePrimaryCtxRelease"


@needs_libdevice
def test_concurrent_calls_each_take_a_free_session(small_bundle, fake):
    """8 threads on a pool of 3: never two calls on one session's stream at once, and several at once."""
    _, b = small_bundle
    m = rt.load_bundle(b.path, sessions=3)
    busy, overlap, lock = set(), [0], threading.Lock()
    sync = fake.cuStreamSynchronize

    def slow_sync(stream):
        with lock:
            assert stream not in busy, f"two calls on {stream} at once"
            busy.add(stream)
            overlap[0] = max(overlap[0], len(busy))
        time.sleep(0.002)
        with lock:
            busy.discard(stream)
        return sync(stream)

    fake.cuStreamSynchronize = slow_sync
    errors = []

    def work():
        try:
            for _ in range(10):
                (y,) = m.run(np.zeros(X_SHAPE, np.float32))
                assert y.shape == (2, 8, 10, 10)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert overlap[0] >= 2, "no two calls were ever in flight together"
    assert overlap[0] <= 3
    st = m.stats()
    assert st["captures"] <= 3 and st["hits"] + st["misses"] == 80   # at most one capture per session
    m.close()


@needs_libdevice
def test_page_locked_inputs_filled_in_place_are_copied_by_dma_only(small_bundle, fake):
    _, b = small_bundle
    sources = []
    htod = fake.cuMemcpyHtoDAsync
    fake.cuMemcpyHtoDAsync = lambda dst, src, n, s: (sources.append((int(dst), int(src), n)), htod(dst, src, n, s))[1]
    m = rt.load_bundle(b.path)
    s = m.sessions[0]
    assert len(fake.host) == 1 and s.host_bytes == 2 * 3 * 10 * 10 * 4      # the input's staging, page-locked
    x = np.random.default_rng(1).standard_normal(X_SHAPE).astype(np.float32)
    pattern = np.arange(2 * 8 * 10 * 10, dtype=np.float32)
    fake.mem[s._out_stage[0]][:pattern.nbytes] = pattern.view(np.uint8)     # what the "kernels" wrote
    (y,) = m.run(x)
    inputs = [e for e in sources if e[0] == s._in_stage[0]]
    assert inputs[-1][1] == x.ctypes.data, "any other array: straight from its memory (the driver stages it)"
    assert np.array_equal(y.ravel(), pattern)
    fake.mem[s._out_stage[0]][:] = 0              # the outputs are the caller's: the next run leaves them
    m.run(x)
    assert np.array_equal(y.ravel(), pattern)
    # pinned_inputs: the staging, filled in place; run sends it as is
    (xin,) = m.pinned_inputs()
    assert xin.shape == X_SHAPE and xin.dtype == np.float32 and xin.ctypes.data == s._in_host[0]
    xin[...] = 7.0
    m.run(xin)
    assert [e for e in sources if e[0] == s._in_stage[0]][-1][1] == s._in_host[0]
    assert np.all(fake.mem[s._in_stage[0]].view(np.float32)[:x.size] == 7.0)
    m.close()
    assert not fake.host
    m = rt.load_bundle(b.path, pinned=False)
    assert not fake.host
    with pytest.raises(CuvilError, match="pinned=False") as e:
        m.pinned_inputs()
    assert "pinned=True" in e.value.hint
    m.close()


@needs_libdevice
def test_run_device_without_sync_orders_the_next_call_on_another_stream(small_bundle, fake):
    _, b = small_bundle
    m = rt.load_bundle(b.path)
    s = m.sessions[0]
    xin, yout = np.zeros(600, np.float32), np.zeros(1600, np.float32)
    m.run_device([xin.ctypes.data], [yout.ctypes.data], stream=99, sync=False)
    assert fake.calls[-1] == "cuEventRecord" and not fake.waits
    m.run_device([xin.ctypes.data], [yout.ctypes.data], stream=99, sync=False)
    assert not fake.waits, "the same stream orders the calls itself"
    m.run(np.zeros(X_SHAPE, np.float32))          # the session's own stream waits for the user stream's work
    assert fake.waits == [(s.stream, s._done)]
    m.run(np.zeros(X_SHAPE, np.float32))
    assert len(fake.waits) == 1, "synchronised: no further wait"
    m.close()


@needs_libdevice
def test_an_own_session_is_a_model_and_closes_with_its_model(small_bundle, fake):
    _, b = small_bundle
    m = rt.load_bundle(b.path)
    s = m.session()
    assert isinstance(s, GpuSession) and isinstance(s, cuvil.Model) and s not in m._sessions
    assert s.arena != m.arena and s.stream != m.stream and [str(d) for d in s.inputs] == [str(d) for d in m.inputs]
    out = s.run({"x": np.zeros(X_SHAPE, np.float32)})
    assert list(out) == ["y"]
    s.close()
    with pytest.raises(CuvilError, match="closed"):
        s.run(np.zeros(X_SHAPE, np.float32))
    s2 = m.session(pinned=False)
    m.close()
    with pytest.raises(CuvilError, match="closed"):
        s2.run(np.zeros(X_SHAPE, np.float32))
    assert not fake.host


# --- on a real GPU -------------------------------------------------------------------------------------------

@needs_gpu
@needs_libdevice
def test_gpu_four_threads_four_sessions_match_one(small_bundle):
    """4 threads on 4 sessions, 25 calls each on their own inputs: every output equals the one-session
    output for the same input, bit for bit (the same kernels; a shared arena would mix them)."""
    p, b = small_bundle
    xs = [np.random.default_rng(10 + i).standard_normal(X_SHAPE).astype(np.float32) for i in range(4)]
    with rt.load_bundle(b.path) as one:
        expect = [one.run(x)[0] for x in xs]
    np.testing.assert_allclose(expect[0], p.run_reference({"x": xs[0]})["y"], rtol=1e-4, atol=1e-6)
    with rt.load_bundle(b.path, sessions=4) as m:
        errors, done = [], []

        def work(i):
            try:
                for _ in range(25):
                    (y,) = m.run(xs[i])
                    np.testing.assert_array_equal(y, expect[i])
                done.append(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert sorted(done) == [0, 1, 2, 3] and m.stats()["hits"] + m.stats()["misses"] == 100


@needs_gpu
@needs_libdevice
def test_gpu_run_device_without_sync_then_run_on_the_session(small_bundle):
    _, b = small_bundle
    drv = rt.driver()
    x = np.random.default_rng(5).standard_normal(X_SHAPE).astype(np.float32)
    with rt.load_bundle(b.path, pinned=False) as plain, rt.load_bundle(b.path) as m:
        (expect,) = plain.run(x)
        (y,) = m.run(x)
        np.testing.assert_array_equal(y, expect)                 # pinned staging: the same bytes
        (xin,) = m.pinned_inputs()
        xin[...] = x
        np.testing.assert_array_equal(m.run(xin)[0], expect)
        stream = rt._call(drv, "cuStreamCreate", drv.cuStreamCreate(1))
        d_in = int(rt._call(drv, "cuMemAlloc", drv.cuMemAlloc(x.nbytes)))
        d_out = int(rt._call(drv, "cuMemAlloc", drv.cuMemAlloc(expect.nbytes)))
        try:
            rt._call(drv, "cuMemcpyHtoD", drv.cuMemcpyHtoD(d_in, x.ctypes.data, x.nbytes))
            for _ in range(5):
                m.run_device([d_in], [d_out], stream=stream, sync=False)
            x2 = x[::-1].copy()
            np.testing.assert_array_equal(m.run(x2)[0], plain.run(x2)[0])
            rt._call(drv, "cuStreamSynchronize", drv.cuStreamSynchronize(stream))
            out = np.empty_like(expect)
            rt._call(drv, "cuMemcpyDtoH", drv.cuMemcpyDtoH(out.ctypes.data, d_out, out.nbytes))
            np.testing.assert_array_equal(out, expect)
        finally:
            drv.cuMemFree(d_in)
            drv.cuMemFree(d_out)
            drv.cuStreamDestroy(stream)


@needs_libdevice
def test_cuvil_load_passes_sessions_and_pinned_to_a_bundle(small_bundle, fake):
    _, b = small_bundle
    with cuvil.load(b.path, sessions=2, pinned=False) as m:
        assert len(m.sessions) == 2 and m.stats()["sessions"] == 2 and m.stats()["pinned"] is False
        assert not fake.host
