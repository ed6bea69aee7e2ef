"""bf16 contractions on AMX tiles (cuvil.targets.x86.amx: ``tdpbf16ps`` micro-kernels for Conv, MatMul and
Gemm nodes whose ``precision`` is "bf16", on a CPU with AMX-BF16) against numpy references, with the error
bounds of tests/test_x86_bf16.py (its module docstring): the products of bfloat16-rounded inputs are exact in
float32, only the float32 sums differ from a float64 reference over the rounded inputs.

The AVX512_BF16 kernels are tested by tests/test_x86_bf16.py (which asks for them with
``X86Tuning(amx=False)``); here the default build on an AMX host must take the tiles and record
``path: "amx_bf16"``. The convolutions here are the channel-planar ones (``X86Tuning(channels_last=False)``);
the channels-last kernels, the default on AMX, are tested by tests/test_x86_amx_nhwc.py. Skipped, with the reason printed, on CPUs without AMX-BF16 (every AMD so far).
"""
import numpy as np
import pytest
from onnx import numpy_helper

from cuvil import Pipeline
from cuvil.kernels.contraction import AMX_TILES, pack_columns_bf16, pack_weights_amx
from cuvil.targets.x86.amx import amx_formats, amx_isa_checks, has_amx, request_permission
from cuvil.targets.x86.cpu import cpu_label, describe_cpu, host_cpu
from cuvil.testing.conv_models import conv_epilogue_model
from cuvil.testing.matmul_models import constant_weight_matmul
from test_x86_bf16 import bf16, bf16_steps, check_product, conv_ref, resnet_like

HAS_AMX = has_amx(host_cpu().features)
if not HAS_AMX:
    print(f"test_x86_amx: kernel tests skipped, this CPU has no AMX-BF16 ({cpu_label()})")
needs_amx = pytest.mark.skipif(not HAS_AMX, reason=f"no AMX-BF16 on this CPU ({cpu_label()}): the AMX "
                                                   "kernels cannot run here")


def narrowed(model, ranges=None, channels_last: bool = False, **compile_kw):
    """``model`` narrowed to bf16 over ``ranges`` (default +-8 per input). ``channels_last`` False (the default
    here): the channel-planar kernels these tests are about (X86Tuning(channels_last=False); the channels-last
    ones: tests/test_x86_amx_nhwc.py)."""
    import attrs
    from cuvil.targets.x86.tuning import X86Tuning
    compile_kw["tuning"] = attrs.evolve(compile_kw.get("tuning") or X86Tuning(), channels_last=channels_last)
    if ranges is None:
        ranges = {vi.name: (-8.0, 8.0) for vi in model.graph.input}
    art = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges=ranges, **compile_kw)
    assert any(v["format"] == "bf16" for v in art.manifest["precision"]["nodes"].values())
    return art


def test_dispatch_order():
    """AMX > AVX512_BF16 > float32, from the CPU's features: a Sapphire Rapids build takes the tiles, a Cooper
    Lake build (AVX512_BF16, no AMX) vdpbf16ps, a Zen 3 build neither; a library using tiles checks AMX at
    session creation."""
    assert amx_formats(describe_cpu("sapphirerapids")) == (AMX_TILES,)
    assert amx_formats(describe_cpu("cooperlake")) == ()
    assert amx_formats(describe_cpu("znver3")) == ()
    assert amx_isa_checks("amx-bf16", {"narrow_paths": {"k": "amx_bf16"}}, None) == ["amx-tile", "amx-bf16", "avx512bf16"]
    assert amx_isa_checks("amx-bf16", {"narrow_paths": {"k": "avx512_bf16"}}) == []


