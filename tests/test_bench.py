"""``cuvil bench``: figures, SLA verdicts and exit codes, the config format, onnxruntime comparison, .so input.

Timings are never asserted (shared machine): only that the figures exist and the verdicts follow the limits.
"""
import json
import math
import os
import shutil
import sys

import pytest

from cuvil import Pipeline
from cuvil.bench import (
    BenchOptions,
    ConfigError,
    check_slas,
    format_report,
    load_config,
    parse_config_text,
    parse_duration,
    run_benchmark,
)
from cuvil.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")
FAST = ["--runs", "10", "--warmup", "1", "--cold-runs", "0"]


@pytest.fixture(scope="module")
def demo_so(tmp_path_factory):
    art = Pipeline.from_onnx(DEMO).optimize().compile(opt_level=3)
    return art.save(tmp_path_factory.mktemp("lib") / "libdemo.so")


def write(tmp_path, text, name="sla.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_json_has_every_figure(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli_main(["bench", DEMO, "--runs", "15", "--warmup", "2", "--cold-runs", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for label in ("p50 latency", "p90 latency", "p99 latency", "max latency", "throughput", "error rate",
                  "cold start", "peak RSS", "bytes"):
        assert label in text
    r = json.loads(out.read_text())
    c = r["cuvil"]
    for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "throughput_ips", "error_rate_pct", "cold_start_ms",
                "peak_rss_mb", "runs", "errors"):
        assert isinstance(c[key], (int, float)) and not math.isnan(c[key]), key
    assert c["runs"] == 15 and c["errors"] == 0 and c["error_rate_pct"] == 0
    assert c["p50_ms"] <= c["p90_ms"] <= c["p99_ms"] <= c["max_ms"]
    assert c["cold_start_ms"] > 0 and c["peak_rss_mb"] > 0 and r["baseline_rss_mb"] > 0
    assert r["artifact_bytes"] == os.path.getsize(r["library"]) > 0
    assert len(r["latencies_ms"]["cuvil"]) == 15
    # --threads defaults to 0 = all cores, as in cuvil run and cuvil verify
    assert r["settings"]["threads"] == len(os.sched_getaffinity(0)) and r["sla_held"] is True and r["slas"] == []
    assert r["inputs"] == [{"name": "image", "dtype": "float32", "shape": [1, 3, 16, 16]}]
    assert r["compiled"]["specialized"] == {"N": 1} and r["compiled"]["flops"] > 0


def test_sla_held_exits_0_and_broken_exits_1(tmp_path, capsys):
    ok = write(tmp_path, "concurrency: 2\nruns: 12\nwarmup: 1\nthreads: 1\nslas:\n  p99_latency_ms: 10000\n"
                         "  error_rate_pct: 0.1\n", "ok.yaml")
    assert cli_main(["bench", DEMO, "--config", ok, "--cold-runs", "0"]) == 0
    out = capsys.readouterr().out
    assert "SLA p99_latency_ms <= 10000" in out and "SLA held" in out and "concurrency 2" in out
    bad = write(tmp_path, "runs: 5\nwarmup: 1\nslas:\n  p99_latency_ms: 0.000001\n", "bad.yaml")
    assert cli_main(["bench", DEMO, "--config", bad, "--cold-runs", "0"]) == 1
    assert "NOT HELD" in capsys.readouterr().out
    # a flag overrides the config; --sla adds a limit
    assert cli_main(["bench", DEMO, "--config", ok, "--runs", "3", "--cold-runs", "0", "--concurrency", "1",
                     "--sla", "min_throughput_ips=1e12"]) == 1
    out = capsys.readouterr().out
    assert "3 timed runs" in out and "concurrency 1" in out and "min_throughput_ips >= 1e+12" in out


def test_duration_and_concurrency(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["bench", DEMO, "--duration", "300ms", "--concurrency", "2", "--warmup", "1",
                     "--cold-runs", "0", "--json", str(out), "--progress"]) == 0
    assert "timing: cuvil, 300/300 ms in " in capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["settings"]["duration_s"] == pytest.approx(0.3) and r["settings"]["runs"] is None
    assert r["cuvil"]["runs"] >= 2 and r["cuvil"]["throughput_ips"] > 0


