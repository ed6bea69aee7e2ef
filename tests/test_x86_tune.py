"""Compile-time tuning (``--tune``, cuvil.targets.x86.tune): a tuned build takes the fastest measured schedule
per convolution layer and still computes what onnxruntime does; choices are cached by CPU model and shape
(another CPU model misses), the second compile measures nothing, the budget bounds the measuring, and an
unwritable cache is a warning."""
import json
import os
from unittest import mock

import attrs
import numpy as np
import pytest

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError
from cuvil.targets.x86 import compile as x86_compile
from cuvil.targets.x86 import tune
from cuvil.targets.x86.cpu import host_cpu
from cuvil.targets.x86.tuning import DEFAULT_TUNING, X86Tuning, calibrated_tuning
from cuvil.testing.conv_models import winograd_conv_model
from cuvil.testing.oracles import max_rel_error, ort_session

MODEL = winograd_conv_model(16, 32, 14, 14, [1, 1, 1, 1])     # one 3x3 layer: direct tiles and Winograd 2/4


def _layer():
    (layer,) = tune.conv_layers(Pipeline.from_onnx(MODEL).optimize().graph)
    return layer


def _entry(layer, label):
    """A cache entry choosing ``label`` (a direct candidate) for ``layer``, as _measure writes them."""
    tuning = tune.candidates(layer, host_cpu().vector_bits, DEFAULT_TUNING)[label]
    return {"choice": label, "tile": list(dict(tuning.layer_tiles)[layer.gemm_key]), "seconds": {label: 1e-3},
            "default": tune.default_label(layer, host_cpu().vector_bits, DEFAULT_TUNING), "layer": layer.describe()}


def test_tuned_build_matches_onnxruntime_and_the_second_compile_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    p = Pipeline.from_onnx(MODEL).optimize()
    art = p.compile(tune=True, tune_budget=600)
    report = art.manifest["tune"]
    (row,) = report["layers"]
    layer = _layer()
    assert set(row["ms"]) == set(tune.candidates(layer, host_cpu().vector_bits, calibrated_tuning(host_cpu())))
    assert row["choice"] == min(row["ms"], key=row["ms"].get)
    assert row["default"] in row["ms"]
    assert report["threads"] == 1 and report["cpu"] == host_cpu().label()
    winograd = [r for r in art.manifest.get("rules_applied", {}) if r.startswith("winograd")]
    assert bool(winograd) == row["choice"].startswith("winograd")
    x = np.random.default_rng(1).standard_normal((1, 16, 14, 14)).astype(np.float32)
    want = ort_session(MODEL).run(None, {"x": x})[0]
    assert max_rel_error(art.model().run(x)[0], want) <= 1e-5
    # the choice is on disk: the second compile measures nothing and finds the same library
    assert len(os.listdir(tmp_path / "tune")) == 1
    with mock.patch.object(tune, "_measure", side_effect=AssertionError("measured again")):
        again = p.compile(tune=True, tune_budget=600)
    assert again.cached and again.manifest["tune"] == report
    assert "tune" not in p.compile().manifest            # an untuned build: no tune entry, its own library


def test_cache_key_names_the_cpu_model_features_threads_and_shape():
    layer, host = _layer(), host_cpu()
    key = tune.cache_key(layer, 1, 3, DEFAULT_TUNING, host)
    assert key == tune.cache_key(layer, 1, 3, DEFAULT_TUNING, host)
    assert key != tune.cache_key(layer, 1, 3, DEFAULT_TUNING, attrs.evolve(host, model=(host.model or 0) + 1))
    assert key != tune.cache_key(layer, 1, 3, DEFAULT_TUNING, attrs.evolve(host, family=(host.family or 0) + 1))
    assert key != tune.cache_key(layer, 1, 3, DEFAULT_TUNING,
                                 attrs.evolve(host, features=host.features - {sorted(host.features)[0]}))
    assert key != tune.cache_key(layer, 2, 3, DEFAULT_TUNING, host)
    assert key != tune.cache_key(layer, 1, 2, DEFAULT_TUNING, host)
    assert key != tune.cache_key(layer, 1, 3, X86Tuning(weight_cost=12.0), host)
    assert key != tune.cache_key(attrs.evolve(layer, x_shape=(1, 16, 15, 14)), 1, 3, DEFAULT_TUNING, host)


def test_a_choice_cached_on_another_cpu_model_is_not_reused(tmp_path, monkeypatch):
    g = Pipeline.from_onnx(MODEL).optimize().graph
    layer, host = _layer(), host_cpu()
    label = [c for c in tune.candidates(layer, host.vector_bits, DEFAULT_TUNING)
             if c.startswith("direct") and c != tune.default_label(layer, host.vector_bits, DEFAULT_TUNING)][0]
    entry = _entry(layer, label)
    (tmp_path / (tune.cache_key(layer, 1, 3, DEFAULT_TUNING, host) + ".json")).write_text(json.dumps(entry))
    with mock.patch.object(tune, "_measure", side_effect=AssertionError("budget 0 measures nothing")):
        hit = tune.tune_graph(g, DEFAULT_TUNING, budget=0, cache_dir=str(tmp_path))
        assert hit.tuning.layer_tiles == ((layer.gemm_key, tuple(entry["tile"])),)
        assert hit.tuning.layer_winograd == ((layer.winograd_key, 0),)       # a direct choice: no Winograd
        assert hit.report["layers"][0]["choice"] == label
        monkeypatch.setattr(tune, "host_cpu", lambda: attrs.evolve(host, model=(host.model or 0) + 1))
        miss = tune.tune_graph(g, DEFAULT_TUNING, budget=0, cache_dir=str(tmp_path))
    assert miss.tuning == DEFAULT_TUNING
    assert miss.report["layers"][0]["source"] == "cost model (budget spent)"
    # a damaged entry is a miss, not a crash
    (tmp_path / (tune.cache_key(layer, 1, 3, DEFAULT_TUNING, host) + ".json")).write_text('{"choice": "direct 6x64"}')
    monkeypatch.setattr(tune, "host_cpu", lambda: host)
    assert tune.tune_graph(g, DEFAULT_TUNING, budget=0, cache_dir=str(tmp_path)).tuning == DEFAULT_TUNING


