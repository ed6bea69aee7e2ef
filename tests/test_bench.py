"""``cuvil bench``: figures, SLA verdicts and exit codes, the config format, onnxruntime comparison, .so input.

Timings are never asserted (shared machine): only that the figures exist and the verdicts follow the limits.
"""
import json
import math
import os
import shutil

import pytest

from cuvil import Pipeline
from cuvil.bench import (
    BenchOptions,
    ConfigError,
    check_slas,
    format_report,
    load_config,
    parse_duration,
    parse_yaml_subset,
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


@pytest.fixture(params=["builtin", "pyyaml"])
def parser(request, monkeypatch):
    """Config tests run with the built-in YAML subset parser and, where installed, with PyYAML."""
    import sys
    if request.param == "builtin":
        monkeypatch.setitem(sys.modules, "yaml", None)
    else:
        pytest.importorskip("yaml")
    return request.param


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
    assert r["settings"]["threads"] == 1 and r["sla_held"] is True and r["slas"] == []
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
    assert "] 100.0% 0.3/0.3 s" in capsys.readouterr().err
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


def test_unknown_keys_are_errors_naming_the_key(tmp_path, capsys, parser):
    p = write(tmp_path, "runs: 3\nslas:\n  p99_latency_ms: 5\n  p95_latency_ms: 4\n")
    assert cli_main(["bench", DEMO, "--config", p]) == 2
    err = capsys.readouterr().err
    assert f"{p}:4: unknown SLA 'p95_latency_ms'" in err
    p = write(tmp_path, "# comment\nconcurency: 2\n")
    with pytest.raises(ConfigError, match=r"sla\.yaml:2: unknown key 'concurency'"):
        load_config(p)


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    import sys
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


def test_yaml_subset_reads_the_example(tmp_path, parser):
    data, lines = parse_yaml_subset(EXAMPLE, "sla.yaml")
    assert data == {"concurrency": 2, "duration": "10s", "warmup": 20, "threads": 1,
                    "slas": {"p99_latency_ms": 50, "error_rate_pct": 0.1}}
    assert lines[("slas", "error_rate_pct")] == 8 and lines[("concurrency",)] == 2
    assert load_config(write(tmp_path, EXAMPLE)) == {
        "concurrency": 2, "duration": 10.0, "warmup": 20, "threads": 1,
        "slas": {"p99_latency_ms": 50.0, "error_rate_pct": 0.1}}


def test_yaml_subset_scalars_and_nesting():
    text = ("---\na: 1\nb: -2.5e-3\nc: true\nd: No\ne: 'it''s # not a comment'\nf: \"x\\\"y\"\ng: plain text\n"
            "h:\n    i:\n      j: 1e-6\n    k: 1_000\nl: ~\n")
    data, _ = parse_yaml_subset(text)
    assert data == {"a": 1, "b": -2.5e-3, "c": True, "d": False, "e": "it's # not a comment", "f": 'x"y',
                    "g": "plain text", "h": {"i": {"j": 1e-6}, "k": 1000}, "l": None}


@pytest.mark.parametrize("text, line, msg", [
    ("a: 1\n\tb: 2\n", 2, "tab in indentation"),
    ("a: 1\nslas:\n  - p99\n", 3, "lists are not supported"),
    ("a: [1, 2]\n", 1, "unsupported YAML"),
    ("a: &x 1\n", 1, "unsupported YAML"),
    ("a: |\n  text\n", 1, "unsupported YAML"),
    ("slas:\n    p99: 1\n  p50: 2\n", 3, "bad indentation"),
    ("a: 1\n  b: 2\n", 2, "bad indentation"),
    ("a: 1\n# c\na: 2\n", 3, "duplicate key 'a' \\(first at line 1\\)"),
    ("a: 1\nslas:\nb: 2\n", 2, "'slas' has no value"),
    ("a: 1\nslas:\n", 2, "'slas' has no value"),
    ("a: 1\njust words\n", 2, "expected 'key: value'"),
    ("a: b: c\n", 1, "a mapping cannot follow a key"),
    ("a: 'open\n", 1, "unterminated quoted string"),
    ("a: 1\n---\nb: 2\n", 2, "only one YAML document"),
])
def test_yaml_subset_errors_have_line_numbers(text, line, msg):
    with pytest.raises(ConfigError, match=rf"^cfg\.yaml:{line}: {msg}"):
        parse_yaml_subset(text, "cfg.yaml")


@pytest.mark.parametrize("text, line, msg", [
    ("runs: 3\nduration: 2s\n", 2, "give runs or duration, not both"),
    ("runs: 0\n", 1, "runs must be >= 1"),
    ("warmup: 2.5\n", 1, "warmup must be an integer"),
    ("duration: soon\n", 1, "duration: not a duration"),
    ("duration: -1\n", 1, "duration: a duration must be positive"),
    ("threads: 1\nslas:\n  p99_latency_ms: fast\n", 3, "slas.p99_latency_ms must be a number"),
    ("slas: 5\n", 1, "slas must be a mapping"),
    ("vs: tensorrt\n", 1, "vs must be onnxruntime"),
    ("opt_level: O7\n", 1, "opt level must be"),
])
def test_config_values_are_checked(tmp_path, text, line, msg, parser):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"sla\.yaml:{line}: {msg}"):
        load_config(p)


def test_builtin_parser_is_used_without_pyyaml(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=r"sla\.yaml:2: lists are not supported"):
        load_config(write(tmp_path, "runs: 1\n- 1\n"))


def test_pyyaml_and_the_subset_agree(tmp_path):
    yaml = pytest.importorskip("yaml")
    text = EXAMPLE + "vs: onnxruntime\nopt_level: O2\nx: 'a # b'\ny: -1.5\nz: yes\n"
    assert yaml.safe_load(text) == parse_yaml_subset(text)[0]
    with pytest.raises(ConfigError, match=r"sla\.yaml:2: "):
        load_config(write(tmp_path, "runs: 1\n\tb: 2\n"))


@pytest.mark.parametrize("value, secs", [("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0),
                                         (3, 3.0), (0.25, 0.25), ("1.5", 1.5), (" 2 s ", 2.0)])
def test_parse_duration(value, secs):
    assert parse_duration(value) == pytest.approx(secs)


@pytest.mark.parametrize("value", ["", "10 sec", "-1s", "0", True, "1e3s"])
def test_parse_duration_rejects(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_shipped_example_config_is_valid(parser):
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