def test_vs_onnxruntime_prints_ratios(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["bench", DEMO, "--vs", "onnxruntime", "--runs", "8", "--warmup", "1", "--cold-runs", "1",
                     "--json", str(out), "--sla", "p50_ratio=1000"]) == 0
    text = capsys.readouterr().out
    assert "onnxruntime" in text and "ratio" in text and "outputs agree with onnxruntime" in text
    r = json.loads(out.read_text())
    for k in ("p50", "p99", "cold_start", "peak_rss"):
        assert r["ratios"][k] > 0, k
    assert r["onnxruntime"]["runs"] == 8 and r["onnxruntime"]["cold_start_ms"] > 0
    assert r["agreement"]["agree"] and r["agreement"]["max_rel_err"] <= 1e-4


def test_disagreeing_outputs_count_as_errors():
    r = run_benchmark(BenchOptions(DEMO, vs="onnxruntime", runs=4, warmup=0, cold_runs=0, rtol=-1.0))
    assert r["agreement"]["agree"] is False
    assert r["cuvil"]["runs"] == 4 and r["cuvil"]["error_rate_pct"] == 100.0
    assert r["onnxruntime"]["error_rate_pct"] == 0.0
    assert check_slas(r, {"error_rate_pct": 0.1})[0]["held"] is False
    assert "DISAGREE" in format_report(r)


def test_so_input(demo_so, tmp_path, capsys):
    assert cli_main(["bench", demo_so, *FAST]) == 0
    assert "libdemo.so" in capsys.readouterr().out
    assert cli_main(["bench", demo_so, "--vs", "onnxruntime", *FAST]) == 2
    assert "--onnx MODEL.onnx" in capsys.readouterr().err
    assert cli_main(["bench", demo_so, "--vs", "onnxruntime", "--onnx", DEMO, *FAST]) == 0
    assert "outputs agree" in capsys.readouterr().out


