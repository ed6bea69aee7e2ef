"""The session's memory in transparent huge pages (runtime.c's map_session_memory): a mapping of 4 MB or more
(arena and per-thread scratch, or a symbolic model's reserved arena) is aligned to 2 MB and advised
MADV_HUGEPAGE before it is faulted in; CUVIL_HUGE_PAGES=0 keeps 4 KB pages; the results are the same bits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline

THP = "/sys/kernel/mm/transparent_hugepage/enabled"

# a child process: the session's new mappings advised for huge pages ("hg" in smaps' VmFlags), with their
# start and size, and the output's bytes
CHILD = r"""
import json, sys, numpy as np
from cuvil.targets.x86.loader import load

def advised():
    out, cur = set(), None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            cur = (lo, hi - lo)
        elif head[0] == "VmFlags:" and "hg" in head[1:]:
            out.add(cur)
    return out

path, batch = sys.argv[1], int(sys.argv[2])
getattr(np, "_core", np.core).multiarray._set_madvise_hugepage(False)   # (numpy advises its own arrays of 4 MB+)
before = advised()
m = load(path, num_threads=2)
x = np.random.default_rng(0).standard_normal((batch, 64, 128, 128)).astype(np.float32)
y = m.run(x, num_threads=2)[0]
new = sorted(advised() - before)
print(json.dumps({"mappings": new, "sum": float(np.abs(y).sum()), "bytes": y.tobytes().hex()[:4096]}))
"""


def model(batch):
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array((rng.standard_normal((64, 64, 1, 1)) / 8).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Conv", ["r", "w"], ["c"]),
                           helper.make_node("Sigmoid", ["c"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 64, 128, 128])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def run_child(path, batch, env):
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(batch)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's transparent huge pages")
@pytest.mark.parametrize("batch", [1, "N"], ids=["static-arena", "symbolic-arena"])
def test_session_memory_in_huge_pages(batch):
    """A static model's one mapping and a symbolic model's reserved arena (batch N in 1..2: planned for 2 images
    of 4 MB each) are 2 MB-aligned, whole 2 MB pages, advised for huge pages; with CUVIL_HUGE_PAGES=0 nothing
    is advised; the outputs are the same bits either way."""
    kw = {"input_shapes": {"x": [[1, 64, 128, 128], [1, 64, 128, 128], [2, 64, 128, 128]]}} if batch == "N" else {}
    art = Pipeline.from_onnx(model(1 if batch == 1 else "N")).optimize().compile(**kw)
    assert art.manifest["arena_bytes"] >= 4 << 20, art.manifest["arena_bytes"]
    runs = 1 if batch == 1 else 2
    on = run_child(art.path, runs, {})
    off = run_child(art.path, runs, {"CUVIL_HUGE_PAGES": "0"})
    assert off["mappings"] == [], off["mappings"]
    assert on["bytes"] == off["bytes"] and on["sum"] == off["sum"] and on["sum"] > 0
    if not os.path.exists(THP):
        pytest.skip(f"no transparent huge pages on this kernel ({THP} missing): the advice is given and ignored")
    with open(THP) as f:
        enabled = f.read()
    if "[never]" in enabled:
        pytest.skip(f"transparent huge pages are off on this host ({THP}: {enabled.strip()}): the advice is "
                    "given and ignored")
    big = [(lo, size) for lo, size in on["mappings"] if size >= 4 << 20]
    assert big, on["mappings"]
    for lo, size in big:
        assert lo % (2 << 20) == 0 and size % (2 << 20) == 0, (hex(lo), size)