def test_tile_layouts():
    """The weights' AMX layouts: A tiles (step-major: per step of 16 pairs of k, rows of channels; zero past K) and B
    panels (K padded to whole 32-k steps with zeros)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 5, 3, 3)).astype(np.float32)          # M 40 (2 panels of 32), K 45
    a = pack_weights_amx(w, 1, 32).view(np.uint16)
    assert a.shape == (1, 2, 2, 32, 16, 2)                             # K2p: 64 k = 32 pairs = 2 steps
    flat = a.transpose(0, 1, 3, 2, 4, 5).reshape(1, 2, 32, 64)         # each step's rows contiguous
    want = bf16(w.reshape(40, 45)).astype(np.float32).view(np.uint32) >> 16
    np.testing.assert_array_equal(flat[0, 0, :, :45], want[:32])
    np.testing.assert_array_equal(flat[0, 1, :8, :45], want[32:])
    assert not flat[0, :, :, 45:].any() and not flat[0, 1, 8:].any()
    p = pack_columns_bf16(rng.standard_normal((77, 70)).astype(np.float32), 64, 32)
    assert p.shape == (2, 48, 64, 2) and not p.view(np.uint16)[:, 39:].any()


@needs_amx
def test_permission_granted():
    """Linux grants this process the tile data state (what a library asks at session creation)."""
    assert request_permission()


@needs_amx
@pytest.mark.parametrize("k,m,rows", [(77, 100, 37), (64, 64, 16), (300, 33, 5), (8, 130, 1), (1000, 64, 70)],
                         ids=["odd-K-col-tail", "exact", "long-K", "K8-one-row", "K1000"])
def test_matmul(k, m, rows):
    """MatMul + bias: K not a multiple of 32 (zero pairs), row tails (a partial 16-row tile), column tails."""
    model, w, b = constant_weight_matmul(k, m)
    art = narrowed(model, shape_profiles={"N": (1, 8, 128)})
    steps = bf16_steps(art)
    assert steps and all(s["path"] == "amx_bf16" and s["kernel"] == "gemm" for s in steps), art.manifest["steps"]
    assert "amx-tile" in art.manifest["target"]["isa_features"]
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    check_product(y, x, w, k, b)


@needs_amx
@pytest.mark.parametrize("rows,k", [(37, 300), (300, 2500)], ids=["A-rounded-once", "A-past-the-budget"])
def test_matmul_fixed_rows(rows, k):
    """Fixed row counts: all of A rounded once per call into scratch (a flag per 16-row tile) where it fits
    AMX_A_BYTES, else one row tile at a time; 2 threads and 1 give the same bits."""
    model, w, b = constant_weight_matmul(k, 100, batch_dims=(rows,))
    art = narrowed(model)
    assert bf16_steps(art) and all(s["path"] == "amx_bf16" and s["kernel"] == "gemm" for s in bf16_steps(art))
    x = np.random.default_rng(8).standard_normal((rows, k)).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    check_product(y, x, w, k, b)


@needs_amx
def test_matmul_batch_dims():
    """A MatMul over [B, S, K] rows (batch dims flattened into the rows)."""
    model, w, b = constant_weight_matmul(40, 48, batch_dims=("B", "S"))
    art = narrowed(model, shape_profiles={"B": (1, 2, 4), "S": (1, 5, 16)})
    assert bf16_steps(art) and all(s["path"] == "amx_bf16" and s["kernel"] == "gemm" for s in bf16_steps(art))
    x = np.random.default_rng(2).standard_normal((3, 7, 40)).astype(np.float32)
    y = art.model().run(x)[0].astype(np.float64)
    check_product(y.reshape(21, 48), x.reshape(21, 40), w, 40, b)


CONV_CASES = [
    # x shape, w shape, attrs
    ((1, 16, 10, 10), (24, 16, 3, 3), dict(pads=[1, 1, 1, 1])),                  # panel order, M < 32, P=100
    ((1, 64, 3, 3), (70, 64, 3, 3), dict(pads=[1, 1, 1, 1])),                    # weights order, M tail
    ((2, 7, 9, 11), (13, 7, 3, 3), dict(strides=[2, 2], pads=[1, 0, 2, 1])),      # N=2, K=63 odd, odd sizes
    ((1, 12, 12, 12), (12, 4, 3, 3), dict(group=3, pads=[1, 1, 1, 1])),          # groups
    ((1, 32, 16, 16), (40, 32, 1, 1), {}),                                       # 1x1 stride 1: direct rows
    ((1, 3, 31, 31), (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3])),    # stem-like, K=147
    ((1, 160, 6, 6), (8, 160, 3, 3), dict(pads=[1, 1, 1, 1])),                   # K=1440
    ((1, 256, 14, 14), (96, 256, 1, 1), {}),                                     # 1x1, 3 weight panels; the last
    #                                                                              panel 4 positions: 2 x 1 tiles
    ((2, 48, 28, 28), (40, 48, 1, 1), {}),                                       # last panel exactly 16 positions
    ((1, 64, 28, 28), (768, 64, 1, 1), {}),                                      # M > P: weight-block order, the
    #                                                                              short last panel of each block
    ((1, 33, 17, 17), (64, 33, 3, 3), dict(pads=[1, 1, 1, 1], dilations=[2, 2])),  # dilated, 17-wide rows
    ((2, 5, 9, 9), (12, 5, 1, 1), {}),                                           # 1x1 K=5, partial panel
    # k rows packed in pairs (the koff table): contiguous panels (34-wide rows) with an odd K = 27, whose last
    # pair's odd half must read as zero; stride 3 splits panels into runs read through a stride shuffle
    ((1, 3, 34, 34), (32, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((1, 9, 40, 40), (20, 9, 3, 3), dict(strides=[3, 3])),
]


@needs_amx
@pytest.mark.parametrize("xs,ws,attrs", CONV_CASES, ids=[f"conv{i}" for i in range(len(CONV_CASES))])
def test_conv(xs, ws, attrs):
    model = conv_epilogue_model(xs, ws, epilogue=None, **attrs)
    art = narrowed(model)
    steps = bf16_steps(art)
    assert [(s["tile"], s["path"], s["kernel"]) for s in steps] == [("32x32", "amx_bf16", "gemm")], art.manifest["steps"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal(xs).astype(np.float32)
    mod = art.model()
    y = mod.run(x, num_threads=2)[0].astype(np.float64)
    np.testing.assert_array_equal(y, mod.run(x, num_threads=1)[0])
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    b = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "b"))
    st, pd, dl = attrs.get("strides", [1, 1]), attrs.get("pads", [0] * 4), attrs.get("dilations", [1, 1])
    want, mag = conv_ref(bf16(x), bf16(w), b.astype(np.float64), st, pd, dl, attrs.get("group", 1))
    exact, _ = conv_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), st, pd, dl,
                        attrs.get("group", 1))
    k = ws[1] * ws[2] * ws[3]
    bias = np.abs(b).reshape(1, -1, 1, 1) * 2.0 ** -23
    assert np.all(np.abs(y - want) <= 2 * k * 2.0 ** -24 * mag + bias), float(np.abs(y - want).max())
    assert np.all(np.abs(y - exact) <= (2.0 ** -7 + 2.0 ** -16 + k * 2.0 ** -23) * mag + bias)
    assert float(np.abs(y - exact).max()) > 1e3 * float(np.abs(y - want).max())   # bf16 rounding in effect


@needs_amx
def test_conv_fused_residual_relu_end_to_end():
    """A ResNet-like model (stem, bottleneck with projection, residual add + Relu fused into the last 1x1,
    classifier Gemm) on tiles: every narrowed Conv on amx_bf16; relative error against the float32 library
    below 1e-2 and equal to the vdpbf16ps build's within float32 summation-order noise."""
    from cuvil.targets.x86.tuning import X86Tuning
    model = resnet_like()
    x = np.random.default_rng(5).standard_normal((1, 3, 40, 40)).astype(np.float32)
    want = Pipeline.from_onnx(model).optimize().compile().model().run(x)[0]
    art = narrowed(model)
    paths = [s["path"] for s in bf16_steps(art)]
    assert len(paths) >= 5 and paths.count("amx_bf16") >= 5, art.manifest["steps"]
    got = art.model().run(x)[0]
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    other = narrowed(model, tuning=X86Tuning(amx=False)).model().run(x)[0]
    rel_vdp = float(np.abs(other - want).max() / np.abs(want).max())
    print(f"resnet-like amx_bf16 vs fp32: relative error {rel:.2e} (avx512_bf16: {rel_vdp:.2e})")
    assert 1e-5 < rel < 1e-2
    assert float(np.abs(got - other).max() / np.abs(want).max()) < 1e-4