def test_missing_file_and_usage_errors(tmp_path, capsys):
    assert cli_main(["bench", str(tmp_path / "nope.onnx"), *FAST]) == 2
    assert "nope.onnx: no such file" in capsys.readouterr().err
    assert cli_main(["bench", DEMO, "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: cannot read the config" in capsys.readouterr().err
    assert cli_main(["bench", DEMO, "--runs", "3", "--duration", "1s"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli_main(["bench", DEMO, *FAST, "--sla", "p99_ratio=1"]) == 2
    assert "--vs onnxruntime" in capsys.readouterr().err
    assert cli_main(["bench", DEMO, *FAST, "--shape", "M=3"]) == 2
    assert "no symbol 'M'" in capsys.readouterr().err


def test_unknown_keys_are_errors_naming_the_key(tmp_path, capsys):
    p = write(tmp_path, "runs: 3\nslas:\n  p99_latency_ms: 5\n  p95_latency_ms: 4\n")
    assert cli_main(["bench", DEMO, "--config", p]) == 2
    err = capsys.readouterr().err
    assert f"{p}:4: unknown SLA 'p95_latency_ms'" in err
    p = write(tmp_path, "# comment\nconcurency: 2\n")
    with pytest.raises(ConfigError, match=r"sla\.yaml:2: unknown key 'concurency'"):
        load_config(p)


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_main(["bench", DEMO, *FAST, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# -- the config format --------------------------------------------------------------------------------

EXAMPLE = """\
# an SLA
concurrency: 2
duration: 10s      # or a number of seconds
warmup: 20         # runs
threads: 1
slas:
  p99_latency_ms: 50
  error_rate_pct: 0.1
"""


def test_config_reads_the_example(tmp_path):
    data, lines = parse_config_text(EXAMPLE, "sla.yaml")
    assert data == {"concurrency": 2, "duration": "10s", "warmup": 20, "threads": 1,
                    "slas": {"p99_latency_ms": 50, "error_rate_pct": 0.1}}
    assert lines[("slas", "error_rate_pct")] == 8 and lines[("concurrency",)] == 2
    assert load_config(write(tmp_path, EXAMPLE)) == {
        "concurrency": 2, "duration": 10.0, "warmup": 20, "threads": 1,
        "slas": {"p99_latency_ms": 50.0, "error_rate_pct": 0.1}}


@pytest.mark.parametrize("text, line, msg", [
    ("a: 1\n\tb: 2\n", 2, "found character '.*' that cannot start any token"),
    ("slas:\n    p99: 1\n  p50: 2\n", 3, "expected <block end>.*while parsing a block mapping at line 1"),
    ("a: 1\n  b: 2\n", 2, "mapping values are not allowed here"),
    ("a: 1\n# c\na: 2\n", 3, "duplicate key 'a' \\(first at line 1\\)"),
    ("slas:\n  p99_latency_ms: 1\n  p99_latency_ms: 2\n", 3, "duplicate key 'slas.p99_latency_ms' \\(first at line 2\\)"),
    ("a: 1\njust words\n", 3, "could not find expected ':' \\(while scanning a simple key at line 2\\)"),
    ("a: 'open\n", 2, "found unexpected end of stream \\(while scanning a quoted scalar at line 1\\)"),
    ("a: 1\n---\nb: 2\n", 2, "but found another document"),
    ("a: !!python/object/apply:os.system ['true']\n", 1, "could not determine a constructor"),
    ("a: 1\nb: \x07\n", 2, "unacceptable character #x0007"),
    ("[" * 5000 + "]" * 5000, 1, "the config is nested too deeply"),
])
def test_yaml_errors_have_line_numbers(text, line, msg):
    with pytest.raises(ConfigError, match=rf"^cfg\.yaml:{line}: {msg}"):
        parse_config_text(text, "cfg.yaml")


@pytest.mark.parametrize("text, line, msg", [
    ("runs: 3\nduration: 2s\n", 2, "give runs or duration, not both"),
    ("runs: 0\n", 1, "runs must be >= 1"),
    ("warmup: 2.5\n", 1, "warmup must be an integer"),
    ("duration: soon\n", 1, "duration: not a duration"),
    ("duration: -1\n", 1, "duration: a duration must be positive"),
    ("threads: 1\nslas:\n  p99_latency_ms: fast\n", 3, "slas.p99_latency_ms must be a number"),
    ("slas: 5\n", 1, "slas must be a mapping"),
    ("runs: 1\nslas:\n  - p99_latency_ms\n", 2, "slas must be a mapping"),
    ("runs: [1, 2]\n", 1, "runs must be an integer"),
    ("- runs: 1\n", 1, "the config must be a mapping"),
    ("runs: 1\n3: 4\n", 2, "unknown key 3"),
    ("vs: tensorrt\n", 1, "vs must be onnxruntime"),
    ("opt_level: O7\n", 1, "opt level must be"),
])
def test_config_values_are_checked(tmp_path, text, line, msg):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"sla\.yaml:{line}: {msg}"):
        load_config(p)


def test_anchors_and_aliases_are_plain_yaml(tmp_path):
    text = "slas: &limits\n  p99_latency_ms: 50\nruns: 3\nvs: onnxruntime\n"
    assert load_config(write(tmp_path, text))["slas"] == {"p99_latency_ms": 50.0}
    _, lines = parse_config_text("a: &m {p: 1}\nb: *m\n")
    assert lines[("b", "p")] == 1      # an aliased key is reported where it is written


def test_sla_limits_in_exponent_notation_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads 1e-6, without a dot, as a string; a limit is still the number it spells."""
    assert load_config(write(tmp_path, "slas:\n  p99_latency_ms: 1e-6\n  p50_ratio: 2.5e+1\n"))["slas"] == {
        "p99_latency_ms": 1e-6, "p50_ratio": 25.0}


@pytest.mark.parametrize("value, secs", [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0),
                                         (3, 3.0), (0.25, 0.25), ("1.5", 1.5), (" 2 s ", 2.0)])
def test_parse_duration(value, secs):
    assert parse_duration(value) == pytest.approx(secs)


@pytest.mark.parametrize("value", ["", "10 sec", "-1s", "0", True, "1e3s"])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_shipped_example_config_is_valid():
    cfg = load_config(os.path.join(ROOT, "bench", "sla.yaml"))
    assert cfg["slas"] == {"p99_latency_ms": 50.0, "error_rate_pct": 0.1} and cfg["duration"] == 10.0


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_jitter_floor_program_reports_ordered_percentiles(tmp_path):
    """bench/jitter_floor.c (the machine-floor column of bench/run_all.py) builds and reports its percentiles
    as JSON, for 1 and 2 threads, with and without a streamed buffer. No timing is asserted: only that the
    report is complete and ordered."""
    import subprocess
    src = os.path.join(ROOT, "bench", "jitter_floor.c")
    exe = str(tmp_path / "jitter_floor")
    subprocess.run(["cc", "-O2", "-pthread", src, "-o", exe], check=True)
    for threads, stream in ((1, 0), (2, 1)):
        out = subprocess.run([exe, "0.5", str(stream), str(threads), "7", "1"], check=True, capture_output=True,
                             text=True).stdout
        r = json.loads(out)
        assert r["threads"] == threads and r["runs"] == 7 and r["stream_mb"] == stream
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["p99_over_p50"] == pytest.approx(r["p99_ms"] / r["p50_ms"], rel=1e-2)
    assert subprocess.run([exe, "1"], capture_output=True).returncode == 2
