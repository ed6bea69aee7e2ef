"""bench/run_all.py labels its report with the CPU and date and never overwrites earlier figures: a new
bench/results/YYYY-MM-DD-<cpu>.md per run, bench/RESULTS.md only with --update."""
import datetime
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run_all():
    pytest.importorskip("onnxruntime")
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(ROOT, "bench", "run_all.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dated_report_path_is_new_each_run(run_all, tmp_path):
    day = datetime.date(2026, 12, 2)
    first = run_all.dated_report_path("AMD EPYC (family 26, model 2, stepping 1)", day, str(tmp_path))
    assert first == str(tmp_path / "2026-12-02-amd-epyc-family-26-model-2-stepping-1.md")
    open(first, "w").close()
    second = run_all.dated_report_path("AMD EPYC (family 26, model 2, stepping 1)", day, str(tmp_path))
    assert second == str(tmp_path / "2026-12-02-amd-epyc-family-26-model-2-stepping-1-2.md")
    assert run_all.RESULTS_DIR == os.path.join(ROOT, "bench", "results")


def test_update_and_out_conflict(run_all, capsys):
    with pytest.raises(SystemExit) as e:
        run_all.main(["--update", "--out", "x.md", "--models", "squeezenet"])
    assert e.value.code == 2 and "give either --update or --out" in capsys.readouterr().err


def test_cpu_label_names_the_cpu(run_all):
    assert run_all.cpu_label().strip() and "this machine" not in run_all.cpu_label()


# -- the transformer section (issue 20) and the OpenVINO column -------------------------------------------------

FAST_TF = ["--section", "transformer", "--seqs", "8", "--pasts", "16", "--tf-runs", "2", "--warmup", "1",
           "--pause-ms", "0", "--threads", "1"]


def _ratio_fits(ratio, a, b):
    """``ratio`` (2 decimals) is a / b for some values that round to the 2-decimal ``a`` and ``b``."""
    return (a - 0.005) / (b + 0.005) - 0.005 <= ratio <= (a + 0.005) / max(b - 0.005, 1e-9) + 0.005


def _table_rows(text, first_cell, cells=None):
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith(f"| {first_cell} |")]
    return [r for r in rows if cells is None or len(r) == cells]


