"""A library's embedded weights come back in 2 MiB pages after they left the page cache: session creation
advises them MADV_HUGEPAGE before the first run faults them in (runtime.c, advise_weights). Without the advice a
page read back from disk comes in a folio of the readahead's size, mapped 4 KiB at a time (a copy of GPT-2's
decode library mapped so ran 1.08-1.42x slower at 1 thread in three A/Bs: bench/results/zen4-session34/). This
VM's proactive reclaimer (DAMON, pageout) drops what was idle for a minute: a library's weights between two
benchmarks."""
import ctypes
import json
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, COLS, LOOKUPS = 12288, 2048, 8          # a 96 MiB table; 8 rows 8 MiB apart in its middle 64 MiB are looked
#                                               up (its ends may be read ahead with the code and data beside it)

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
    env.pop("CUVIL_AUDIT_LOG", None)      # its digest reads the file before the first session (docs/c-abi.md)
    if huge_pages is not None:
        env["CUVIL_HUGE_PAGES"] = huge_pages
    out = subprocess.run([sys.executable, "-c", _CHILD, lib, table, idx], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"]
    return res


def _evict(path) -> None:
    """Drop the file's pages from the page cache (clean, and mapped by no process now); skip where the page cache
    kept them (tmpfs, a file system that ignores the advice): mincore on a fresh mapping counts them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap failed (errno {ctypes.get_errno()}): cannot tell whether the pages left")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                pytest.skip(f"mincore failed (errno {ctypes.get_errno()}): cannot tell whether the pages left")
            cached = sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    if cached > pages // 16:
        pytest.skip(f"the page cache kept {cached} of {pages} pages after POSIX_FADV_DONTNEED: no eviction to test")


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
    per_8mib = (8 << 20) // (COLS * 4)
    np.save(xs, ROWS // 6 + np.arange(LOOKUPS, dtype=np.int64) * per_8mib)

    if _child(lib, ts, xs)["pmd_kib"] == 0:      # as Artifact.save left it, written 2 MiB at a time
        pytest.skip("this file system keeps no large folios in the page cache (tmpfs, overlayfs, ...): nothing "
                    "maps the library in huge pages")
    _evict(lib)
    without = _child(lib, ts, xs, huge_pages="0")
    _evict(lib)
    advised = _child(lib, ts, xs)
    # at least half of the lookups' 2 MiB pages (a few may share one read ahead before the first fault)
    assert advised["pmd_kib"] >= LOOKUPS // 2 * 2048, (advised, without)
    assert advised["pmd_kib"] > without["pmd_kib"], (advised, without)
