"""Compiled artifacts: ``Pipeline.compile`` returns an :class:`Artifact` (a built ``libNAME.so`` with its
header and manifest); :func:`load` opens any saved library in any process, through ctypes.

Artifacts are cached by content: the graph's structural hash, the constants, the compile options and the
Cuvil version. Compiling the same model twice (tests, notebooks) reuses the library.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Dict, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import CuvilError
from .targets.x86.link import write_library
from .targets.x86.loader import Model
from .targets.x86.loader import load as _load_so

X86_TARGET = "x86_64-linux-gnu"
PTX_TARGET = "nvptx64-nvidia-cuda"


def artifact_cache_dir() -> str:
    base = os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil")
    return os.path.join(base, "artifacts")


def _sidecars(so_path: str) -> Dict[str, str]:
    base = os.path.splitext(so_path)[0]
    return {"h": base + ".h", "manifest": base + ".manifest.json"}


class Artifact:
    """A compiled model: ``.path`` (the .so), ``.manifest``; ``.save(path)``, ``.run(inputs)``."""

    def __init__(self, so_path: str, manifest: dict, cached: bool = False):
        self.path, self.manifest, self.cached = so_path, manifest, cached
        self._model: Optional[Model] = None

    @property
    def header_path(self) -> str:
        return _sidecars(self.path)["h"]

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
        for key, src in _sidecars(self.path).items():
            shutil.copyfile(src, _sidecars(path)[key])
        return path

    def model(self, num_threads: int = 0) -> Model:
        """The loaded library (loaded once); ``num_threads`` (0 = all cores) becomes the default of its
        ``run`` from this call on: ``art.model(num_threads=2)`` after ``art.model()`` runs on two threads."""
        m = self._loaded(num_threads)
        m.num_threads = num_threads
        return m

    def _loaded(self, num_threads: int = 0) -> Model:
        if self._model is None:
            self._model = _load_so(self.path, num_threads=num_threads)
        return self._model

    def run(self, inputs: Union[Mapping[str, np.ndarray], Sequence[np.ndarray]], num_threads: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Run the native library; returns outputs by name."""
        m = self._loaded()
        outs = m.run(**inputs, num_threads=num_threads) if isinstance(inputs, Mapping) else m.run(*inputs, num_threads=num_threads)
        return {spec.name: arr for spec, arr in zip(m.outputs, outs)}

    def __repr__(self):
        return f"<Artifact {self.path} ({self.manifest.get('kernels')} kernels)>"


def load(path: Union[str, os.PathLike], num_threads: int = 0, fallback: Union[str, os.PathLike, None] = None, **gpu):
    """Open a compiled model: ``libNAME.so`` through ctypes, or a GPU bundle ``NAME.cuvil/`` through the CUDA
    driver (``gpu``: ``device``, ``max_graphs``, ``mode``, ``prefer_cubin``). Where a bundle cannot run
    (no CUDA driver or GPU) and ``fallback`` names an x86 ``libNAME.so``, that is loaded instead, with a
    warning."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.rstrip(os.sep).endswith(".cuvil"):
        from .targets.ptx.runtime import NoGpuError, load_bundle
        try:
            return load_bundle(path, **gpu)
        except NoGpuError as e:
            if fallback is None:
                raise
            import warnings
            warnings.warn(f"{path}: {e}; running the x86 artifact {os.fspath(fallback)} instead", RuntimeWarning,
                          stacklevel=2)
            return load(fallback, num_threads=num_threads)
    if gpu:
        raise CuvilError(f"{path}: {', '.join(sorted(gpu))} apply to GPU bundles (NAME.cuvil/) only")
    if not os.path.isfile(path):
        raise CuvilError(f"{path}: no such file")
    return _load_so(path, num_threads=num_threads)


class Bundle:
    """A compiled GPU model: ``.path`` (the ``NAME.cuvil/`` directory), ``.manifest``; ``.save(path)``,
    ``.model()`` (needs a CUDA driver and GPU), ``.run(inputs)``."""

    def __init__(self, path: str, manifest: dict, cached: bool = False):
        self.path, self.manifest, self.cached = path, manifest, cached
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
        return path

    def model(self, **gpu):
        if self._model is None:
            from .targets.ptx.runtime import load_bundle
            self._model = load_bundle(self.path, **gpu)
        return self._model

    def run(self, inputs: Union[Mapping[str, np.ndarray], Sequence[np.ndarray]]) -> Dict[str, np.ndarray]:
        """Run on the GPU; returns outputs by name."""
        m = self.model()
        outs = m.run(**inputs) if isinstance(inputs, Mapping) else m.run(*inputs)
        return {spec.name: arr for spec, arr in zip(m.outputs, outs)}

    def __repr__(self):
        return f"<Bundle {self.path} ({self.manifest.get('kernels')} kernels, {self.manifest['target']['arch']})>"


def build_cached_bundle(key: str, name: str, build) -> Bundle:
    """The cached bundle for ``key``, or ``build(bundle_dir) -> manifest`` (see :func:`_cached_build`)."""
    path, manifest, cached = _cached_build(key, f"{name}.cuvil", lambda p: os.path.join(p, "manifest.json"), build)
    return Bundle(path, manifest, cached=cached)


def _compiler_digest() -> str:
    """A digest of the code generator's own sources, so editing it never returns a stale cached library."""
    global _COMPILER_DIGEST
    if _COMPILER_DIGEST is None:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
        h = hashlib.sha256()
        for dirpath, _, files in sorted(os.walk(root)):
            for f in sorted(files):
                if f.endswith((".py", ".c", ".h")):
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(f.encode() + fh.read())
        _COMPILER_DIGEST = h.hexdigest()
    return _COMPILER_DIGEST


_COMPILER_DIGEST = None


def cache_key(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    h.update(_compiler_digest().encode())
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def build_cached(key: str, prefix: str, build) -> Artifact:
    """The cached artifact for ``key``, or ``build(so_path) -> manifest`` (see :func:`_cached_build`)."""
    path, manifest, cached = _cached_build(key, f"lib{prefix}.so", lambda p: _sidecars(p)["manifest"], build)
    return Artifact(path, manifest, cached=cached)


def _cached_build(key: str, name: str, manifest_of, build):
    """``(path, manifest, cached)`` of cache entry ``key``'s ``name``: read back when its manifest exists, else
    ``build(path) -> manifest`` run in a fresh directory that is then renamed into the cache atomically (a
    concurrent builder of the same key wins; ours is discarded)."""
    root = artifact_cache_dir()
    path = os.path.join(root, key, name)
    if os.path.exists(path) and os.path.isfile(manifest_of(path)):
        with open(manifest_of(path)) as f:
            return path, json.load(f), True
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        manifest = build(os.path.join(tmp, name))
        try:
            os.rename(tmp, os.path.join(root, key))
        except OSError:  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, manifest, False
