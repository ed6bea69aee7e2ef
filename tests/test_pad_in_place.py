"""Producers writing into their reader's padded buffer (cuvil.kernels.pad_in_place): a bf16 convolution whose
output only a padded copy reads stores its rows into the copy's interior, and the copy writes only the zero
border (opt-in: X86Tuning(pad_in_place=True)). The outputs must be the same bits as with the copy: 1x1 -> 3x3 and
3x3 -> 5x5 chains, odd map sizes (rows crossing vector and tile ends), channel counts off the 32-channel
tiles, batch 2 and a symbolic batch; the arena reuse between runs (a stale border would show in the second).
Skipped, with the reason printed, on CPUs without AVX512_BF16 (no bf16 kernels, nothing to write in place).
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.targets.x86.cpu import cpu_label, host_cpu
from cuvil.targets.x86.tuning import X86Tuning

HAS_BF16 = "avx512bf16" in host_cpu().features
if not HAS_BF16:
    print(f"test_pad_in_place: skipped, this CPU has no AVX512_BF16 ({cpu_label()})")
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason=f"no AVX512_BF16 on this CPU ({cpu_label()}): no bf16 "
                                                     "convolution kernels to write into a padded buffer")


def chain_model(c, h, w, batch):
    """x -> Relu(Conv1x1 c->40) -> Relu(Conv3x3 pad 1, 40->24) -> Relu(Conv5x5 pad 2, 24->40) -> Conv3x3 ->
    + Conv1x1(x): three padded readers, each of a convolution read by nothing else."""
    rng = np.random.default_rng(c + h + w)
    inits, nodes = [], []

    def conv(name, x, cin, cout, k, relu=True):
        wt = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(wt, name + "_w"),
                      numpy_helper.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), name + "_b")])
        nodes.append(helper.make_node("Conv", [x, name + "_w", name + "_b"], [name], kernel_shape=[k, k],
                                      pads=[k // 2] * 4))
        if relu:
            nodes.append(helper.make_node("Relu", [name], [name + "_r"]))
            return name + "_r"
        return name
    a = conv("a", "x", c, 40, 1)
    b = conv("b", a, 40, 24, 3)
    d = conv("d", b, 24, 40, 5)
    e = conv("e", d, 40, c, 3, relu=False)
    nodes.append(helper.make_node("Add", [e, "x"], ["y"]))
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, h, w])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def build(model, in_place, amx=True, **kw):
    """(The channel-planar kernels, whose padded copies these writes replace: on AMX the channels-last ones would
    take these windows first, with no padded copy of that kind; and without AMX bf16 Winograd would read the unpadded
    input, tests/test_x86_bf16_winograd.py.)"""
    ranges = {vi.name: (-4.0, 4.0) for vi in model.graph.input}
    return Pipeline.from_onnx(model).optimize().compile(
        precision="bf16", input_ranges=ranges, tuning=X86Tuning(pad_in_place=in_place, amx=amx, channels_last=False, bf16_winograd=False),
        **kw)


@needs_bf16
@pytest.mark.parametrize("c,h,w,batch,amx", [(16, 13, 17, 2, True), (8, 7, 7, 1, True), (32, 30, 29, "N", True),
                                             (16, 13, 17, 2, False), (8, 7, 7, 1, False)],
                         ids=["13x17-b2", "7x7", "30x29-symbolic-batch", "13x17-b2-vdpbf16ps", "7x7-vdpbf16ps"])
def test_same_bits_as_the_copy(c, h, w, batch, amx):
    """AMX tiles (where the CPU has them; else the vdpbf16ps kernels twice) and the vdpbf16ps kernels, whose
    epilogues store position vectors and (7x7) channel-lane rows."""
    model = chain_model(c, h, w, batch)
    kw = {"shape_profiles": {"N": (1, 2, 3)}} if batch == "N" else {}
    on, off = build(model, True, amx, **kw), build(model, False, amx, **kw)
    narrowed = [k for k, v in on.manifest["precision"]["nodes"].items() if v["format"] == "bf16"]
    assert len(narrowed) == 4, on.manifest["precision"]["nodes"]
    # the three convolutions before a padded reader write into its buffer; the copy is back without it
    assert len(on.manifest.get("pads_in_place", [])) == 3, on.manifest.get("pads_in_place")
    assert "pads_in_place" not in off.manifest
    safety = on.manifest["memory_safety"]      # every access of the pitched views proved, none guarded
    assert safety["kernels_proved"] == safety["kernels"] and not safety["guarded"], safety["summary"]
    lib_on, lib_off = on.model(), off.model()
    rng = np.random.default_rng(3)
    for n in ([2, 3, 1] if batch == "N" else [batch] * 2):
        x = rng.uniform(-4, 4, (n, c, h, w)).astype(np.float32)
        for threads in (1, 2):
            y_on, y_off = lib_on.run(x, num_threads=threads)[0], lib_off.run(x, num_threads=threads)[0]
            assert float(np.abs(y_off).max()) > 0
            np.testing.assert_array_equal(y_on, y_off)


def test_fp32_keeps_its_copies():
    """A float32 build has no bf16 convolution: nothing is written in place (its kernels are unchanged)."""
    model = chain_model(8, 9, 11, 1)
    art = Pipeline.from_onnx(model).optimize().compile()
    assert "pads_in_place" not in art.manifest
