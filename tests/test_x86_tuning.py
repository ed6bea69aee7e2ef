"""X86Tuning (cuvil.targets.x86.tuning): the x86 settings benchmarks vary are an option of each compile, not
module state. Two compiles in one process with different tunings each get their own choices (the Winograd
choice and the register tiles), the defaults are the shipped values (process replay, tests/golden, shows
they give today's kernels), and a tuning is part of the artifact cache key."""
from unittest import mock

import pytest

from cuvil import Pipeline
from cuvil.errors import CuvilError
from cuvil.kernels.texpr import contains
from cuvil.targets.x86 import compile as x86_compile
from cuvil.targets.x86.target import TARGET, X86Options
from cuvil.targets.x86.tuning import DEFAULT_TUNING, X86Tuning
from cuvil.testing.conv_models import winograd_conv_model


def _schedule_of(p: Pipeline, **compile_kw):
    """The schedule ``p.compile(cache=False, **compile_kw)`` generates code from, and the artifact."""
    with mock.patch.object(x86_compile, "generate_object", wraps=x86_compile.generate_object) as gen:
        art = p.compile(cache=False, **compile_kw)
    return gen.call_args.args[0], art


def _contraction_tiles(sched) -> set:
    """(rows, channel lanes) of every contraction's register tile."""
    tiles = set()
    for st in sched.stages:
        stack = [st.expr]
        while stack:
            e = stack.pop()
            if e.op == "contract":
                tiles.add((e.attr.mr, e.attr.channel_lanes))
            stack.extend(a for a in e.args if contains(a, "contract"))
    return tiles


def test_defaults_are_the_shipped_values():
    # the constants this object replaced (x86/gemm.CHANNEL_TILES, kernels/contraction.CHANNEL_TILE_COST,
    # x86/choose.WEIGHT_COST); changing one changes kernels and needs `pytest --update-golden`
    assert DEFAULT_TUNING == X86Tuning(channel_tiles=((3, 7), (4, 6), (2, 7), (2, 8)), channel_tile_cost=1.10,
                                       weight_cost=16.0, winograd_tile=None)
    # None: the host microarchitecture's fitted settings (tuning.CALIBRATED), else these; a named CPU has no cpuid
    assert X86Options().tuning is None
    g = Pipeline.from_onnx(winograd_conv_model(16, 16, 8, 8, [1, 1, 1, 1])).graph
    assert TARGET.plan(g, X86Options(cpu="znver3"), {}).options.tuning is DEFAULT_TUNING


def test_weight_cost_flips_the_winograd_choice_per_compile():
    p = Pipeline.from_onnx(winograd_conv_model(64, 64, 28, 28, [1, 1, 1, 1])).optimize()
    default = p.compile(cache=False, cpu="znver3")
    heavy = p.compile(cache=False, cpu="znver3", tuning=X86Tuning(weight_cost=1000.0))
    forced = p.compile(cache=False, cpu="znver3", tuning=X86Tuning(winograd_tile=2))
    again = p.compile(cache=False, cpu="znver3")
    assert set(default.manifest["rules_applied"]) == {"winograd_f4x4_3x3"}
    assert not heavy.manifest.get("rules_applied")          # weights too dear: direct convolution
    assert set(forced.manifest["rules_applied"]) == {"winograd_f2x2_3x3"}
    assert again.manifest["rules_applied"] == default.manifest["rules_applied"]   # nothing left behind


def test_channel_tiles_are_offered_per_compile():
    # 3x3, 64 -> 128 channels on a 7x7 map (K = 576): AVX-512 takes a channel-lane tile (32 x 7)
    p = Pipeline.from_onnx(winograd_conv_model(64, 128, 7, 7, [1, 1, 1, 1])).optimize()
    on, _ = _schedule_of(p, cpu="znver4", winograd=False)
    off, _ = _schedule_of(p, cpu="znver4", winograd=False, tuning=X86Tuning(channel_tiles=()))
    assert _contraction_tiles(on) == {(32, True)}
    assert _contraction_tiles(off) == {(12, False)}


def test_position_lane_conv_tiles_can_be_forced_per_compile():
    """``conv_tiles`` (bench/conv_tiles.py): one (rows, position vectors) pair is the only position-lane tile
    offered, so each of 12 x 32, 8 x 48, 6 x 64 is taken in turn, and the numbers stay onnxruntime's."""
    import numpy as np
    from cuvil.targets.x86.gemm import tile_shapes
    from cuvil.testing.oracles import max_rel_error, ort_session
    assert tile_shapes(512) == tile_shapes(512, X86Tuning(conv_tiles=((12, 2), (8, 3), (6, 4))))
    model = winograd_conv_model(16, 64, 14, 14, [1, 1, 1, 1])
    p = Pipeline.from_onnx(model).optimize()
    x = np.random.default_rng(0).standard_normal((1, 16, 14, 14)).astype(np.float32)
    want = ort_session(model).run(None, {model.graph.input[0].name: x})[0]
    for rows, nvec in ((12, 2), (8, 3), (6, 4)):
        sched, art = _schedule_of(p, cpu="native", winograd=False,
                                  tuning=X86Tuning(conv_tiles=((rows, nvec),), channel_tiles=()))
        if art.manifest["target"]["vector_bits"] < 512:
            pytest.skip(f"this CPU has no AVX-512 ({art.manifest['target']['built_on']}): conv_tiles is AVX-512's")
        assert _contraction_tiles(sched) == {(rows, False)}
        assert max_rel_error(art.model().run(x)[0], want) <= 1e-5
    with pytest.raises(ValueError):
        X86Tuning(conv_tiles=((8, 0),))


def test_tuning_is_validated_and_keyed():
    with pytest.raises(CuvilError, match="X86Tuning"):
        X86Options(tuning={"weight_cost": 1.0})
    with pytest.raises(ValueError):
        X86Tuning(winograd_tile=3)
    with pytest.raises(ValueError):
        X86Tuning(channel_tiles=((0, 7),))
    g = Pipeline.from_onnx(winograd_conv_model(16, 16, 8, 8, [1, 1, 1, 1])).graph
    key = lambda tuning: TARGET.plan(g, X86Options(tuning=tuning), {}).key_parts     # noqa: E731
    assert key(X86Tuning()) == key(DEFAULT_TUNING)
    assert key(X86Tuning(weight_cost=12.0)) != key(DEFAULT_TUNING)
