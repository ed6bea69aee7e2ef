"""The Python loader checks inputs and output sizes before it allocates anything, and a closed model refuses
to run: errors are CuvilError with the input's name and the next step, never numpy's MemoryError."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from cuvil import CuvilError, Pipeline, ShapeError
from cuvil.fuzz import c_abi
from cuvil.targets.x86 import loader

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return c_abi.build_fixture(str(tmp_path_factory.mktemp("loader")))


def feeds(n):
    return c_abi.case_inputs(0, n)


def test_symbolic_outputs_are_sized_before_allocation(lib, monkeypatch):
    m = loader.load(lib)
    x, z = feeds(4)
    np.testing.assert_allclose(m.run(x, z)[0], c_abi.reference(x, z), rtol=1e-4, atol=1e-4)
    m.max_output_bytes = 4 * 4 * 36 * 4 - 1           # one byte short of the N = 4 output
    allocated = []
    real_empty = np.empty
    monkeypatch.setattr(loader.np, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with pytest.raises(CuvilError, match=r"(?s)output 'y' of shape \[4, 4, 6, 6\] takes 2304 bytes, over the 2303 .*"
                                         r"next: run smaller inputs, or load with max_output_bytes=2304"):
        m.run(x, z)
    assert allocated == []
    m.run(*feeds(3))                                   # smaller shapes fit
    m.close()


def test_a_static_output_too_large_is_refused_at_load():
    art = Pipeline.from_onnx(c_abi.fixture_model()).compile(fixed={"N": 2})
    with pytest.raises(CuvilError, match=r"output 'y' of shape \[2, 4, 6, 6\] takes 1152 bytes, over the 100"):
        loader.load(art.path, max_output_bytes=100)


def test_inputs_are_checked_with_the_next_step(lib):
    m = loader.load(lib)
    x, z = feeds(2)
    with pytest.raises(ShapeError, match=r"input 0 'x': dim 0 is N = 5, outside the profile N in \[1, 4\] \(code -19\)"
                                         r"\n  next: split the input, or compile with --shape-profile N=MIN:OPT:MAX "
                                         r"covering 5 \(or --input-shape x=MIN:OPT:MAX, three shapes\)"):
        m.run(np.zeros((5, 3, 6, 6), np.float32), np.zeros((5, 4, 6, 6), np.float32))
    with pytest.raises(ShapeError, match=r"input 1 'z': dim 1 is 3, expected 4 \(code -8\)\n  next: pass an array "
                                         r"of shape \[\?, 4, 6, 6\]"):
        m.run(x, np.zeros((2, 3, 6, 6), np.float32))
    with pytest.raises(ShapeError, match=r"input 0 'x': ndim is 3, expected 4 \(code -7\)\n  next: reshape it to "
                                         r"\[\?, 3, 6, 6\]"):
        m.run(x[0], z)
    with pytest.raises(ShapeError, match=r"input 0 'x': dtype is 11 \(double\), expected 1 \(float\) \(code -6\)\n"
                                         r"  next: convert it with "
                                         r"\.astype\(numpy\.float32\)"):
        m.run(x.astype(np.float64), z)
    with pytest.raises(ShapeError, match="input 1 'z' is not an array"):
        m.run(x, [[1.0], [1.0, 2.0]])
    strided = np.zeros((2, 4, 6, 12), np.float32)[..., ::2]         # a view: copied, not refused
    strided[...] = z
    np.testing.assert_array_equal(m.run(x, strided)[0], m.run(x, z)[0])
    m.close()


def test_a_closed_model_raises(lib):
    m = loader.load(lib)
    x, z = feeds(1)
    m.run(x, z)
    m.close()
    with pytest.raises(CuvilError, match="was closed.*\n  next: load it again"):
        m.run(x, z)
    with pytest.raises(CuvilError, match="was closed"):
        m.profile(x, z)
    with loader.load(lib) as m2:
        m2.run(x, z)
    with pytest.raises(CuvilError, match="was closed"):
        m2.run(x, z)


def test_a_view_is_checked_by_the_library_before_it_is_copied(lib, tmp_path):
    """Without its manifest the loader does not know which symbol an input dim is bound to, so the profile is
    checked by the library; a broadcast view whose batch (2**40) no profile admits must get that error, not
    numpy's MemoryError from copying it into a contiguous array first."""
    alone = tmp_path / "libcabi.so"
    shutil.copy(lib, alone)
    m = loader.load(str(alone))
    x = np.broadcast_to(np.float32(1), (2**40, 3, 6, 6))
    z = np.broadcast_to(np.float32(1), (2**40, 4, 6, 6))
    with pytest.raises(ShapeError, match=r"outside the model's shape profile.*N = 1099511627776"):
        m.run(x, z)
    xs, zs = feeds(2)
    np.testing.assert_array_equal(m.run(np.broadcast_to(xs[:1], xs.shape), zs)[0],
                                  m.run(np.repeat(xs[:1], 2, axis=0), zs)[0])
    m.close()


