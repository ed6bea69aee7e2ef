"""The GPU artifact as :meth:`cuvil.Pipeline.compile` returns it: a bundle directory ``NAME.cuvil/``
(:mod:`cuvil.targets.ptx.bundle`) with its manifest, saved and run from Python."""
from __future__ import annotations

import os
import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from ...errors import CuvilError
from ...supply_chain import rename_records
from ..model_api import as_run_args
from .bundle import PROVENANCE_FILE, SBOM_FILE
from .runtime import load_bundle


class Bundle:
    """A compiled GPU model: ``.path`` (the ``NAME.cuvil/`` directory), ``.manifest``; ``.save(path)``,
    ``.model()`` (needs a CUDA driver and GPU), ``.run(inputs)``."""

    def __init__(self, path: str, manifest: dict, cached: bool = False):
        self.path, self.manifest, self.cached = path, manifest, cached
        #: Seconds the compile took (as :attr:`cuvil.artifact.Artifact.timings`); None from the cache.
        self.timings: Optional[Dict[str, float]] = None
        self._model = None

    def save(self, path: Union[str, os.PathLike]) -> str:
        """Copy the bundle directory to ``path`` (``DIR/NAME.cuvil``; an existing bundle there is replaced)."""
        path = os.fspath(path).rstrip(os.sep)
        if not path.endswith(".cuvil"):
            raise CuvilError(f"{path}: a GPU bundle is saved as DIR/NAME.cuvil")
        if os.path.exists(path):
            if not os.path.isfile(os.path.join(path, "plan.json")):
                raise CuvilError(f"{path} exists and is not a GPU bundle; not replacing it")
            shutil.rmtree(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        shutil.copytree(self.path, path)
        old, new = os.path.basename(self.path.rstrip(os.sep)), os.path.basename(path)
        if old != new:     # the SBOM names the bundle: as it now is
            rename_records(os.path.join(path, SBOM_FILE), os.path.join(path, PROVENANCE_FILE), {old: new})
        return path

    def model(self, **gpu):
        if self._model is None:
            self._model = load_bundle(self.path, **gpu)
        return self._model

    def run(self, inputs: Union[Mapping[str, np.ndarray], Sequence[np.ndarray], np.ndarray]
            ) -> Union[Dict[str, np.ndarray], List[np.ndarray]]:
        """Run on the GPU through :meth:`Model.run <cuvil.targets.model_api.Model.run>`: a dict of named
        inputs returns a dict by output name; a sequence of arrays in input order (or one array, for a model
        of one input) returns a list in output order."""
        return self.model().run(*as_run_args(inputs))

    def __repr__(self):
        return f"<Bundle {self.path} ({self.manifest.get('kernels')} kernels, {self.manifest['target']['arch']})>"
