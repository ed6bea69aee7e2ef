"""Reproducible builds (issue 24, docs/supply-chain.md): the same model, options, compiler and target give
byte-identical artifacts (library, header, manifest, SBOM, provenance; every file of a GPU bundle). Two builds
of each case run in subprocesses (``python -m cuvil.testing.rebuild``), in different working directories,
with different PYTHONHASHSEED values and the artifact cache off; every file they write must be the same bytes
(compared by SHA-256 for the large libraries, byte for byte for the rest).

The cases: the nine light models, a model with symbolic dims served over a shape profile (``bert_block``),
and the demo CNN as a GPU bundle (built without a GPU; ptxas, where installed, assembles its cubin).

Each build of the light models costs 8-60 s of CPU (measured: :data:`BUILD_CPU_SECONDS`), two builds of all
nine about 8 minutes of CPU: the suite, on 2 cores, builds the cheap ones (under 15 s each) and leaves the
six others to ``CUVIL_SLOW_TESTS=1`` (``CUVIL_SLOW_TESTS=1 pytest tests/test_reproducible.py`` runs all)."""
import filecmp
import os
import subprocess
import sys

import pytest

from cuvil.testing.rebuild import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: CPU seconds of one build (`python -m cuvil.testing.rebuild`, AMD EPYC family 26 model 2, 2026-12-02).
BUILD_CPU_SECONDS = {"gpu_demo": 1.1, "bert_block": 1.5, "shufflenet": 7.6, "bvlc_alexnet": 10.6, "squeezenet": 10.6,
                     "zfnet512": 17.3, "inception_v1": 21.0, "resnet50": 23.1, "inception_v2": 31.6,
                     "densenet121": 59.7, "vgg19": 43.3}
SLOW = os.environ.get("CUVIL_SLOW_TESTS") == "1"
RUN = [c for c in CASES if SLOW or BUILD_CPU_SECONDS[c] < 15]


def _tree(root):
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            out[os.path.relpath(full, root)] = full
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Both builds of every case, run side by side (two processes)."""
    runs = []
    for seed in ("1", "271828"):
        work = tmp_path_factory.mktemp(f"build-seed{seed}")
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.path.join(ROOT, "src"),
               "CUVIL_CACHE_DIR": str(work / "cache")}
        proc = subprocess.Popen([sys.executable, "-m", "cuvil.testing.rebuild", str(work / "out"), *RUN],
                                cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        runs.append((work / "out", proc))
    outs = []
    for out, proc in runs:
        log, _ = proc.communicate(timeout=3600)
        assert proc.returncode == 0, log[-4000:]
        outs.append(str(out))
    return outs


@pytest.mark.parametrize("case", CASES)
def test_two_builds_are_byte_identical(builds, case):
    """Every file's sha256 is the same (``SHA256SUMS``: the large libraries are only hashed), and so are the
    small files kept beside it (the manifest, SBOM, provenance, header; a bundle's PTX)."""
    if case not in RUN:
        pytest.skip(f"{BUILD_CPU_SECONDS[case]:.0f} s of CPU per build: CUVIL_SLOW_TESTS=1 runs it")
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
