"""The x86 max pool row kernel (targets/x86/depthwise.py, a "max" window) keeps the reference's NaN rule: a NaN is
skipped, a window of NaN only gives NaN, the padding counts as -inf. Its accumulator starts at -inf and takes a
value only where it is greater (one vmaxps a tap), and a mask of the lanes that saw a number restores NaN at the
end; checked against the rule written the other way (start at NaN, take x where x > acc or acc is NaN) on inputs
with NaN runs, infinities and all-NaN windows (the NaN's bits kept: sign and payload), strides 1 and 2, with
padding."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil import Pipeline


def reference(x, k, s, p):
    """Max over each window, NaN skipped unless the window is all NaN, padding -inf."""
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=-np.inf)
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    acc = np.full((n, c, oh, ow), np.nan, np.float32)
    for i in range(k):
        for j in range(k):
            v = xp[:, :, i:i + s * oh:s, j:j + s * ow:s]
            acc = np.where((v > acc) | np.isnan(acc), v, acc)
    return acc


@pytest.mark.parametrize("s,p", [(1, 1), (2, 1), (2, 0)])
def test_max_pool_nan_rule(s, p):
    rng = np.random.default_rng(s * 10 + p)
    x = rng.standard_normal((1, 3, 21, 37)).astype(np.float32)
    x[0, 0, 5:10, 4:12] = np.nan                 # windows of NaN only, and windows NaN in part
    x[0, 1, ::3, ::2] = np.nan
    x[0, 2, 0:3, :] = np.nan                     # NaN beside the padding: the padding's -inf wins
    x[0, 2, 10, 10], x[0, 2, 12, 30] = np.inf, -np.inf
    x.view(np.uint32)[0, 1, 12:17, 20:27] = 0xFFC00000        # x86's own NaN (negative), and a NaN with a payload:
    x.view(np.uint32)[0, 2, 14:19, 4:11] = 0x7FC00123          # an all-NaN window keeps its NaN's bits
    g = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[s, s],
                                            pads=[p] * 4)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    art = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).optimize().compile()
    assert [st["kernel"] for st in art.manifest["steps"]] == ["maxpool"], art.manifest["steps"]
    got = art.model().run(x)[0]
    want = reference(x, 3, s, p)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32)[np.isnan(want)], want.view(np.uint32)[np.isnan(want)])
    assert np.isnan(want).any() and np.isinf(want).any()
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