def test_a_static_model_takes_every_kind_of_array_on_the_fast_path():
    """run(*arrays) on a static model skips the general checks for exact ndarrays of the declared dtype and
    shape (and takes buffers' addresses without numpy's ctypes helper): read-only, strided and subclassed
    arrays, and a wrong dtype after fast calls, give what the full path gives."""
    art = Pipeline.from_onnx(c_abi.fixture_model()).compile(fixed={"N": 2})
    m = loader.load(art.path)
    assert m.signature._exact is not None              # every input static: the fast path is on
    x, z = feeds(2)
    want = c_abi.reference(x, z)
    np.testing.assert_allclose(m.run(x, z)[0], want, rtol=1e-4, atol=1e-4)
    ro = x.copy()
    ro.flags.writeable = False
    np.testing.assert_allclose(m.run(ro, z)[0], want, rtol=1e-4, atol=1e-4)
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    np.testing.assert_allclose(m.run(wide[..., ::2], z)[0], want, rtol=1e-4, atol=1e-4)

    class Sub(np.ndarray):
        pass
    np.testing.assert_allclose(m.run(x.view(Sub), z)[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(m.run({"x": x, "z": z})["y"], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ShapeError, match=r"input 0 'x': dtype is 11 \(double\), expected 1 \(float\)"):
        m.run(x.astype(np.float64), z)
    with pytest.raises(ShapeError, match=r"input 0 'x': dim 0 is 3, expected 2"):
        m.run(feeds(3)[0], z)
    np.testing.assert_allclose(m.run(x, z)[0], want, rtol=1e-4, atol=1e-4)
    m.close()


def test_a_symbolic_model_called_again_with_the_same_shapes_checks_the_same(lib):
    """The last accepted shapes of a model with symbols skip the full checks on the next call with the same
    ones; other shapes, a dict call and a second call after another shape still get every check."""
    m = loader.load(lib)
    for n in (2, 3, 2, 2):
        x, z = feeds(n)
        np.testing.assert_allclose(m.run(x, z)[0], c_abi.reference(x, z), rtol=1e-4, atol=1e-4)
        assert m.run(x, z)[0].shape == c_abi.reference(x, z).shape
    x, z = feeds(2)
    with pytest.raises(ShapeError, match=r"input 0 'x': dtype is 11 \(double\), expected 1 \(float\)"):
        m.run(x.astype(np.float64), z)
    with pytest.raises(ShapeError, match=r"dim 0 is N = 3, but input 0 .x. dim 0 bound N = 2"):
        m.run(x, feeds(3)[1])
    np.testing.assert_allclose(m.run({"x": x, "z": z})["y"], c_abi.reference(x, z), rtol=1e-4, atol=1e-4)
    m.close()


def test_large_outputs_reuse_only_blocks_no_array_refers_to(tmp_path):
    """Outputs of 256 KiB and more come from the model's pool: a block is handed out again only once every
    array (and view) of it is gone, so outputs the caller keeps are never overwritten."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1 << 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1 << 16])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    m = loader.load(Pipeline.from_onnx(model).compile().path)

    def run(v):
        return m.run(np.full((1, 1 << 16), v, np.float32))[0]

    def addr(a):
        return a.__array_interface__["data"][0]
    y1 = run(1.0)
    y2 = run(2.0)
    assert addr(y1) != addr(y2) and (y1 == 1).all() and (y2 == 2).all()
    a1 = addr(y1)
    del y1
    y3 = run(3.0)
    assert addr(y3) == a1 and (y2 == 2).all() and (y3 == 3).all()
    view = y2[:, ::2]
    a2 = addr(y2)
    del y2
    y4 = run(4.0)
    assert addr(y4) not in (a2, a1) and (view == 2).all() and (y3 == 3).all() and (y4 == 4).all()
    del view
    y5 = run(5.0)
    assert addr(y5) == a2 and (y3 == 3).all() and (y4 == 4).all() and (y5 == 5).all()
    m.close()
