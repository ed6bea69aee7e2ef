import json
import os

import pytest
from hypothesis import settings

from cuvil.testing.slow import SLOW_ENV, slow_tests_run

# Hypothesis profiles: the default is quick; CI (CUVIL_HYPOTHESIS_PROFILE=ci) runs a fixed seed and more.
settings.register_profile("default", max_examples=15, deadline=None)
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("CUVIL_HYPOTHESIS_PROFILE", "default"))

# What a worker of `pytest -n auto` (pytest-xdist) hands back to the controller: the conformance summary lines,
# which the worker cannot print (only the controller writes the terminal summary).
CONFORMANCE_SUMMARY = "cuvil_conformance_summary"
_SUMMARY_LINES = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite the goldens (tests/golden/expected/*, tests/golden/replay/*) from the current output")


def pytest_configure(config):
    # `pytest -n auto` (pytest-xdist) distributes module by module ('loadfile'), not test by test (xdist's
    # default, 'load'): several modules do the work of all their tests in one module-scoped fixture (the ONNX
    # conformance cases and the replay snapshots, each in its own pool of processes; compiled libraries), which
    # every worker running a test of the module would repeat.
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"
    if getattr(config.option, "dist", None) == "loadfile":
        # Costliest modules first (pytest_collection_modifyitems), in that order: xdist's own reordering would
        # put the modules with the most tests first, and left modules of few but long tests (the verdicts'
        # re-proofs, the x86 models) to the end, where one worker ran them alone while the other idled.
        config.option.loadscopereorder = False


#: Each module's CPU seconds in the gate (scripts/pytest_cpu_profile.py --costs); a module not listed counts 0.
MODULE_COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_cpu_seconds.json")


def _costliest_modules_first(items) -> None:
    try:
        with open(MODULE_COSTS, encoding="utf-8") as f:
            costs = json.load(f)
    except (OSError, ValueError):
        return
    items.sort(key=lambda it: -costs.get(it.nodeid.split("::")[0], 0.0))   # stable: a module's tests stay in order


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "dist", None) == "loadfile" or hasattr(config, "workerinput"):
        _costliest_modules_first(items)
    # The gate (`.ci/run`: the README's `pytest -q -n auto`) leaves out the tests marked slow: each costs tens of
    # seconds of CPU and repeats, on a larger model or a longer run, what a cheaper test of the gate checks (its
    # marker's reason names which). They are skipped, not deselected, so every run lists them with that reason.
    if slow_tests_run(config):
        return
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            why = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "over a minute on 2 cores")
            item.add_marker(pytest.mark.skip(reason=f"slow ({why}): {SLOW_ENV}=1 runs it"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    lines = getattr(node, "workeroutput", {}).get(CONFORMANCE_SUMMARY)
    if lines:
        node.config.stash[_SUMMARY_LINES] = lines


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_SUMMARY_LINES, None)
    if lines:
        terminalreporter.section("ONNX node conformance")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def update_golden(request):
    return request.config.getoption("--update-golden")