@needs_amx
def test_library_asks_for_the_tile_state_itself(tmp_path):
    """A fresh process that never asked Linux for the tile state loads an AMX library and runs it: the session
    creation's arch_prctl(ARCH_REQ_XCOMP_PERM) makes the first tile instruction legal (without it: SIGILL)."""
    import subprocess
    import sys
    model, w, b = constant_weight_matmul(64, 64)
    art = narrowed(model, shape_profiles={"N": (1, 4, 16)})
    assert [s["path"] for s in bf16_steps(art)][:1] == ["amx_bf16"]
    x = np.random.default_rng(4).standard_normal((5, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np; from cuvil.targets.x86.loader import load; "
            f"m = load({art.path!r}); y = m.run(np.load({str(tmp_path / 'x.npy')!r}))[0]; "
            f"np.save({str(tmp_path / 'y.npy')!r}, y)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    check_product(np.load(tmp_path / "y.npy").astype(np.float64), x, w, 64, b)


def test_refused_without_amx(monkeypatch):
    """A library with AMX kernels, loaded on a CPU without AMX (or where the kernel refuses the tile state): a
    CuvilError that names the tile kernels, never SIGILL; the C side's check is in the generated source."""
    import attrs
    from cuvil.errors import CuvilError
    from cuvil.targets.x86 import cpu as cpu_mod
    from cuvil.targets.x86.loader import _check_isa
    from cuvil.targets.x86.model_c import generate_isa_c
    manifest = {"target": {"isa_features": ["avx512f", "amx-tile", "amx-bf16", "avx512bf16"], "cpu": "native"},
                "steps": [{"path": "amx_bf16"}, {"path": "amx_bf16"}]}
    real = host_cpu()
    monkeypatch.setattr(cpu_mod, "host_cpu", lambda: attrs.evolve(real, features=(real.features | {"avx512f", "avx512bf16"})
                                                                  - {"amx-tile", "amx-bf16"}))
    with pytest.raises(CuvilError) as e:
        _check_isa(manifest, "libx.so")
    text = str(e.value) + " ".join(getattr(e.value, "details", []) or [])
    assert "amx-tile" in text and "2 bf16 kernels run tdpbf16ps on AMX tiles" in text
    src = generate_isa_c("m", ["amx-tile", "amx-bf16"])
    assert '__builtin_cpu_supports("amx-tile")' in src and "syscall(158, 4131, 18)" in src



def residual_block(c, hw, k):
    """t = Relu(Conv1x1(x)); Relu(Conv_kxk(t) + t): the second convolution's epilogue reads the residual t at
    its output positions (float32, or bfloat16 with X86Tuning(bf16_residual=True))."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(c + hw + k)
    w = lambda name, *shape: numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:])))
                                                     .astype(np.float32), name)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["a"], ["t"]),
             helper.make_node("Conv", ["t", "wb", "bb"], ["y"], kernel_shape=[k, k], pads=[k // 2] * 4),
             helper.make_node("Add", ["y", "t"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"])]
    inits = [w("wa", c, c, 1, 1), w("ba", c), w("wb", c, c, k, k), w("bb", c)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@needs_amx
@pytest.mark.parametrize("c,hw,k,residual", [(64, 66, 1, False),      # P = 4356: a partial panel
                                             (32, 100, 3, False),
                                             (64, 66, 1, True)],      # the skip path stored as bfloat16
                         ids=["1x1", "3x3", "1x1-bf16-residual"])
def test_next_panel_prefetch_same_bits(c, hw, k, residual):
    """The epilogue's prefetch of the next panel's residual and output lines (X86Tuning.next_panel_prefetch) is a
    hint only: a Conv + residual Add + Relu on tiles gives the same bits with it and without it, full and
    partial panels, float32 and bfloat16 residuals; and the two libraries differ (the prefetches are there:
    the tensors streamed are over gemm.STREAM_PREFETCH_BYTES)."""
    from cuvil.targets.x86.tuning import X86Tuning
    model = residual_block(c, hw, k)
    x = np.random.default_rng(6).standard_normal((1, c, hw, hw)).astype(np.float32)
    arts = [narrowed(model, tuning=X86Tuning(next_panel_prefetch=pf, bf16_residual=residual, bf16_planes=False))
            for pf in (True, False)]      # (the packed panels' prefetch: a 3x3 reads pair planes by default)
    for art in arts:
        assert [s["path"] for s in bf16_steps(art)] == ["amx_bf16"] * 2, art.manifest["steps"]
        assert ("t" in art.manifest.get("bf16_activations", {})) == residual, art.manifest.get("bf16_activations")
    ys = [art.model().run(x, num_threads=1)[0] for art in arts]
    assert float(np.abs(ys[0]).max()) > 0
    np.testing.assert_array_equal(ys[0], ys[1])
    with open(arts[0].path, "rb") as f0, open(arts[1].path, "rb") as f1:
        assert f0.read() != f1.read()


def expansion_block(cin, cout, hw):
    """t = Relu(Conv1x1(x)) (cin -> cin, stored as bfloat16); Relu(Conv1x1(t) + skip) (cin -> cout): a ResNet-50
    expansion, whose epilogue reads a float32 residual ``skip`` at every output position."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(cin + cout + hw)
    w = lambda name, *shape: numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:])))
                                                     .astype(np.float32), name)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["a"], ["t"]),
             helper.make_node("Conv", ["t", "wb", "bb"], ["y"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["y", "skip"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"])]
    inits = [w("wa", cin, cin, 1, 1), w("ba", cin), w("wb", cout, cin, 1, 1), w("bb", cout)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw]),
                                       helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, cout, hw, hw])],
                          [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@needs_amx
@pytest.mark.parametrize("cin,cout,hw", [(64, 256, 56),      # ResNet-50's expansion: P = 3136, whole panels
                                         (48, 256, 58)],     # K = 48 (pair rows past K zero), P = 3364: a partial panel
                         ids=["resnet-56x56", "k48-partial"])
def test_channel_sweep_same_bits(cin, cout, hw):
    """A large 1x1 convolution on tiles swept per block of 32 output channels (X86Tuning.channel_sweep, every
    position panel packed first, the epilogue streaming its rows and prefetching two panels on) gives the same
    bits as in panel order, with 1 and 2 threads; and the two libraries differ (the sweep is taken: its output
    is over gemm.STREAM_PREFETCH_BYTES and its panels within gemm.SWEEP_PANEL_BYTES)."""
    from cuvil.targets.x86.tuning import X86Tuning
    model = expansion_block(cin, cout, hw)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, cin, hw, hw)).astype(np.float32)
    skip = rng.standard_normal((1, cout, hw, hw)).astype(np.float32)
    arts = [narrowed(model, tuning=X86Tuning(channel_sweep=sw)) for sw in (True, False)]
    for art in arts:
        assert [s["path"] for s in bf16_steps(art)] == ["amx_bf16"] * 2, art.manifest["steps"]
    ys = [art.model().run(x, skip, num_threads=t)[0] for art in arts for t in (1, 2)]
    assert float(np.abs(ys[0]).max()) > 0
    for y in ys[1:]:
        np.testing.assert_array_equal(ys[0], y)
    with open(arts[0].path, "rb") as f0, open(arts[1].path, "rb") as f1:
        assert f0.read() != f1.read()
