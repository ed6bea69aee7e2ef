"""The digest manifest of an artifact: the SHA-256 of each of its files by name, and one digest over them all.

The one digest is the OpenSSF model-signing format's (v1.0 predicate): SHA-256 over the raw SHA-256 digests
of the files in the order of their names, the ``subject`` digest of the in-toto statement a signature
carries (:mod:`cuvil.signing`). It names a GPU bundle in the audit log (:mod:`cuvil.audit`); an x86 library
is named by the SHA-256 of the library alone.

The one home of these functions (the SBOM and provenance, the cache, the signature and the loaders all use
them), in the lowest layer that needs them. :func:`read_plain` reads a file a signature covers: a regular
file only, never through a symbolic link (``O_NOFOLLOW``: no window between a check and the open), never
blocking on a FIFO or a device.
"""
from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import stat
from typing import Dict, Mapping

from ..errors import CuvilError


class PlainFileError(CuvilError):
    """A file that should be a regular file and is not: ``kind`` is ``link`` (a symbolic link) or
    ``special`` (a directory, FIFO, socket or device)."""

    def __init__(self, message: str, kind: str, hint=None):
        super().__init__(message, hint=hint)
        self.kind = kind


def read_plain(path: str) -> bytes:
    """The contents of the regular file ``path``, read through one descriptor; :class:`PlainFileError` for a
    symbolic link (not followed) or anything but a regular file (a FIFO is never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise PlainFileError(f"{path} is a symbolic link", "link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):   # a FIFO without a writer, a directory
            raise PlainFileError(f"{path} is not a regular file", "special") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PlainFileError(f"{path} is not a regular file", "special")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


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
