"""Compiled artifacts: what :meth:`cuvil.Pipeline.compile` returns (an :class:`Artifact`, ``libNAME.so``
with its header and manifest; a :class:`Bundle`, ``NAME.cuvil/``), :func:`load` to open any saved one in
any process as a :class:`Model` (one interface whatever the target: :mod:`cuvil.targets.model_api`), and
the content-addressed artifact cache.

The cache stores and returns files only: :meth:`Pipeline.compile` computes an entry's key
(:func:`cache_key`: the graph's structural hash, the options, the Cuvil version and a digest of the code
generator's sources), looks the entry up (:func:`cached_path`) and, on a miss, has the target build into a
fresh directory that :func:`cache_entry` moves into the cache atomically, with the digests of its files
(:data:`DIGESTS_FILE`). A hit is checked against them before it is used (:func:`cached_path`): an entry
altered since it was made is discarded with a warning and built again. Compiling the same model twice
(tests, notebooks) reuses the library.

:func:`artifact_files` (from :mod:`cuvil.signing`, which defines it) is the list of an artifact's files (an
x86 library's sidecars, or every file of a bundle) and :func:`supply_chain_paths` where its SBOM and
provenance go.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import audit
from .errors import CuvilError
from .signing import SignatureError, artifact_files, verify_artifact
from .targets import PTX_TARGET, X86_TARGET
from .targets.model_api import Model
from .supply_chain import sha256_file
from .targets.ptx.artifact import Bundle
from .targets.ptx.bundle import PROVENANCE_FILE, SBOM_FILE
from .targets.ptx.failsafe import FailSafeModel
from .targets.ptx.runtime import load_bundle
from .targets.x86.artifact import Artifact, sidecars
from .targets.x86.loader import load as _load_so
from .targets.x86.sealed import sealed_library

#: Model files (ONNX, PyTorch) that cuvil.load is sometimes given in place of the library compiled from them.
MODEL_SUFFIXES = (".onnx", ".pt", ".pt2")


def load(path: Union[str, os.PathLike], num_threads: int = 0, fallback: Union[str, os.PathLike, None] = None, *,
         weights=None, weights_key=None, verify=None, **gpu) -> Model:
    """Open a compiled model as a :class:`Model`: ``libNAME.so`` through ctypes, or a GPU bundle
    ``NAME.cuvil/`` through the CUDA driver (``gpu``: ``device``, ``max_graphs``, ``mode``,
    ``prefer_cubin``, ``sessions`` (inferences in flight at once, from as many host threads), ``pinned``,
    ``streams`` (the streams a captured graph lays independent kernels over; 1 by default)). Both answer the
    same calls: ``run(*arrays)`` / ``run(**named)`` return a list in output order, ``run({name: array})`` a dict by output name; ``inputs``, ``outputs``, ``symbols``;
    ``close()`` and ``with``. Where a bundle cannot run (no CUDA driver or GPU) and ``fallback`` names an
    x86 ``libNAME.so``, a :class:`~cuvil.targets.ptx.failsafe.FailSafeModel` runs the bundle and falls back to
    that library where the GPU is missing, out of memory or faults, with a warning and a counter in its
    ``stats()``. A library compiled with external weights
    maps its ``libNAME.weights`` (read-only, shared between processes), or binds ``weights`` (the contents of
    that file, bytes-like); encrypted ones need ``weights_key`` (a key file, or the key's 32 bytes) and are
    decrypted in memory only (docs/weights.md).

    ``verify`` (a public key: PEM file, PEM bytes or key object): first check the artifact's signature
    (:func:`cuvil.signing.verify_artifact`; a :class:`cuvil.signing.SignatureError` if it does not hold),
    then load the very bytes checked: the library from a sealed in-memory file, its manifest and external
    weights as verified (a bundle's files likewise); a fallback is verified with the same key."""
    path = os.fspath(path)
    if verify is not None:
        if weights is not None:
            raise CuvilError(f"{path}: weights= and verify= together: the weights to bind would be unverified",
                             hint="leave weights= out: a verified load binds the libNAME.weights it verified")
        return _load_verified(path, verify, num_threads, fallback, gpu, weights_key)
    if os.path.isfile(path) and path.lower().endswith(MODEL_SUFFIXES):
        # a model given where a compiled one belongs would otherwise reach dlopen ("invalid ELF header")
        name = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        raise CuvilError(f"{path}: a model, not a compiled one: compile it first",
                         hint=f"cuvil compile {path} -o build/lib{name}.so, then load build/lib{name}.so "
                              f"(Python: cuvil.Pipeline.from_file({path!r}).compile())")
    if os.path.isdir(path) or path.rstrip(os.sep).endswith(".cuvil"):
        if weights is not None or weights_key is not None:
            raise CuvilError(f"{path}: weights= and weights_key= apply to x86 libraries (libNAME.so) only; a "
                             f"GPU bundle keeps its weights in its own weights.bin",
                             hint="drop weights= and weights_key= for a bundle")
        if fallback is None:
            return load_bundle(path, **gpu)
        return FailSafeModel(path, lambda: load_bundle(path, **gpu), lambda: load(fallback, num_threads=num_threads),
                             os.fspath(fallback))
    if gpu:
        raise CuvilError(f"{path}: {', '.join(sorted(gpu))} apply to GPU bundles (NAME.cuvil/) only",
                         hint=f"leave {', '.join(sorted(gpu))} out for an x86 library")
    if not os.path.isfile(path):
        raise CuvilError(f"{path}: no such file", hint="give a compiled libNAME.so or NAME.cuvil bundle (cuvil "
                         "compile MODEL -o libNAME.so writes one)")
    return _load_so(path, num_threads=num_threads, weights=weights, weights_key=weights_key)


def supply_chain_paths(path: str) -> Tuple[str, str]:
    """Where the artifact at ``path`` keeps its SBOM and its provenance: ``libNAME.cdx.json`` and
    ``libNAME.intoto.json`` beside ``libNAME.so``; ``sbom.cdx.json`` and ``provenance.intoto.json`` inside a
    bundle ``NAME.cuvil/``."""
    if path.endswith(".so"):
        s = sidecars(path)
        return s["cdx"], s["intoto"]
    return os.path.join(path, SBOM_FILE), os.path.join(path, PROVENANCE_FILE)


def _load_verified(path: str, key, num_threads: int, fallback, gpu: dict, weights_key=None) -> Model:
    try:
        v = verify_artifact(path, key)
    except CuvilError as e:
        audit.record("load", artifact=path, outcome="refused" if isinstance(e, SignatureError) else "error",
                     reason=e.message)
        raise
    if v.kind == "bundle":
        if fallback is None:
            return load_bundle(path, files=v.files, **gpu)
        return FailSafeModel(path, lambda: load_bundle(path, files=v.files, **gpu),
                             lambda: load(fallback, num_threads=num_threads, verify=key, weights_key=weights_key),
                             os.fspath(fallback))
    if gpu:
        raise CuvilError(f"{path}: {', '.join(sorted(gpu))} apply to GPU bundles (NAME.cuvil/) only",
                         hint=f"leave {', '.join(sorted(gpu))} out for an x86 library")
    lib = os.path.basename(path)
    names = {k: os.path.basename(p) for k, p in sidecars(path).items()}
    manifest = {}
    if names["manifest"] in v.files:
        try:
            manifest = json.loads(v.files[names["manifest"]])
        except ValueError as e:
            raise CuvilError(f"{path}: its signed manifest is not JSON ({e})",
                             hint="compile the model again and sign the new artifact") from None
    weights = v.files.get(names["weights"])      # external weights: the verified bytes (None when embedded)
    return _load_so(path, num_threads=num_threads, weights=weights, weights_key=weights_key, manifest=manifest,
                    dlopen_path=sealed_library(v.files[lib], lib))


def artifact_cache_dir() -> str:
    base = os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil")
    return os.path.join(base, "artifacts")


def compiler_sources() -> List[str]:
    """Every source file of the package (Python, the C runtime, the grammar), sorted: what a cached artifact
    was built by. The whole package, not only the backends: the kernel layer lowers and schedules, and the
    rewrite layer's passes (float16, specialisation) run inside a build, so an edit anywhere below the
    pipeline can change what a build writes."""
    root = os.path.dirname(os.path.abspath(__file__))
    out = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out.extend(os.path.join(dirpath, f) for f in files if f.endswith((".py", ".c", ".h", ".lark")))
    return sorted(out)


def _compiler_digest() -> str:
    """A digest of the compiler's own sources, so editing it never returns a stale cached library."""
    global _COMPILER_DIGEST
    if _COMPILER_DIGEST is None:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for path in compiler_sources():
            with open(path, "rb") as fh:
                h.update(os.path.relpath(path, root).encode() + b"\0" + fh.read())
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


#: In each cache entry's directory: ``sha256  NAME`` per line for every file of the entry (sorted).
DIGESTS_FILE = ".digests"


def _entry_digests(entry: str) -> str:
    lines = []
    for dirpath, dirnames, names in os.walk(entry):
        dirnames.sort()
        for n in sorted(names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, entry)
            if rel == DIGESTS_FILE:
                continue
            if os.path.islink(full) or not os.path.isfile(full):   # a build writes plain files only: a link
                lines.append(f"not-a-file  {rel}\n")                # (or FIFO) never matches, never followed
            else:
                lines.append(f"{sha256_file(full)}  {rel}\n")
    return "".join(sorted(lines, key=lambda ln: ln.split("  ", 1)[1]))


def cached_path(key: str, name: str) -> Optional[str]:
    """Where cache entry ``key`` keeps ``name`` (``libNAME.so``, ``NAME.cuvil``), if the entry exists and its
    files still have the digests recorded when it was made. Entries appear whole (:func:`cache_entry`); one
    whose files differ from their digests (altered, truncated, or without digests) is discarded with a
    warning, and the caller builds it again. A symbolic link or special file in an entry never matches (a build
    writes plain files). The digests catch an entry altered or damaged after it was made; they are not a
    signature: whoever can write the cache can write them too, so a cache shared with someone you do not trust
    is no place to take a deployed library from (sign it and load with ``verify=``, docs/deployment.md)."""
    entry = os.path.join(artifact_cache_dir(), key)
    path = os.path.join(entry, name)
    if not os.path.exists(path):
        return None
    try:
        with open(os.path.join(entry, DIGESTS_FILE), encoding="utf-8") as f:
            recorded = f.read()
    except OSError:
        recorded = None
    if recorded is not None and _entry_digests(entry) == recorded:
        return path
    warnings.warn(f"artifact cache entry {entry} does not match the digests recorded when it was made "
                  f"({'altered' if recorded is not None else 'no digests'}): discarded, building it again",
                  RuntimeWarning, stacklevel=3)
    _discard(entry)
    return None


def _discard(entry: str) -> None:
    """Remove a cache entry: renamed away first (one atomic step: no process finds it half removed)."""
    trash = tempfile.mkdtemp(prefix=".discard-", dir=os.path.dirname(entry))
    try:
        os.rename(entry, os.path.join(trash, "entry"))
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def cache_entry(key: str, name: str) -> Iterator[str]:
    """Yields the path to build ``name`` at, in a fresh directory of the cache; when the block succeeds, the
    directory becomes entry ``key`` (one atomic rename: a concurrent builder of the same key wins and ours is
    discarded), where :func:`cached_path` finds it. When the block fails, the directory is removed."""
    root = artifact_cache_dir()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        yield os.path.join(tmp, name)
        with open(os.path.join(tmp, DIGESTS_FILE), "w", encoding="utf-8") as f:
            f.write(_entry_digests(tmp))
        dest = os.path.join(root, key)
        try:
            os.rename(tmp, dest)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(dest):   # not another process that built it meanwhile: a real failure
                raise CuvilError(f"cannot store the build in the artifact cache {root}: {e}",
                                 hint="set CUVIL_CACHE_DIR to a writable directory, or compile with cache=False") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["Artifact", "Bundle", "Model", "X86_TARGET", "PTX_TARGET", "load", "artifact_cache_dir", "cache_key",
           "cached_path", "cache_entry", "artifact_files", "supply_chain_paths", "DIGESTS_FILE"]