def test_budget_bounds_the_measuring(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    p = Pipeline.from_onnx(MODEL).optimize()
    with mock.patch.object(tune, "_build", side_effect=AssertionError("built a candidate")):
        art = p.compile(cache=False, tune=True, tune_budget=0)
    (row,) = art.manifest["tune"]["layers"]
    assert row["source"] == "cost model (budget spent)"
    assert row["choice"] == tune.default_label(_layer(), host_cpu().vector_bits, calibrated_tuning(host_cpu()))
    # a budget spent between two candidates: the layer is left to the cost model, not half-measured
    clock = iter([0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    monkeypatch.setattr(tune, "_clock", lambda: next(clock))
    with mock.patch.object(tune, "_build", return_value={"winograd": []}) as build, \
            mock.patch.object(tune, "time_libraries", side_effect=AssertionError("timed")):
        r = tune.tune_graph(p.graph, DEFAULT_TUNING, budget=1.0, cache_dir=str(tmp_path / "t"),
                            choose=lambda g, cpu, tuning: g)
    assert build.call_count == 1
    assert r.tuning == DEFAULT_TUNING and r.report["layers"][0]["source"] == "cost model (budget spent)"


def test_unwritable_cache_is_a_warning_not_a_crash(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    layer = _layer()
    entry = _entry(layer, next(label for label in tune.candidates(layer, host_cpu().vector_bits, DEFAULT_TUNING)
                               if label.startswith("direct")))
    g = Pipeline.from_onnx(MODEL).optimize().graph
    with mock.patch.object(tune, "_measure", return_value=entry), \
            pytest.warns(RuntimeWarning, match="cannot write the tuning cache .*CUVIL_CACHE_DIR"):
        r = tune.tune_graph(g, DEFAULT_TUNING, cache_dir=str(tmp_path / "file" / "tune"))
    assert r.tuning.layer_tiles == ((layer.gemm_key, tuple(entry["tile"])),)


def test_measured_tile_overrides_the_cost_model_in_the_schedule():
    layer = _layer()
    forced = X86Tuning(layer_winograd=((layer.winograd_key, 0),), layer_tiles=((layer.gemm_key, (6, 64, 16)),))
    p = Pipeline.from_onnx(MODEL).optimize()

    def tiles(tuning):
        with mock.patch.object(x86_compile, "generate_object", wraps=x86_compile.generate_object) as gen:
            art = p.compile(cache=False, cpu="znver4", tuning=tuning, winograd=tuning is forced)
        sched = gen.call_args.args[0]
        return {(e.attr.mr, e.attr.cols) for st in sched.stages for e in _contractions(st.expr)}, art

    chosen, art = tiles(forced)
    assert chosen == {(6, 64)}
    assert not art.manifest.get("rules_applied")                   # layer_winograd 0: direct
    assert tiles(DEFAULT_TUNING)[0] != {(6, 64)}                   # the cost model's own tile differs
    with pytest.raises(ValueError):
        X86Tuning(layer_winograd=(((16, 32, 14, 14), 3),))


def _contractions(e):
    out, stack = [], [e]
    while stack:
        e = stack.pop()
        if e.op == "contract":
            out.append(e)
        stack.extend(e.args)
    return out


def test_tune_refuses_a_named_cpu_and_stray_flags(tmp_path, capsys):
    p = Pipeline.from_onnx(MODEL).optimize()
    with pytest.raises(CuvilError, match="--tune measures the candidate kernels on this machine"):
        p.compile(cache=False, tune=True, cpu="znver3")
    model = tmp_path / "m.onnx"
    model.write_bytes(MODEL.SerializeToString())
    assert cli_main(["compile", str(model), "-o", str(tmp_path / "libm.so"), "--tune-budget", "5"]) != 0
    assert "--tune-budget without --tune" in capsys.readouterr().err


def test_calibrated_settings_apply_to_untuned_host_builds_only(monkeypatch):
    from cuvil.targets.x86 import tuning as tuning_mod
    from cuvil.targets.x86.cpu import describe_cpu
    from cuvil.targets.x86.target import TARGET, X86Options
    host = host_cpu()
    fitted = X86Tuning(weight_cost=8.0)
    monkeypatch.setitem(tuning_mod.CALIBRATED, (host.vendor, host.family, host.model), fitted)
    assert tuning_mod.calibrated_tuning(host) is fitted
    assert tuning_mod.calibrated_tuning(attrs.evolve(host, model=(host.model or 0) + 1)) is DEFAULT_TUNING
    assert tuning_mod.calibrated_tuning(describe_cpu("znver3")) is DEFAULT_TUNING      # named: no cpuid
    g = Pipeline.from_onnx(MODEL).optimize().graph
    assert TARGET.plan(g, X86Options(), {}).options.tuning is fitted
    assert TARGET.plan(g, X86Options(cpu="znver3"), {}).options.tuning is DEFAULT_TUNING
    given = X86Tuning(weight_cost=12.0)
    assert TARGET.plan(g, X86Options(tuning=given), {}).options.tuning is given
