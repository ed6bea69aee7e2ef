"""Byte-level mutations of serialized seed models: bit flips, truncation, splices, deleted or repeated
ranges, and corrupted protobuf length fields (varints rewritten to 0, small, or huge values)."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from .corpus import seed_models
from .oracle import check_model
from .report import FamilyReport
from .sandbox import run_cases

NAME = "onnx_bytes"
TIMEOUT_S = 20.0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _flip(b: bytearray, rng) -> None:
    for _ in range(int(rng.integers(1, 9))):
        k = int(rng.integers(len(b)))
        b[k] ^= 1 << int(rng.integers(8))


def _truncate(b: bytearray, rng) -> None:
    del b[int(rng.integers(len(b))):]


def _splice(b: bytearray, rng) -> None:
    donors = seed_models()
    d = donors[int(rng.integers(len(donors)))]
    i, j = sorted(int(x) for x in rng.integers(len(d), size=2))
    k = int(rng.integers(len(b) + 1))
    b[k:k] = d[i:j + 1][:4096]


def _delete(b: bytearray, rng) -> None:
    k = int(rng.integers(len(b)))
    del b[k:k + int(rng.integers(1, 64))]


def _repeat(b: bytearray, rng) -> None:
    k = int(rng.integers(len(b)))
    chunk = b[k:k + int(rng.integers(1, 128))]
    b[k:k] = chunk * int(rng.integers(1, 4))


def _length(b: bytearray, rng) -> None:
    # Field tags of wire type 2 (length-delimited) are followed by a varint length: rewrite one.
    tags = [k for k in range(len(b) - 1) if b[k] & 0x07 == 2 and b[k] < 0x80]
    if not tags:
        return _flip(b, rng)
    k = tags[int(rng.integers(len(tags)))] + 1
    end = k
    while end < len(b) and b[end] & 0x80:
        end += 1
    new = int(rng.choice([0, 1, int(rng.integers(1 << 7)), int(rng.integers(1 << 14)), (1 << 31) - 1, (1 << 63) - 1]))
    b[k:end + 1] = _varint(new)


def _overwrite(b: bytearray, rng) -> None:
    k = int(rng.integers(len(b)))
    n = int(rng.integers(1, 16))
    b[k:k + n] = bytes([int(rng.choice([0x00, 0xFF, 0x7F, 0x80]))]) * n


MUTATIONS = (_flip, _truncate, _splice, _delete, _repeat, _length, _overwrite)


def mutate(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    models = seed_models()
    b = bytearray(models[int(rng.integers(len(models)))])
    for _ in range(int(rng.integers(1, 4))):
        if b:
            MUTATIONS[int(rng.integers(len(MUTATIONS)))](b, rng)
    return bytes(b)


def case(seed: int) -> Tuple[str, str]:
    return check_model(mutate(seed), seed)


def run(budget: int, seed: int, *, timeout_s: float = TIMEOUT_S, progress=None) -> FamilyReport:
    seed_models()  # build the corpus before the worker forks, so every worker inherits it
    return run_cases(NAME, case, budget, seed, timeout_s, progress)
