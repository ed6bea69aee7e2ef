"""The x86 artifact: a built ``libNAME.so`` with its header ``libNAME.h`` and manifest
``libNAME.manifest.json`` beside it, as :meth:`cuvil.Pipeline.compile` returns it."""
from __future__ import annotations

import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from ...errors import CuvilError
from ..model_api import as_run_args
from .link import write_library
from .loader import Model, load


def sidecars(so_path: str) -> Dict[str, str]:
    """The files that travel with ``libNAME.so``: its header and its manifest, and its weights file
    ``libNAME.weights`` when it was compiled with external weights (absent otherwise: saving skips a sidecar
    that is not there)."""
    base = os.path.splitext(so_path)[0]
    return {"h": base + ".h", "manifest": base + ".manifest.json", "weights": base + ".weights"}


class Artifact:
    """A compiled model: ``.path`` (the .so), ``.manifest``; ``.save(path)``, ``.run(inputs)``."""

    def __init__(self, so_path: str, manifest: dict, cached: bool = False):
        self.path, self.manifest, self.cached = so_path, manifest, cached
        self._model: Optional[Model] = None

    @property
    def header_path(self) -> str:
        return sidecars(self.path)["h"]

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Copy the library, its header and manifest to ``path`` (``DIR/libNAME.so`` or a directory)."""
        path = os.fspath(path)
        if os.path.isdir(path) or path.endswith(os.sep):
            path = os.path.join(path, os.path.basename(self.path))
        if not path.endswith(".so"):
            raise CuvilError(f"{path}: an x86 artifact is saved as DIR/libNAME.so")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path) and os.path.samefile(self.path, path):
            return path                                 # already there, with its header and manifest
        write_library(self.path, path)                  # 2 MiB writes: a first run as fast as later ones
        for key, src in sidecars(self.path).items():
            if os.path.exists(src):
                shutil.copyfile(src, sidecars(path)[key])
            elif os.path.exists(sidecars(path)[key]):
                os.unlink(sidecars(path)[key])          # a stale one of an earlier artifact there: not ours
        return path

    def model(self, num_threads: int = 0, weights_key=None) -> Model:
        """The loaded library (loaded once); ``num_threads`` (0 = all cores) becomes the default of its
        ``run`` from this call on: ``art.model(num_threads=2)`` after ``art.model()`` runs on two threads.
        ``weights_key``: the key of encrypted weights (``encrypt_weights=`` at compile time)."""
        m = self._loaded(num_threads, weights_key)
        m.num_threads = num_threads
        return m

    def _loaded(self, num_threads: int = 0, weights_key=None) -> Model:
        if self._model is None:
            self._model = load(self.path, num_threads=num_threads, weights_key=weights_key)
        return self._model

    def run(self, inputs: Union[Mapping[str, np.ndarray], Sequence[np.ndarray], np.ndarray],
            num_threads: Optional[int] = None) -> Union[Dict[str, np.ndarray], List[np.ndarray]]:
        """Run the native library through :meth:`Model.run <cuvil.targets.model_api.Model.run>`: a dict of
        named inputs returns a dict by output name; a sequence of arrays in input order (or one array, for a
        model of one input) returns a list in output order."""
        return self._loaded().run(*as_run_args(inputs), num_threads=num_threads)

    def __repr__(self):
        return f"<Artifact {self.path} ({self.manifest.get('kernels')} kernels)>"


def existing_sidecars(so_path: str) -> Dict[str, str]:
    """The sidecars of ``libNAME.so`` (:func:`sidecars`) that exist: optional ones (the external weights)
    are written only by some compiles, and an artifact is whatever of them is there (a signature covers
    those, :mod:`cuvil.signing`)."""
    return {k: p for k, p in sidecars(so_path).items() if os.path.isfile(p)}
