"""DFT, STFT and the window ops (ir/ops/spectral.py, kernels/lower/spectral.py): compiled for x86 and run
against numpy's FFT (float64) at several shapes, lengths, axes and directions; the kernels assemble for
the GPU."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.kernels.schedule import schedule
from cuvil.onnx_backend import prepare
from cuvil.targets.ptx import assemble, find_libdevice, find_ptxas, generate_ptx


def _dft_model(shape, axis, dft_length=None, inverse=0, onesided=0, opset=20):
    inits = [numpy_helper.from_array(np.array(axis, np.int64), "axis")]
    ins = ["x", "", "axis"]
    if dft_length is not None:
        inits.append(numpy_helper.from_array(np.array(dft_length, np.int64), "n"))
        ins[1] = "n"
    node = helper.make_node("DFT", ins, ["y"], inverse=inverse, onesided=onesided)
    g = helper.make_graph([node], "dft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _complex(a):
    return a[..., 0] + 1j * a[..., 1] if a.shape[-1] == 2 else a[..., 0]


def _check(got, want_complex, real_out=False):
    want = want_complex[..., None] if real_out else np.stack([want_complex.real, want_complex.imag], -1)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("shape,axis", [((2, 12, 1), 1), ((3, 7, 2), 1), ((2, 5, 9, 1), 2), ((4, 6, 3, 2), -3)])
@pytest.mark.parametrize("dft_length", [None, 5, 16])
def test_forward_dft_matches_numpy(shape, axis, dft_length):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    (y,) = prepare(_dft_model(shape, axis, dft_length), opt_level=1).run([x])
    ax = axis % len(shape)
    _check(y, np.fft.fft(_complex(x.astype(np.float64)), n=dft_length, axis=ax))


@pytest.mark.parametrize("n", [None, 8, 11])
def test_rfft_and_inverse_match_numpy(n):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 10, 1)).astype(np.float32)
    (y,) = prepare(_dft_model(x.shape, 1, n, onesided=1), opt_level=1).run([x])
    _check(y, np.fft.rfft(x[..., 0].astype(np.float64), n=n, axis=1))
    z = rng.standard_normal((3, 10, 2)).astype(np.float32)
    (w,) = prepare(_dft_model(z.shape, 1, n, inverse=1), opt_level=1).run([z])
    _check(w, np.fft.ifft(_complex(z.astype(np.float64)), n=n, axis=1))
    # irfft: one-sided spectrum in, real signal out (default length 2 * (L - 1), odd lengths too)
    (r,) = prepare(_dft_model(z.shape, 1, n, inverse=1, onesided=1), opt_level=1).run([z])
    _check(r, np.fft.irfft(_complex(z.astype(np.float64)), n=n, axis=1), real_out=True)


def test_opset19_axis_attribute_defaults_to_one():
    node = helper.make_node("DFT", ["x"], ["y"])
    g = helper.make_graph([node], "dft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 3, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    x = np.random.default_rng(2).standard_normal((2, 6, 3, 1)).astype(np.float32)
    (y,) = prepare(m, opt_level=1).run([x])
    _check(y, np.fft.fft(x[..., 0].astype(np.float64), axis=1))


@pytest.mark.parametrize("with_window", [False, True])
def test_stft_matches_framed_numpy_fft(with_window):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 50, 1)).astype(np.float32)
    step, flen = 6, 12
    win = np.hanning(flen).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(step, np.int64), "step")]
    if with_window:
        inits.append(numpy_helper.from_array(win, "w"))
        ins = ["x", "step", "w"]
    else:
        inits.append(numpy_helper.from_array(np.array(flen, np.int64), "flen"))
        ins = ["x", "step", "", "flen"]
    g = helper.make_graph([helper.make_node("STFT", ins, ["y"])], "stft",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 50, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    (y,) = prepare(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), opt_level=1).run([x])
    frames = np.stack([x[:, t * step:t * step + flen, 0] for t in range((50 - flen) // step + 1)], 1).astype(np.float64)
    if with_window:
        frames = frames * win
    _check(y, np.fft.rfft(frames, axis=-1))


@pytest.mark.parametrize("op,ref", [("HannWindow", np.hanning), ("HammingWindow", None), ("BlackmanWindow", np.blackman)])
@pytest.mark.parametrize("periodic", [1, 0])
def test_windows(op, ref, periodic):
    size = 9
    node = helper.make_node(op, ["n"], ["y"], periodic=periodic)
    g = helper.make_graph([node], "w", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(np.array(size, np.int64), "n")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    # folding disabled: the window's own kernel computes it
    art = Pipeline.from_onnx(m).compile(opt_level=1)
    y = art.run({})["y"]
    if ref is None:   # ONNX's Hamming coefficients (25/46, 21/46), not numpy's (0.54, 0.46)
        n = np.arange(size) * 2 * np.pi / (size if periodic else size - 1)
        want = 25 / 46 - 21 / 46 * np.cos(n)
    else:
        want = ref(size + 1)[:-1] if periodic else ref(size)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(find_ptxas() is None or find_libdevice() is None, reason="ptxas or libdevice not found")
def test_spectral_kernels_assemble_for_sm90():
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 1])
    inits = [numpy_helper.from_array(np.array(1, np.int64), "axis"), numpy_helper.from_array(np.array(4, np.int64), "step"),
             numpy_helper.from_array(np.array(8, np.int64), "size")]
    nodes = [helper.make_node("DFT", ["x", "", "axis"], ["f"], onesided=1),
             helper.make_node("DFT", ["f", "", "axis"], ["r"], inverse=1, onesided=1),
             helper.make_node("HannWindow", ["size"], ["w"]),
             helper.make_node("STFT", ["x", "step", "w"], ["s"])]
    g = helper.make_graph(nodes, "spectral", [x_info], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                         for n in ("r", "s")], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    sched = schedule(Pipeline.from_onnx(m).graph)
    ptx, descs = generate_ptx(sched, "sm_90")
    _, info = assemble(ptx, "sm_90")
    assert set(info) == {d.name for d in descs}
