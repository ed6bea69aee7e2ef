"""Reproducible builds (issue 24, docs/supply-chain.md): the same model, options, compiler and target give
byte-identical artifacts (library, header, manifest, SBOM, provenance; every file of a GPU bundle). Two builds
of each case run in subprocesses (``python -m cuvil.testing.rebuild``), in different working directories,
with different PYTHONHASHSEED values and the artifact cache off; every file they write must be the same bytes
(compared by SHA-256 for the large libraries, byte for byte for the rest).

The cases: the nine light models, a model with symbolic dims served over a shape profile (``bert_block``),
and the demo CNN as a GPU bundle (built without a GPU; ptxas, where installed, assembles its cubin).

Each build of the light models costs 8-60 s of CPU (measured: :data:`BUILD_CPU_SECONDS`), two builds of all
nine about 8 minutes of CPU: the gate builds four cases (a GPU bundle, a shape profile, ShuffleNet and SqueezeNet,
whose Winograd transforms and concatenations are where an unordered walk would show) and leaves the seven others
to the extended suite
(``CUVIL_SLOW_TESTS=1 pytest tests/test_reproducible.py`` runs all: :mod:`cuvil.testing.slow`)."""
import filecmp
import os
import subprocess
import sys

import pytest

from cuvil.testing.rebuild import CASES
from cuvil.testing.slow import slow_tests_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: CPU seconds of one build (`python -m cuvil.testing.rebuild`, AMD EPYC family 26 model 2, 2026-12-02).
BUILD_CPU_SECONDS = {"gpu_demo": 1.1, "bert_block": 1.5, "shufflenet": 7.6, "bvlc_alexnet": 10.6, "squeezenet": 10.6,
                     "zfnet512": 17.3, "inception_v1": 21.0, "resnet50": 23.1, "inception_v2": 31.6,
                     "densenet121": 59.7, "vgg19": 43.3}
#: The cases the gate builds; the others are marked slow.
GATE = ("gpu_demo", "bert_block", "shufflenet", "squeezenet")


def _param(case):
    if case in GATE:
        return case
    return pytest.param(case, marks=pytest.mark.slow(
        reason=f"{BUILD_CPU_SECONDS[case]:.0f} s of CPU per build, two builds; shufflenet's "
               f"and squeezenet's in the gate take the same steps"))


def _tree(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            out[os.path.relpath(full, root)] = full
    return out


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory):
    """Both builds of every case this run includes, run side by side (two processes)."""
    run = [c for c in CASES if slow_tests_run(request.config) or c in GATE]
    runs = []
    for seed in ("1", "271828"):
        work = tmp_path_factory.mktemp(f"build-seed{seed}")
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.path.join(ROOT, "src"),
               "CUVIL_CACHE_DIR": str(work / "cache")}
        proc = subprocess.Popen([sys.executable, "-m", "cuvil.testing.rebuild", str(work / "out"), *run],
                                cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs.append((work / "out", proc))
    outs = []
    for out, proc in runs:
        log, _ = proc.communicate(timeout=3600)
        assert proc.returncode == 0, log[-4000:]
        outs.append(str(out))
    return outs


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_two_builds_are_byte_identical(builds, case):
    """Every file's sha256 is the same (``SHA256SUMS``: the large libraries are only hashed), and so are the
    small files kept beside it (the manifest, SBOM, provenance, header; a bundle's PTX)."""
    a, b = (_tree(os.path.join(out, case)) for out in builds)
    assert a and sorted(a) == sorted(b)
    with open(a["SHA256SUMS"], encoding="utf-8") as f:
        names = [line.split("  ", 1)[1].strip() for line in f]
    assert any(n.endswith(".cdx.json") for n in names) and any(n.endswith(".intoto.json") for n in names)
    assert any(n.endswith((".so", "kernels.ptx")) for n in names)
    differ = [n for n in sorted(a) if not filecmp.cmp(a[n], b[n], shallow=False)]
    assert not differ, f"{case}: {differ} differ between the two builds"
    for path in a.values():                  # nothing of the build's directories inside
        with open(path, "rb") as f:
            data = f.read()
        for d in builds:
            assert os.path.dirname(d).encode() not in data, f"{path} names the build directory"
