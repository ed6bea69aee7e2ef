"""``libNAME.weights``: an x86 library's weights kept outside its code (``--external-weights``), optionally
encrypted at rest (``--encrypt-weights KEYFILE``, AES-256-GCM).

Layout (little-endian; the payload starts at ``header_bytes``, a page, so a mapping of the file gives
page-aligned weights)::

    0   8  magic b"CUVILWTS"
    8   4  format version (1)
    12  4  flags: bit 0 = encrypted
    16  8  header_bytes (4096: where the payload starts)
    24  8  plain_bytes: the weights' size (the library's PREFIX_weights_info)
    32  8  stored_bytes: the payload's size in the file (plain_bytes, or with one 16-byte tag per chunk)
    40  8  chunk_bytes: plaintext bytes per encrypted chunk (0 when not encrypted)
    48 32  SHA-256 of the plaintext weights (the library embeds the same digest and refuses another)
    80 48  zero; then zero up to header_bytes

The plaintext is the generic kernels' weights, then (at a 64-byte aligned offset the library knows) the
opt-point kernels' own weights when they differ.

Encryption: the plaintext in chunks of ``chunk_bytes`` (16 MiB; ``cryptography``'s AES-GCM takes at most
2 GiB at once, and a chunk is decrypted straight into its place), each sealed with AES-256-GCM under a key
derived from the user's key (HMAC-SHA256, one derived key per purpose). The associated data of chunk ``i``
is the header's first 128 bytes (every field above, the plaintext digest included), the digest the library
expects, ``i`` and whether it is the last chunk: a chunk cut off, moved, or taken from another file, and a
header edited, all fail authentication. The 96-bit nonce of chunk ``i`` is ``HMAC(k_nonce, digest || i)``,
so the same key, weights and compiler give a byte-identical file (reproducible builds). Safe: a nonce repeats
only for the same chunk index of the same plaintext under the same key, i.e. for the same (key, nonce,
plaintext) triple, which gives the same ciphertext and reveals only that two files hold equal weights;
different plaintexts get independent pseudo-random nonces (a collision after ~2^48 chunks under one key).
"""
from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import struct
import tempfile
from typing import Optional, Union

import attrs

from ...errors import CuvilError

MAGIC = b"CUVILWTS"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
FIXED_BYTES = 128          # the header's fields; the rest of it is zero
CHUNK_BYTES = 16 << 20
TAG_BYTES = 16
KEY_BYTES = 32
FLAG_ENCRYPTED = 1
_FIELDS = struct.Struct("<8sIIQQQQ32s")

class WeightsRefused(CuvilError):
    """Weights that are not the library's: another model's or build's, or altered, or under another key (the
    audit log records such a load as ``refused``, not ``error``)."""


KeyLike = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]

_KEY_HINT = ("make one with `cuvil weights-key KEYFILE` (32 random bytes as 64 hex characters; keep it away from "
             "the artifact)")


def weights_path(so_path: str) -> str:
    """``libnet.weights`` for ``libnet.so``."""
    base = so_path[:-3] if so_path.endswith(".so") else so_path
    return base + ".weights"


def pad64(n: int) -> int:
    return (n + 63) & ~63


@attrs.frozen
class WeightsHeader:
    version: int
    flags: int
    header_bytes: int
    plain_bytes: int
    stored_bytes: int
    chunk_bytes: int
    sha256: bytes

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    def pack(self) -> bytes:
        fixed = _FIELDS.pack(MAGIC, self.version, self.flags, self.header_bytes, self.plain_bytes,
                             self.stored_bytes, self.chunk_bytes, self.sha256)
        return fixed.ljust(self.header_bytes, b"\0")


