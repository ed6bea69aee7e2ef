"""bench/run_all.py labels its report with the CPU and date and never overwrites earlier figures: a new
bench/results/YYYY-MM-DD-<cpu>.md per run, bench/RESULTS.md only with --update."""
import datetime
import importlib.util
import os

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
