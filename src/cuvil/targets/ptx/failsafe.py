"""The GPU fail-safe (issue 22, part 5): ``cuvil.load(bundle, fallback="libNAME.so")`` returns a
:class:`FailSafeModel` that runs the bundle on the GPU and, where the GPU is missing, out of memory or
faults, runs the x86 library instead, with a ``RuntimeWarning`` and a counter in :meth:`FailSafeModel.stats`.

* GPU missing (no cuda-python, driver or device: :class:`~cuvil.targets.ptx.runtime.NoGpuError`) or a
  driver error while loading (out of memory for the weights, a module the driver refuses): every call runs
  the fallback (``stats()["fallbacks"]["load"]``).
* Out of memory during a call (``CUDA_ERROR_OUT_OF_MEMORY``, e.g. capturing a graph): that call runs the
  fallback, the GPU model stays for the next ones.
* Any other driver error during a call (an illegal address, a launch failure: the context is then unusable):
  that call and every later one run the fallback; the GPU model is closed.

The fallback is the same model compiled for x86 with the same profile (``cuvil compile MODEL -o
libNAME.so`` with the bundle's shape flags); it is loaded up front, so a bad fallback fails at load. The
faults are tested by injecting them (:func:`cuvil.targets.ptx.runtime.inject_fault`, or the
``CUVIL_GPU_FAULT`` environment variable on a GPU machine).
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Dict, List, Optional

import numpy as np

from ...errors import CuvilError
from ..model_api import Model
from .runtime import CudaError, NoGpuError

#: Run-time errors after which the GPU model stays in use (the call alone runs the fallback).
TRANSIENT = frozenset({"CUDA_ERROR_OUT_OF_MEMORY"})


class FailSafeModel(Model):
    """A GPU model with an x86 fallback (see the module docstring). ``gpu``: the GPU model, or None once it
    is not used; ``fallback``: the x86 model; ``stats()``: the GPU model's stats plus ``fallbacks``."""

    def __init__(self, path: str, load_gpu: Callable[[], Model], load_fallback: Callable[[], Model],
                 fallback_path: str = "the fallback"):
        self.path, self.fallback_path = path, fallback_path
        self.fallback = load_fallback()
        self._lock = threading.Lock()
        self.fallbacks: Dict[str, object] = {"load": 0, "run": 0, "calls": 0, "errors": {}}
        self.gpu: Optional[Model] = None
        try:
            self.gpu = load_gpu()
        except (NoGpuError, CudaError) as e:
            self._count("load", e)
            warnings.warn(f"{path}: {e}; running the x86 artifact {fallback_path} instead", RuntimeWarning,
                          stacklevel=3)
        self.signature = (self.gpu or self.fallback).signature
        self.run_options = getattr(self.gpu, "run_options", ()) + getattr(self.fallback, "run_options", ())
        self._closed = False

    def _count(self, where: str, e: CuvilError) -> None:
        self.fallbacks[where] += 1
        name = getattr(e, "name", None) or type(e).__name__
        self.fallbacks["errors"][name] = self.fallbacks["errors"].get(name, 0) + 1

    @property
    def active(self) -> str:
        """``"gpu"`` or ``"fallback"``: what the next call runs on."""
        return "gpu" if self.gpu is not None else "fallback"

    def _run_arrays(self, arrays: List[np.ndarray], **options) -> List[np.ndarray]:
        gpu = self.gpu
        if gpu is not None:
            try:
                return gpu._run_arrays(arrays, **{k: v for k, v in options.items() if k in gpu.run_options})
            except CudaError as e:
                with self._lock:
                    self._count("run", e)
                    sticky = e.name not in TRANSIENT
                    warnings.warn(f"{self.path}: {e}; this call" + (" and the next ones" if sticky else "")
                                  + f" run the x86 artifact {self.fallback_path}", RuntimeWarning, stacklevel=3)
                    if sticky and self.gpu is gpu:
                        self.gpu = None
                        try:
                            gpu.close()
                        except CuvilError:
                            pass
        with self._lock:            # calls may come from several threads (a GPU model with sessions=N)
            self.fallbacks["calls"] += 1
        fb = self.fallback
        return fb._run_arrays(arrays, **{k: v for k, v in options.items() if k in fb.run_options})

    def stats(self) -> dict:
        """The GPU model's ``stats()`` (None once it is not used) and ``fallbacks``: ``load`` (1 when the bundle
        could not be loaded), ``run`` (calls whose GPU run failed), ``calls`` (calls the fallback ran),
        ``errors`` (by CUDA error name); ``active``."""
        gpu = self.gpu
        return {"active": self.active, "gpu": gpu.stats() if gpu is not None and hasattr(gpu, "stats") else None,
                "fallbacks": {**self.fallbacks, "errors": dict(self.fallbacks["errors"])}}

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for m in (self.gpu, self.fallback):
            if m is not None:
                m.close()

    def __repr__(self) -> str:
        return f"<cuvil.FailSafeModel {self.path} on {self.active}, fallback {self.fallback_path}>"


__all__ = ["FailSafeModel", "TRANSIENT"]
