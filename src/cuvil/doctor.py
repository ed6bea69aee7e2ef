"""``cuvil doctor``: what Cuvil finds on this machine, the first thing to paste into a bug report.

:func:`collect` gathers it as a JSON-ready dict (the CPU and the ISA features and vector width Cuvil's kernels
will use, the LLVM that generates them, Python and the packages Cuvil depends on, the CUDA tools and GPU if
any, the optional extras installed, the cache directory); :func:`report_text` writes it for a person. Nothing
here fails for a missing optional part: an absent GPU, ptxas or extra is reported as absent.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import llvmlite
import llvmlite.binding as llvm

from .artifact import artifact_cache_dir
from .targets.ptx.libdevice import find_libdevice
from .targets.ptx.ptxas import find_ptxas
from .targets.x86.cpu import host_cpu
from .version import __version__

#: Distributions Cuvil needs (install_requires), reported with their versions.
REQUIRED = ("numpy", "onnx", "ml_dtypes", "llvmlite", "z3-solver", "lark", "attrs", "hypothesis", "PyYAML")
#: Optional distributions (extras and oracles): their versions, or None when absent.
OPTIONAL = ("onnxruntime", "onnxruntime-gpu", "torch", "cuda-python", "matplotlib", "tqdm")
#: The features shown first in the text report: the ones that shape Cuvil's kernels (vector width, FMA,
#: half/bfloat16 conversions, AMX tiles); the JSON lists every feature.
KEY_FEATURES = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16", "avx512fp16", "avx512vnni", "avx2",
                "fma", "f16c", "bmi2", "amx-tile", "amx-bf16", "amx-fp16", "amx-int8")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ptxas_info() -> dict:
    path = find_ptxas()
    if path is None:
        return {"path": None, "version": None}
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        version = lines[-2] if len(lines) >= 2 and "release" in lines[-2] else (lines[-1] if lines else None)
    except (OSError, subprocess.SubprocessError) as e:
        version = f"cannot run: {e}"
    return {"path": path, "version": version}


def _cc_info() -> dict:
    """The C compiler that links x86 libraries (``cc``): its path and first ``--version`` line."""
    path = shutil.which("cc")
    if path is None:
        return {"path": None, "version": None}
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout.strip().splitlines() or [None])[0]
    except (OSError, subprocess.SubprocessError) as e:
        version = f"cannot run: {e}"
    return {"path": path, "version": version}


def _gpu_info() -> dict:
    """The first GPU and the driver's CUDA version through cuda-python, or why there is none."""
    if _version("cuda-python") is None and _version("cuda-bindings") is None:
        return {"available": False, "reason": "cuda-python is not installed: pip install 'cuvil[gpu]'"}
    from .targets.ptx.runtime import device_info    # imports cuda-python only when it is installed
    try:
        return {"available": True, **device_info(0)}
    except Exception as e:      # a diagnostic: any failure of the driver is what the report must show
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}


def collect() -> dict:
    """Everything :func:`report_text` shows, as a JSON-ready dict."""
    cpu = host_cpu()
    return {
        "cuvil": __version__,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": {"model_name": cpu.model_name, "vendor": cpu.vendor, "family": cpu.family, "model": cpu.model,
                "stepping": cpu.stepping, "cores": os.cpu_count(), "llvm_name": cpu.llvm_name,
                "vector_bits": cpu.vector_bits, "isa_features": sorted(cpu.features), "notes": list(cpu.notes)},
        "llvm": {"llvmlite": llvmlite.__version__, "llvm": ".".join(map(str, llvm.llvm_version_info))},
        "cc": _cc_info(),
        "packages": {d: _version(d) for d in REQUIRED},
        "optional": {d: _version(d) for d in OPTIONAL},
        "cuda": {"ptxas": _ptxas_info(), "libdevice": find_libdevice()},
        "gpu": _gpu_info(),
        "cache_dir": os.path.dirname(artifact_cache_dir()),
    }


def _wrap(words: List[str], width: int = 96, indent: str = "    ") -> List[str]:
    lines, cur = [], indent
    for w in words:
        if len(cur) + len(w) + 1 > width and cur.strip():
            lines.append(cur.rstrip())
            cur = indent
        cur += w + " "
    if cur.strip():
        lines.append(cur.rstrip())
    return lines


def report_text(info: Dict) -> str:
    """``info`` (from :func:`collect`) as the lines ``cuvil doctor`` prints."""
    cpu, cuda, gpu = info["cpu"], info["cuda"], info["gpu"]
    ident = ", ".join(f"{k} {cpu[k]}" for k in ("family", "model", "stepping") if cpu[k] is not None)
    width = {512: "512-bit (AVX-512)", 256: "256-bit (AVX2 + FMA)"}.get(cpu["vector_bits"], "128-bit (SSE)")
    feats = set(cpu["isa_features"])
    key = [f for f in KEY_FEATURES if f in feats]
    lines = [
        f"cuvil {info['cuvil']} on {info['platform']}, Python {info['python']}",
        f"CPU:        {cpu['model_name'] or 'unknown'} ({cpu['vendor'] or 'unknown vendor'}"
        + (f"; {ident}" if ident else "") + f"), {cpu['cores']} logical cores",
        f"kernels:    {width} vectors; LLVM tunes for '{cpu['llvm_name']}'",
        f"ISA used:   {' '.join(key) or 'none of ' + ', '.join(KEY_FEATURES[:3])}",
        f"  all {len(feats)} features Cuvil may use (libraries built here require them):",
        *_wrap(sorted(feats)),
        *[f"  note: {n}" for n in cpu["notes"]],
        f"LLVM:       {info['llvm']['llvm']} (llvmlite {info['llvm']['llvmlite']})",
        f"cc:         {info['cc']['path'] or 'not found (x86 libraries are linked with cc: install gcc or clang)'}"
        + (f" ({info['cc']['version']})" if info["cc"]["version"] else ""),
        "packages:   " + ", ".join(f"{d} {v or 'MISSING'}" for d, v in info["packages"].items()),
        "optional:   " + ", ".join(f"{d} {v or '-'}" for d, v in info["optional"].items()),
        f"ptxas:      {cuda['ptxas']['path'] or 'not found (GPU bundles are emitted as PTX only)'}"
        + (f" ({cuda['ptxas']['version']})" if cuda["ptxas"]["version"] else ""),
        f"libdevice:  {cuda['libdevice'] or 'not found (GPU exp/log/tanh/erf need it; set CUVIL_LIBDEVICE)'}",
        (f"GPU:        {gpu['name']} ({gpu['arch']}, {gpu['memory_bytes'] / 2**30:.1f} GiB), "
         f"driver CUDA {gpu['driver_cuda_version']}") if gpu.get("available")
        else f"GPU:        none ({gpu['reason']})",
        f"cache:      {info['cache_dir']} (CUVIL_CACHE_DIR)",
    ]
    return "\n".join(lines)