def test_transformer_section_reports_ratios(run_all, tmp_path):
    """A tiny config (one small layer) through the whole section: one library per model for its profile, a row
    per point with both engines' p50 and their ratio, and the goals with a verdict each."""
    out = tmp_path / "tf.md"
    rc = run_all.main(FAST_TF + ["--transformer-size", "tiny", "--no-openvino", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "## Transformers (issue 20)" in text and "## CNNs" not in text
    assert "one library for batch 1..8 (opt 1), sequence 1..512" in text
    assert "past_sequence 1..1023" in text
    for model, point in (("bert", "S = 8"), ("gpt2_decode", "past = 16")):
        (row,) = _table_rows(text, model, 12)
        assert row[1] == point and row[2] == "1"
        c50, o50, ratio = float(row[3]), float(row[4]), float(row[6].strip("*"))
        assert c50 > 0 and o50 > 0 and _ratio_fits(ratio, c50, o50)
        assert row[5] == "-" and row[7] == "-"                    # no OpenVINO column asked for
        assert float(row[11].split(";")[0]) <= 1e-3              # Cuvil agrees with onnxruntime
    # BERT's compute roofline: the measured peak, the point's FLOPs, and the floor they put under the ratio
    (roof,) = _table_rows(text, "S = 8", 8)
    peak = float(re.search(r"fp32 peak: ([0-9.]+) GFLOP/s per core, measured", text).group(1))
    gflop, bound, floor = float(roof[2]), float(roof[5]), float(roof[6])
    (bert,) = _table_rows(text, "bert", 12)
    assert abs(gflop - _bert_flops(run_all.transformer_section.TINY_BERT, 8) / 1e9) <= 5e-4 * gflop
    assert abs(bound - 1e3 * gflop / peak) <= 1e-3 * bound
    assert abs(floor - bound / float(bert[4])) <= 0.01 + 0.01 * floor
    for cell, ms in ((roof[3], float(bert[3])), (roof[4], float(bert[4]))):     # Cuvil's column, then onnxruntime's
        rate, pct = float(cell.split()[0]), float(cell.split("(")[1].rstrip("%)"))
        lo, hi = gflop / ((ms + 0.005) / 1e3), gflop / (max(ms - 0.005, 1e-6) / 1e3)   # ms printed to 0.01
        assert lo * 0.999 - 0.05 <= rate <= hi * 1.001 + 0.05, (cell, ms)
        assert abs(pct - 100 * rate / peak) <= 1.0
    goals = [g for g in _table_rows(text, "bert (TINY config, a test of the section: not the goal's model)")
             + _table_rows(text, "gpt2_decode (TINY config, a test of the section: not the goal's model)")]
    assert len(goals) == 2 and all(g[3] in ("MET", "NOT MET") for g in goals)


def test_transformer_section_reads_an_export(run_all, tmp_path):
    """--bert-model: a torch.onnx export (the small fixture) instead of the built model, same library profile."""
    out = tmp_path / "tf.md"
    export = os.path.join(ROOT, "tests", "fixtures", "exports", "bert.torchscript.onnx")
    rc = run_all.main(FAST_TF + ["--transformers", "bert", "--bert-model", export, "--no-openvino",
                                 "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "exported: `bert.torchscript.onnx`" in text
    assert len(_table_rows(text, "bert", 12)) == 1 and not _table_rows(text, "gpt2_decode", 12)


def test_missing_model_file_is_refused(run_all, capsys):
    with pytest.raises(SystemExit) as e:
        run_all.main(["--section", "transformer", "--bert-model", "/nonexistent/bert.onnx"])
    assert e.value.code == 2
    assert "export one with bench/models/export_transformers.py" in capsys.readouterr().err


def test_openvino_column(run_all, tmp_path):
    """With openvino importable, its float32 p50 and Cuvil/OV sit beside onnxruntime's in the same loop."""
    pytest.importorskip("openvino", reason="openvino is not installed (the bench extra brings it)")
    out = tmp_path / "tf.md"
    rc = run_all.main(FAST_TF + ["--transformer-size", "tiny", "--transformers", "gpt2_decode", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "OpenVINO" in text and "INFERENCE_PRECISION_HINT=f32" in text
    (row,) = _table_rows(text, "gpt2_decode", 12)
    c50, v50, ratio_ov = float(row[3]), float(row[5]), float(row[7])
    assert v50 > 0 and _ratio_fits(ratio_ov, c50, v50)
    assert float(row[11].split(";")[1]) <= 1e-3                  # OpenVINO agrees with onnxruntime too


def test_openvino_peer_in_the_cnn_loop(run_all, tmp_path):
    """The CNN rows come from cuvil.bench.run_benchmark; OpenVINO joins its alternating loop as a peer."""
    pytest.importorskip("openvino", reason="openvino is not installed (the bench extra brings it)")
    from cuvil.bench import BenchOptions, run_benchmark
    demo = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")
    res = run_benchmark(BenchOptions(demo, vs="onnxruntime", threads=1, runs=4, warmup=1, cold_runs=0,
                                     peers={"openvino": run_all.openvino_peer}))
    assert res["openvino"]["runs"] == 4 and res["openvino"]["p50_ms"] > 0
    assert res["peer_ratios"]["openvino"]["p50"] == pytest.approx(res["cuvil"]["p50_ms"] / res["openvino"]["p50_ms"])


def test_flops_counter_is_the_products_multiply_adds(run_all):
    """The roofline's FLOPs at a point: 2 x the multiply-adds of BERT's products (hidden h, ffn f, L layers,
    S tokens: S L (4 h^2 + 2 h f) dense, 2 L S^2 h in attention, h^2 in the pooler), counted from the graph."""
    from cuvil import Pipeline
    from cuvil.testing.hf_models import BERT_BASE, bert_model, text_feeds
    ts = run_all.transformer_section
    for cfg in (ts.TINY_BERT, BERT_BASE):
        model = bert_model(**cfg)
        at = ts._flops_counter(Pipeline.from_onnx(model))
        for s in (1, 8, 128):
            assert at(text_feeds(model, 1, s)) == _bert_flops(cfg, s)
    assert _bert_flops(BERT_BASE, 128) == 169_869_312 * 128 + 36_864 * 128 ** 2 + 1_179_648


def _bert_flops(cfg, s):
    h, f, L = cfg["hidden"], cfg["ffn"], cfg["layers"]
    return 2 * (s * L * (4 * h * h + 2 * h * f) + 2 * L * s * s * h + h * h)
