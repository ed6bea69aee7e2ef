"""A library's embedded weights come back in 2 MiB pages after they left the page cache: session creation
advises them MADV_HUGEPAGE before the first run faults them in (runtime.c, advise_weights). Without the advice a
page read back from disk comes in a folio of the readahead's size, mapped 4 KiB at a time: GPT-2's decode step
ran 1.30-1.42x slower at 1 thread on such a mapping (bench/results/zen4-session34/). This VM's proactive
reclaimer (DAMON, pageout) drops what was idle for a minute: a library's weights between two benchmarks."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, COLS, LOOKUPS = 8192, 2048, 8           # a 64 MiB table; its rows 8 MiB apart are looked up

# A fresh process: loads the library, looks the rows up once, prints the library mapping's FilePmdMapped (KiB)
# and whether the rows are the table's.
_CHILD = r"""
import json, os, re, sys
import numpy as np
from cuvil.targets.x86.loader import load
path, table, idx = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3])
y = load(path, num_threads=1).run(idx)[0]
pmd, cur = 0, None
for line in open(f"/proc/{os.getpid()}/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        cur = line.split()[5] if len(line.split()) >= 6 else ""
    elif cur == os.path.realpath(path) and line.startswith("FilePmdMapped:"):
        pmd += int(line.split()[1])
print(json.dumps({"pmd_kib": pmd, "same": bool(np.array_equal(y, table[idx]))}))
"""


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def _child(lib, table, idx, huge_pages=None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUVIL_HUGE_PAGES", None)
    if huge_pages is not None:
        env["CUVIL_HUGE_PAGES"] = huge_pages
    out = subprocess.run([sys.executable, "-c", _CHILD, lib, table, idx], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"]
    return res


def _evict(path) -> None:
    """Drop the file's pages from the page cache (clean, and mapped by no process now)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache and /proc/PID/smaps")
def test_weights_read_back_from_disk_are_mapped_in_huge_pages(tmp_path):
    """Rows of an embedding table 8 MiB apart, looked up once after the library's pages were dropped: with the
    advice each lookup's fault reads its whole 2 MiB page and maps it with one entry; CUVIL_HUGE_PAGES=0 keeps
    the kernel's default (here: small folios, none mapped whole)."""
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode!r} on this kernel: no huge page is ever given")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Gather", ["t", "i"], ["y"], axis=0)], "g",
                          [helper.make_tensor_value_info("i", TensorProto.INT64, [LOOKUPS])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(table, "t")])
    lib = str(tmp_path / "libtable.so")
    Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).compile(cache=False).save(lib)
    ts, xs = str(tmp_path / "t.npy"), str(tmp_path / "i.npy")
    np.save(ts, table)
    np.save(xs, np.arange(LOOKUPS, dtype=np.int64) * (ROWS // LOOKUPS) + ROWS // LOOKUPS // 2)

    if _child(lib, ts, xs)["pmd_kib"] == 0:      # as Artifact.save left it, written 2 MiB at a time
        pytest.skip("this file system keeps no large folios in the page cache (tmpfs, overlayfs, ...): nothing "
                    "maps the library in huge pages")
    _evict(lib)
    without = _child(lib, ts, xs, huge_pages="0")
    _evict(lib)
    advised = _child(lib, ts, xs)
    # at least half of the lookups' 2 MiB pages (one before the advised range may be read ahead already)
    assert advised["pmd_kib"] >= LOOKUPS // 2 * 2048, (advised, without)
    assert advised["pmd_kib"] > without["pmd_kib"], (advised, without)
