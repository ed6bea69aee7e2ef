"""NVIDIA's libdevice (``libdevice.10.bc``): where the CUDA toolkit keeps it, and its bitcode as an LLVM module
to link into a PTX module that calls exp, log, tanh, erf, pow, ..."""
from __future__ import annotations

import os
import shutil
from typing import Dict, Optional

import llvmlite.binding as llvm

from ...errors import CuvilError

def find_libdevice() -> Optional[str]:
    """libdevice.10.bc: $CUVIL_LIBDEVICE, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda, next to
    ptxas, or in the ``nvidia-cuda-nvcc`` wheel; None when absent."""
    env = os.environ.get("CUVIL_LIBDEVICE")
    if env:
        return env if os.path.isfile(env) else None
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    ptxas = shutil.which("ptxas")
    if ptxas:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(ptxas))))
    try:
        import nvidia.cuda_nvcc as _nv  # type: ignore
        roots.extend(getattr(_nv, "__path__", []))
    except Exception:
        pass
    for root in roots:
        if root:
            p = os.path.join(root, "nvvm", "libdevice", "libdevice.10.bc")
            if os.path.isfile(p):
                return p
    # a CUDA install whose ptxas is a wrapper script: /usr/local/cuda-*/
    for base in sorted(os.listdir("/usr/local")) if os.path.isdir("/usr/local") else []:
        p = os.path.join("/usr/local", base, "nvvm", "libdevice", "libdevice.10.bc")
        if base.startswith("cuda") and os.path.isfile(p):
            return p
    return None


_LIBDEVICE_BITCODE: Dict[str, bytes] = {}


def libdevice_module(path: Optional[str], triple: str, layout: str):
    """libdevice (``path``, else :func:`find_libdevice`'s) parsed for ``triple`` and data ``layout``."""
    path = path or find_libdevice()
    if path is None or not os.path.isfile(path):
        raise CuvilError("libdevice.10.bc not found (needed for exp/log/tanh/erf/pow/... on the GPU): "
                         "install the CUDA toolkit or set CUVIL_LIBDEVICE")
    if path not in _LIBDEVICE_BITCODE:
        with open(path, "rb") as f:
            _LIBDEVICE_BITCODE[path] = f.read()
    mod = llvm.parse_bitcode(_LIBDEVICE_BITCODE[path])
    mod.triple, mod.data_layout = triple, layout
    return mod
