"""Handing a library compiled with external weights its ``libNAME.weights`` (``PREFIX_bind_weights``).

A plain weights file is mapped read-only and shared (``MAP_SHARED``, ``PROT_READ``): every process that
loads the library maps the same page-cache pages, and nothing is copied. Encrypted weights are decrypted
(AES-256-GCM, :mod:`cuvil.targets.x86.weights_file`) into anonymous private memory, never into a file, and
left out of core dumps. Weights given as bytes (``weights=``, e.g. what a verified load read) are copied into
such memory, aligned.

The library keeps one bound buffer per loaded instance (its static state; ``dlopen`` of one path twice gives
the same instance), which every session it creates reads. So the buffers are shared here the same way: one
:class:`BoundWeights` per library handle, counted by the models that use it; the last one to close unbinds
the library (``bind_weights(NULL, 0)``) before the memory goes.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Dict, Optional

import numpy as np

from ...errors import CuvilError
from .weights_file import (WeightsRefused, check_matches, decrypt_into, parse_header, private_buffer, read_key,
                           weights_path)

_LOCK = threading.Lock()
_BOUND: Dict[int, "BoundWeights"] = {}


class BoundWeights:
    """The buffer bound into one loaded library, and how many models use it."""

    def __init__(self, lib: ctypes.CDLL, bind, buffer, offset: int, nbytes: int, shared_file: Optional[str],
                 encrypted: bool = False):
        self.lib, self._bind, self.buffer, self.offset, self.nbytes = lib, bind, buffer, offset, nbytes
        #: the weights file mapped read-only and shared, or None (decrypted or given: private memory)
        self.shared_file = shared_file
        #: whether the weights were decrypted (the file is encrypted at rest)
        self.encrypted = encrypted
        self.users = 0

    @property
    def address(self) -> int:
        return np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data + self.offset

    def release(self) -> None:
        with _LOCK:
            self.users -= 1
            if self.users > 0:
                return
            _BOUND.pop(self.lib._handle, None)
            if self._bind(None, 0) == 0:   # refused only while a session (of a raw ctypes user) is live: keep it
                self.buffer.close()


def _info(lib: ctypes.CDLL, prefix: str):
    """``(nbytes, sha256)`` of the external weights the library expects, or None when it embeds them (or is
    older than external weights)."""
    fn = getattr(lib, f"{prefix}_weights_info", None)
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint8)]
    nbytes, digest = ctypes.c_int64(), (ctypes.c_uint8 * 32)()
    if fn(ctypes.byref(nbytes), digest) != 1:
        return None
    return nbytes.value, bytes(digest)


def bind_external_weights(lib: ctypes.CDLL, prefix: str, so_path: str, weights=None,
                          weights_key=None, from_disk: bool = True) -> Optional[BoundWeights]:
    """Bind the weights of the library ``lib`` (``so_path``) when it was compiled with external weights: from
    ``weights`` (the contents of a weights file, bytes-like) or else the ``libNAME.weights`` beside it,
    decrypted with ``weights_key`` when encrypted. Returns the binding (release it when done), or None for a
    library that embeds its weights. ``from_disk=False`` (a verified load):
    never read the file from the disk; a library that needs weights not given is refused."""
    lib_name = os.path.basename(so_path)
    expected = _info(lib, prefix)
    if expected is None:
        given = [k for k, v in (("weights=", weights), ("weights_key=", weights_key)) if v is not None]
        if given:
            raise CuvilError(f"{lib_name} embeds its weights (compiled without --external-weights): "
                             f"{' and '.join(given)} {'have' if len(given) > 1 else 'has'} nothing to bind", hint=f"drop {' and '.join(given)}")
        return None
    nbytes, digest = expected
    wp = weights_path(so_path)
    if weights is None and not from_disk:   # a verified load: only the bytes the signature covered
        raise WeightsRefused(f"{lib_name} was compiled with external weights, and its signature does not cover "
                             f"{os.path.basename(wp)}: a verified load binds only weights it verified",
                             hint=f"sign the artifact with {os.path.basename(wp)} beside the library (cuvil sign "
                                  f"{so_path} --key KEY.pem), or get the signed weights file from its publisher")
    name = os.path.basename(wp)         # weights= holds that file's contents (e.g. as a verified load read them)
    data = _file_mapping(wp, lib_name) if weights is None else memoryview(weights).cast("B")
    try:
        h = parse_header(data, name)
        check_matches(h, nbytes, digest, name, lib_name)
        if h.encrypted and weights_key is None:
            raise CuvilError(f"{name}: the weights of {lib_name} are encrypted: give their key",
                             hint=f"cuvil.load({so_path!r}, weights_key=KEYFILE) (cuvil run: --weights-key KEYFILE), "
                                  f"KEYFILE being the file given to --encrypt-weights when it was compiled")
        if not h.encrypted and weights_key is not None:
            raise CuvilError(f"{name}: the weights of {lib_name} are not encrypted: weights_key= has nothing to "
                             f"decrypt", hint="drop weights_key=, or compile with --encrypt-weights KEYFILE to "
                                              "keep them encrypted at rest")
        with _LOCK:
            bound = _BOUND.get(lib._handle)
        if bound is not None and not h.encrypted:
            return _use(bound)             # this library instance has them already (same digest: same bytes)
        if h.encrypted:
            buffer = private_buffer(h.plain_bytes)
            try:
                decrypt_into(data, h, read_key(weights_key), digest, buffer, name)
            except BaseException:
                buffer.close()
                raise
            offset, shared = 0, None
        elif weights is None:
            buffer, offset, shared, data = data, h.header_bytes, wp, None   # the mapping itself: shared pages
        else:
            buffer = private_buffer(h.plain_bytes)
            buffer[:h.plain_bytes] = data[h.header_bytes:h.header_bytes + h.plain_bytes]
            offset, shared = 0, None
    finally:
        if isinstance(data, mmap.mmap):
            data.close()
    return _bind(lib, prefix, buffer, offset, nbytes, shared, lib_name, h.encrypted)


def _file_mapping(wp: str, lib_name: str) -> mmap.mmap:
    if not os.path.isfile(wp):
        raise CuvilError(f"{lib_name} was compiled with external weights, and {os.path.basename(wp)} is not beside it",
                         hint=f"copy {os.path.basename(wp)} from the build next to {lib_name} (Artifact.save and "
                              f"cuvil compile write both), or give its contents: cuvil.load(path, weights=...)")
    with open(wp, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CuvilError(f"{os.path.basename(wp)}: empty file, not the weights of {lib_name}",
                             hint="copy it again from the build that made the library, or compile the model again")
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def _use(bound: BoundWeights) -> BoundWeights:
    with _LOCK:
        bound.users += 1
    return bound


def _bind(lib, prefix, buffer, offset, nbytes, shared, lib_name, encrypted) -> BoundWeights:
    bind = getattr(lib, f"{prefix}_bind_weights")
    bind.restype, bind.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    with _LOCK:
        bound = _BOUND.get(lib._handle)
        if bound is not None:               # another thread bound the same library meanwhile
            buffer.close()
            bound.users += 1
            return bound
        bound = BoundWeights(lib, bind, buffer, offset, nbytes, shared, encrypted)
        rc = bind(bound.address, nbytes)
        if rc != 0:
            buffer.close()
            err = getattr(lib, f"{prefix}_last_error")
            err.restype = ctypes.c_char_p
            raise WeightsRefused(f"{lib_name}: bind_weights refused the weights (code {rc}): "
                             f"{(err() or b'').decode('utf-8', errors='replace')}",
                             hint="use the .weights file compiled together with the library, unchanged (copy it "
                                  "again from the build)")
        bound.users = 1
        _BOUND[lib._handle] = bound
    return bound