def _chunks(plain_bytes: int, chunk_bytes: int) -> int:
    return max(1, -(-plain_bytes // chunk_bytes))


# -- keys ------------------------------------------------------------------------------------------------

def read_key(key: KeyLike, what: str = "weights_key") -> bytes:
    """The 32-byte AES-256 key ``key`` names: raw bytes (32), or a key file holding 32 raw bytes or 64 hex
    characters (whitespace around them ignored)."""
    if isinstance(key, WeightsKey):
        return key.key
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        if len(raw) == KEY_BYTES:
            return raw
        try:
            text = raw.decode("ascii").strip()
            if len(text) == 2 * KEY_BYTES:
                return bytes.fromhex(text)
        except ValueError:
            pass
        raise CuvilError(f"{what}: a key is 32 bytes (or 64 hex characters), got {len(raw)} bytes",
                         hint=f"give the key file's path, or its 32 bytes; {_KEY_HINT}")
    try:
        path = os.fspath(key)
    except TypeError:
        raise CuvilError(f"{what}: give a key file's path or the key's 32 bytes, got a {type(key).__name__}",
                         hint=_KEY_HINT) from None
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as e:
        raise CuvilError(f"{what}: cannot read the key file {path}: {e.strerror or e}", hint=_KEY_HINT) from None
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    try:
        if len(text) == 2 * KEY_BYTES:
            return bytes.fromhex(text.decode("ascii"))
    except ValueError:
        pass
    raise CuvilError(f"{path}: not a key file (32 raw bytes or 64 hex characters; it holds {len(data)} bytes)",
                     hint=_KEY_HINT)


def new_key_file(path: str) -> None:
    """Write a fresh random key to ``path`` as 64 hex characters and a newline, readable by its owner only;
    an existing file is never overwritten."""
    key = os.urandom(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CuvilError(f"{path} exists: a key file is never overwritten (weights encrypted with it would be lost)",
                         hint="give another path, or delete the old key first if nothing needs it") from None
    except OSError as e:
        raise CuvilError(f"cannot create {path}: {e.strerror or e}", hint="give a path in a writable directory") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")


class WeightsKey:
    """An AES-256 key for weights files, read once (:func:`read_key`). Its ``repr`` (what a build's provenance
    and any log see) is its :func:`key_id`: never the key, nor the path it was read from."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise CuvilError(f"a weights key is {KEY_BYTES} bytes, got {len(key)}", hint=_KEY_HINT)
        self._key = bytes(key)

    @classmethod
    def of(cls, key: Union["WeightsKey", KeyLike], what: str = "weights_key") -> "WeightsKey":
        return key if isinstance(key, WeightsKey) else cls(read_key(key, what))

    @property
    def key(self) -> bytes:
        return self._key

    @property
    def id(self) -> str:
        return key_id(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, WeightsKey) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"WeightsKey(id={self.id})"


def _derive(key: bytes, purpose: bytes) -> bytes:
    return hmac.new(key, b"cuvil-weights-v1\0" + purpose, hashlib.sha256).digest()


def key_id(key: bytes) -> str:
    """A name for ``key`` that reveals nothing of it (the artifact cache keys encrypted builds by it)."""
    return _derive(key, b"key id").hex()[:32]


def _nonce(key: bytes, digest: bytes, index: int) -> bytes:
    return hmac.new(_derive(key, b"nonce"), digest + struct.pack("<Q", index), hashlib.sha256).digest()[:12]


def _aad(header: bytes, expected: bytes, index: int, last: bool) -> bytes:
    return header[:FIXED_BYTES] + expected + struct.pack("<QB", index, int(last))


def _aesgcm(key: bytes):
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise CuvilError("encrypted weights need the `cryptography` package",
                         hint="pip install 'cuvil[encrypt]' (or pip install cryptography)") from None
    return AESGCM(_derive(key, b"aes-256-gcm"))


# -- writing ---------------------------------------------------------------------------------------------

def write_weights(path: str, plain: bytes, key: Optional[bytes] = None) -> WeightsHeader:
    """Write ``plain`` to ``path`` in the format above (encrypted with ``key`` when given), atomically."""
    digest = hashlib.sha256(plain).digest()
    n = len(plain)
    if key is None:
        header = WeightsHeader(FORMAT_VERSION, 0, HEADER_BYTES, n, n, 0, digest)
        head = header.pack()
        parts = [plain]
    else:
        chunks = _chunks(n, CHUNK_BYTES)
        header = WeightsHeader(FORMAT_VERSION, FLAG_ENCRYPTED, HEADER_BYTES, n, n + chunks * TAG_BYTES,
                               CHUNK_BYTES, digest)
        head = header.pack()
        aes, view = _aesgcm(key), memoryview(plain)
        parts = [aes.encrypt(_nonce(key, digest, i), view[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES],
                             _aad(head, digest, i, i == chunks - 1)) for i in range(chunks)]
    out_dir = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".cuvil-", suffix=".weights.tmp", dir=out_dir)
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(head)
            for p in parts:
                f.write(p)
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return header


# -- reading ---------------------------------------------------------------------------------------------

def parse_header(data, name: str) -> WeightsHeader:
    """The header of a weights file whose contents are ``data`` (bytes-like), after checking it and the
    file's length; ``name`` names the file in errors."""
    again = "copy libNAME.weights again from the build that made the library, or compile the model again"
    if len(data) < FIXED_BYTES or bytes(data[:8]) != MAGIC:
        raise CuvilError(f"{name}: not a Cuvil weights file (no {MAGIC.decode()} header)", hint=again)
    _, version, flags, hb, plain, stored, chunk, digest = _FIELDS.unpack_from(data, 0)
    if version != FORMAT_VERSION:
        raise CuvilError(f"{name}: weights format version {version}, this Cuvil reads {FORMAT_VERSION}",
                         hint="load it with the Cuvil version that compiled it, or compile the model again")
    h = WeightsHeader(version, flags, hb, plain, stored, chunk, digest)
    ok = (flags & ~FLAG_ENCRYPTED) == 0 and hb >= FIXED_BYTES and hb % 64 == 0
    if ok and h.encrypted:
        ok = chunk > 0 and stored == plain + _chunks(plain, chunk) * TAG_BYTES
    elif ok:
        ok = chunk == 0 and stored == plain
    if not ok:
        raise CuvilError(f"{name}: damaged weights header", hint=again)
    if len(data) != hb + stored:
        what = "truncated" if len(data) < hb + stored else "has trailing bytes"
        raise CuvilError(f"{name}: {len(data)} bytes, the header says {hb + stored}: the file {what}", hint=again)
    return h


def check_matches(h: WeightsHeader, nbytes: int, digest: bytes, name: str, lib: str) -> None:
    """Refuse a weights file whose header names other weights than the library ``lib`` expects."""
    if h.plain_bytes != nbytes or h.sha256 != digest:
        raise WeightsRefused(f"{name}: weights of another model or build ({h.plain_bytes} B, SHA-256 {h.sha256.hex()[:16]}..."
                         f"); {lib} expects {nbytes} B, SHA-256 {digest.hex()[:16]}...",
                         hint=f"use the .weights file compiled together with {lib} (cuvil compile writes both)")


def private_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous private memory for decrypted weights: page-aligned, never backed by a file, left out of core
    dumps, in huge pages where the kernel has them (the kernels stream the weights: 4 KiB pages made a 64 MiB
    GEMV 1.3x slower than the same weights mapped from a file written in 2 MiB writes)."""
    mm = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_DONTDUMP", "MADV_HUGEPAGE"):
        if hasattr(mmap, advice):
            try:
                mm.madvise(getattr(mmap, advice))
            except OSError:
                pass
    return mm


def decrypt_into(data, h: WeightsHeader, key: bytes, expected: bytes, out, name: str) -> None:
    """Decrypt the payload of ``data`` (the whole file's contents) into ``out`` (a writable buffer of
    ``h.plain_bytes``), chunk by chunk; a wrong key or any altered byte fails authentication."""
    aes, view = _aesgcm(key), memoryview(data)
    head = bytes(view[:FIXED_BYTES])
    try:
        _decrypt_chunks(aes, view, head, h, key, expected, out, name)
    finally:
        view.release()        # the caller may close the file's mapping, also after a failure


def _decrypt_chunks(aes, view, head, h, key, expected, out, name) -> None:
    from cryptography.exceptions import InvalidTag

    chunks = _chunks(h.plain_bytes, h.chunk_bytes)
    pos = h.header_bytes
    for i in range(chunks):
        n = min(h.chunk_bytes, h.plain_bytes - i * h.chunk_bytes)
        sealed = view[pos:pos + n + TAG_BYTES]
        try:
            plain = aes.decrypt(_nonce(key, h.sha256, i), sealed, _aad(head, expected, i, i == chunks - 1))
        except InvalidTag:
            sealed.release()
            raise WeightsRefused(f"{name}: authentication failed: the key is not the one the weights were encrypted "
                             f"with, or the file was altered (chunk {i} of {chunks})",
                             hint="give weights_key= the key file given to --encrypt-weights at compile time; if "
                                  "it is that key, the .weights file is damaged or tampered with: copy it again "
                                  "from the build") from None
        sealed.release()
        out[i * h.chunk_bytes:i * h.chunk_bytes + n] = plain
        del plain
        pos += n + TAG_BYTES
