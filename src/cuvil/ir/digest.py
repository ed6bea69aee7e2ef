"""Content digest of arrays (constants, tensor attributes): dtype, shape and bytes."""
from __future__ import annotations

import hashlib

import numpy as np


def array_digest(arr: np.ndarray, size: int = 16) -> str:
    arr = np.require(np.asarray(arr), requirements="C")
    h = hashlib.blake2b(digest_size=size)
    h.update(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.reshape(-1).view(np.uint8) if arr.dtype != object else repr(arr.tolist()).encode())
    return h.hexdigest()
