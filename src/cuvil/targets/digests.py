"""The digest manifest of an artifact: the SHA-256 of each of its files by name, and one digest over them all.

The one digest is the OpenSSF model-signing format's (v1.0 predicate): SHA-256 over the raw SHA-256 digests
of the files in the order of their names, the ``subject`` digest of the in-toto statement a signature
carries (:mod:`cuvil.signing`). It names a GPU bundle in the audit log (:mod:`cuvil.audit`); an x86 library
is named by the SHA-256 of the library alone.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Dict, Mapping


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(files: Mapping[str, bytes]) -> Dict[str, str]:
    """``{name: sha256 hex}`` of in-memory file contents."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def root_digest(digests: Mapping[str, str]) -> str:
    """SHA-256 over the files' digests (hex in, hex out), ordered as model-signing orders its resources
    (by path components)."""
    h = hashlib.sha256()
    for name in sorted(digests, key=lambda n: pathlib.PurePosixPath(n).parts):
        h.update(bytes.fromhex(digests[name]))
    return h.hexdigest()


def directory_files(root: str, exclude=()) -> list:
    """Every file under ``root`` as a relative POSIX name, sorted, except the names in ``exclude``; a
    symbolic link is listed too (the caller decides: a signature refuses it)."""

    out = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        for n in names + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = pathlib.PurePath(os.path.relpath(os.path.join(dirpath, n), root)).as_posix()
            if rel not in exclude:
                out.append(rel)
    return sorted(out)
