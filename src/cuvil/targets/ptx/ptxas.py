"""``ptxas``: assemble PTX for a GPU architecture and read its resource report (registers per thread,
spills, stack), so codegen is checked on machines without a GPU."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Dict, Optional, Tuple

import attrs

from ...errors import CuvilError


class PtxasError(CuvilError):
    """ptxas rejected the PTX (its message is attached)."""


@attrs.define
class KernelInfo:
    """What ``ptxas -v`` reports for one entry function."""
    name: str
    registers: Optional[int] = None
    stack_frame: int = 0       # bytes
    spill_stores: int = 0      # bytes
    spill_loads: int = 0       # bytes
    shared: int = 0            # bytes of static shared memory


def find_ptxas() -> Optional[str]:
    """ptxas on PATH, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda; None when absent."""
    found = shutil.which("ptxas")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            p = os.path.join(root, "bin", "ptxas")
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    return None


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FUNC_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_verbose(text: str) -> Dict[str, KernelInfo]:
    """Per-kernel resources from ``ptxas -v`` output (stderr or stdout)."""
    out: Dict[str, KernelInfo] = {}
    cur: Optional[KernelInfo] = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = out.setdefault(m.group(1), KernelInfo(m.group(1)))
            continue
        if cur is None:
            continue
        m = _FUNC_PROPS.search(line)
        if m:
            cur.stack_frame, cur.spill_stores, cur.spill_loads = (int(x) for x in m.groups())
        m = _USED.search(line)
        if m:
            cur.registers = int(m.group(1))
            s = _SMEM.search(line)
            if s:
                cur.shared = int(s.group(1))
    return out


def assemble(ptx: str, arch: str = "sm_90", ptxas: Optional[str] = None, opt: int = 3, jobs: int = 1,
             timeout: float = 600) -> Tuple[bytes, Dict[str, KernelInfo]]:
    """Assemble ``ptx`` into a cubin for ``arch``; returns (cubin bytes, per-kernel resources). ``jobs``
    threads optimise kernels in parallel (ptxas ``-split-compile``; 0: one per CPU)."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise CuvilError("ptxas not found: install the CUDA toolkit or put ptxas on PATH")
    with tempfile.TemporaryDirectory(prefix="cuvil_ptxas_") as d:
        src, dst = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [exe, f"-arch={arch}", f"-O{opt}", "-v", src, "-o", dst]
        if jobs != 1:
            cmd.insert(1, f"-split-compile={max(int(jobs), 0)}")
        r = subprocess.run(cmd,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise PtxasError(f"ptxas -arch={arch} failed ({r.returncode}):\n{r.stderr.strip()[-4000:]}")
        with open(dst, "rb") as f:
            cubin = f.read()
    return cubin, parse_verbose(r.stdout + "\n" + r.stderr)
