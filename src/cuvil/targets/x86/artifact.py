"""The x86 artifact: a built ``libNAME.so`` with its header ``libNAME.h``, manifest ``libNAME.manifest.json``,
SBOM ``libNAME.cdx.json`` and provenance ``libNAME.intoto.json`` beside it (:func:`sidecars`), as
:meth:`cuvil.Pipeline.compile` returns it."""
from __future__ import annotations

import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from ...errors import CuvilError
from ...supply_chain import rename_records
from ..model_api import as_run_args
from .link import write_library
from .loader import Model, load


def sidecars(so_path: str) -> Dict[str, str]:
    """The files that travel with ``libNAME.so``, by role: its header, its manifest, its SBOM (CycloneDX 1.6,
    ``cdx``) and provenance (in-toto / SLSA v1, ``intoto``) (docs/supply-chain.md), and its weights file
    ``libNAME.weights`` when it was compiled with external weights. The one list of an x86 artifact's files:
    saving, signing and the provenance's subjects read it; a sidecar that is not there (the weights of a
    library that embeds them; an artifact built by an older Cuvil) is skipped where it is optional."""
    base = os.path.splitext(so_path)[0]
    return {"h": base + ".h", "manifest": base + ".manifest.json", "cdx": base + ".cdx.json",
            "intoto": base + ".intoto.json", "weights": base + ".weights"}


class Artifact:
    """A compiled model: ``.path`` (the .so), ``.manifest``; ``.save(path)``, ``.run(inputs)``."""

    def __init__(self, so_path: str, manifest: dict, cached: bool = False):
        self.path, self.manifest, self.cached = so_path, manifest, cached
        #: Seconds the compile that built it took (``compile_seconds``, ``codegen_seconds``, ``proof_seconds``);
        #: None when it came from the cache. Not in the manifest: builds are reproducible byte for byte.
        self.timings: Optional[Dict[str, float]] = None
        self._model: Optional[Model] = None

    @property
    def header_path(self) -> str:
        return sidecars(self.path)["h"]

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Copy the library and its sidecars (those that exist) to ``path`` (``DIR/libNAME.so`` or a directory)."""
        path = os.fspath(path)
        if os.path.isdir(path) or path.endswith(os.sep):
            path = os.path.join(path, os.path.basename(self.path))
        if not path.endswith(".so"):
            raise CuvilError(f"{path}: an x86 artifact is saved as DIR/libNAME.so")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path) and os.path.samefile(self.path, path):
            return path                                 # already there, with its sidecars
        write_library(self.path, path)                  # 2 MiB writes: a first run as fast as later ones
        for key, src in sidecars(self.path).items():
            if os.path.exists(src):
                shutil.copyfile(src, sidecars(path)[key])
            elif os.path.exists(sidecars(path)[key]):
                os.unlink(sidecars(path)[key])          # a stale one of an earlier artifact there: not ours
        if os.path.basename(path) != os.path.basename(self.path):   # saved under another name: the SBOM and
            src, dst = sidecars(self.path), sidecars(path)          # provenance name the files as they now are
            renames = {os.path.basename(self.path): os.path.basename(path),
                       **{os.path.basename(src[k]): os.path.basename(dst[k]) for k in src}}
            rename_records(dst["cdx"], dst["intoto"], renames)
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

