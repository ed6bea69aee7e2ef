"""Signed artifacts (issue 24, part 1): a key pair, a signature over every file of an artifact, and a check
that hands back the very bytes it checked.

    cuvil.signing.keygen("key.pem", "pub.pem")        # EC P-256, PEM; the private key file mode 0600
    cuvil.sign("build/libnet.so", "key.pem")          # writes build/libnet.sig
    v = cuvil.verify_artifact("build/libnet.so", "pub.pem")   # SignatureError if it does not hold
    m = cuvil.load("build/libnet.so", verify="pub.pem")       # loads the bytes verify_artifact read

The signature is in the OpenSSF model-signing format (the ``model-signing`` package, key-based signing; no
network): a Sigstore bundle (JSON) whose DSSE envelope carries an in-toto statement; the statement's
predicate lists each file of the artifact with its SHA-256 (``resources``) and its subject is the digest
over them (:mod:`cuvil.supply_chain.digests`). Which files an artifact has:

- x86, ``DIR/libNAME.so``: the library and each of its sidecars that exists
  (:func:`cuvil.targets.x86.artifact.sidecars`: header, manifest, and the SBOM, provenance and external
  weights where written); the signature is ``DIR/libNAME.sig``. Other files of ``DIR`` (other models) are
  no part of it.
- GPU, ``NAME.cuvil/``: every file in the directory; the signature is ``NAME.cuvil/model.sig``.

Verification (:func:`verify_artifact`) reads each file once into memory, checks the signature with the
public key, then the SHA-256 of those bytes against the signed ones, and refuses (:class:`SignatureError`)
an unsigned artifact, a signature by another key, an altered signature, and any file altered, missing, or
present but unsigned (a sidecar added after signing; any extra file of a bundle). :func:`cuvil.load` with
``verify=`` loads from the returned bytes, never from the disk again.

A signature made here verifies with model-signing's own tools too: ``model_signing verify key DIR
--signature DIR/libNAME.sig --public_key pub.pem --ignore_unsigned_files`` (a bundle without the last
flag). model-signing is an extra: ``pip install 'cuvil[sign]'``.
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Dict, List, Optional, Union

import attrs

from . import audit
from .errors import CuvilError
from .supply_chain.digests import PlainFileError, directory_files, file_digests, read_plain, root_digest, sha256_file
from .targets.ptx.bundle import BUNDLE_SUFFIX, PROVENANCE_FILE, SIGNATURE_FILE, is_bundle
from .targets.x86.artifact import sidecars

#: What to install for signing and verification.
INSTALL_HINT = "pip install 'cuvil[sign]' (model-signing and cryptography)"
#: The curve of the keys keygen makes (model-signing's key signer takes NIST P-256, P-384 and P-521).
CURVE = "secp256r1"

PathLike = Union[str, os.PathLike]


class SignatureError(CuvilError):
    """An artifact that a signature check refuses: unsigned, signed by another key, an altered signature, or
    a file altered, missing or not signed. ``reason`` is one of ``unsigned``, ``wrong-key``,
    ``bad-signature``, ``altered``, ``missing``, ``extra``, ``link`` (a file replaced by a symbolic link),
    ``special`` (a FIFO, socket, device or directory where a file belongs)."""

    def __init__(self, message: str, reason: str, hint: Optional[str] = None, details=()):
        super().__init__(message, hint=hint, details=details)
        self.reason = reason


@attrs.frozen
class VerifiedArtifact:
    """What :func:`verify_artifact` checked: ``files`` maps each file's name (relative to ``root``) to the
    bytes whose digest the signature holds; ``digest`` names the artifact (SHA-256 of the library for x86, of
    the digest manifest for a bundle)."""
    path: str
    kind: str                       # "x86" or "bundle"
    root: str                       # the directory the names are relative to
    files: Dict[str, bytes]
    digest: str
    signature: str

    @property
    def names(self) -> List[str]:
        return sorted(self.files)


def _model_signing():
    try:
        from model_signing import manifest
        from model_signing._hashing import hashing
        from model_signing._signing import sign_ec_key, sign_sigstore_pb, signing
    except ImportError as e:
        raise CuvilError(f"signing needs the model-signing package, which is not installed ({e})",
                         hint=INSTALL_HINT) from None
    return manifest, hashing, sign_ec_key, sign_sigstore_pb, signing


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError:
        raise CuvilError("signing needs the cryptography package, which is not installed",
                         hint=INSTALL_HINT) from None
    return serialization, ec


# -- what an artifact is made of ---------------------------------------------------------------------

def _kind(path: str) -> str:
    if os.path.isdir(path):
        if is_bundle(path) or path.rstrip(os.sep).endswith(BUNDLE_SUFFIX):
            return "bundle"
        raise CuvilError(f"{path}: a directory, not a GPU bundle (NAME{BUNDLE_SUFFIX}/)",
                         hint="give a library libNAME.so or a bundle directory NAME.cuvil")
    if os.path.isfile(path) and path.endswith(".so"):
        return "x86"
    if not os.path.exists(path):
        raise CuvilError(f"{path}: no such file or directory",
                         hint="give a compiled libNAME.so or NAME.cuvil bundle (cuvil compile MODEL -o "
                              "build/libNAME.so writes one)")
    raise CuvilError(f"{path}: not an artifact (a libNAME.so library or a NAME.cuvil bundle directory)",
                     hint="give the library libNAME.so: its header, manifest and other sidecars go with it")


def signature_path(path: PathLike) -> str:
    """Where the signature of artifact ``path`` is: ``libNAME.sig`` beside ``libNAME.so``,
    ``NAME.cuvil/model.sig`` inside a bundle."""
    path = os.fspath(path).rstrip(os.sep)
    if _kind(path) == "bundle":
        return os.path.join(path, SIGNATURE_FILE)
    return os.path.splitext(path)[0] + ".sig"


def _root_and_names(path: str, kind: str):
    """(root directory, {name: absolute path}) of the files the artifact has now. An x86 sidecar is listed
    when anything is there under its name (a link or a FIFO too: reading it refuses it)."""
    if kind == "bundle":
        root = os.path.abspath(path)
        names = directory_files(root, exclude=(SIGNATURE_FILE,))
    else:
        root = os.path.dirname(os.path.abspath(path))
        names = [os.path.basename(path)] + [os.path.basename(p) for p in sidecars(path).values()
                                            if os.path.lexists(p)]
    return root, {n: os.path.join(root, n) for n in sorted(names)}


def artifact_files(path: PathLike, *, provenance: bool = True) -> Dict[str, str]:
    """The files of the artifact at ``path``, ``{name: path}`` sorted by name: ``libNAME.so`` and each of
    its sidecars that exists (:func:`cuvil.targets.x86.artifact.sidecars`), named as in its directory; or
    every file of a bundle ``NAME.cuvil/``, named relative to it. The signature is never one of them: these
    are the files a signature covers. ``provenance=False`` leaves the provenance statement out (what its
    subjects are). A symbolic link or a special file among them is refused (:class:`SignatureError`,
    reason ``link`` / ``special``), as signing and verifying refuse it."""
    path = os.fspath(path).rstrip(os.sep)
    kind = _kind(path)
    files = _root_and_names(path, kind)[1]
    for name, p in files.items():
        _check_plain(name, p, path)
    if not provenance:
        prov = os.path.basename(sidecars(path)["intoto"]) if kind == "x86" else PROVENANCE_FILE
        files.pop(prov, None)
    return files


def _check_plain(name: str, p: str, what: str) -> None:
    if os.path.islink(p):
        raise _not_plain(name, "link", what)
    if not os.path.isfile(p):
        raise _not_plain(name, "special", what)


def _not_plain(name: str, kind: str, what: str) -> SignatureError:
    if kind == "link":
        return SignatureError(f"{what}: {name} is a symbolic link; a signed artifact holds plain files only",
                              "link", hint="replace the link by the file it points to (and sign again)")
    return SignatureError(f"{what}: {name} is not a regular file (a FIFO, socket, device or directory); a signed "
                          f"artifact holds plain files only", "special",
                          hint="remove it, or put the file it stands for in its place (and sign again)")


def artifact_digest(path: PathLike) -> str:
    """The artifact's name in the audit log: SHA-256 (hex) of an x86 library; of the digest manifest of a
    bundle (every file but the signature)."""
    path = os.fspath(path).rstrip(os.sep)
    if _kind(path) == "x86":
        return sha256_file(path)
    return root_digest({n: sha256_file(p) for n, p in artifact_files(path).items()})


def _read_all(files: Dict[str, str], what: str) -> Dict[str, bytes]:
    out = {}
    for name, p in files.items():
        try:
            out[name] = read_plain(p)         # never through a link, never waiting on a FIFO: one open, no race
        except PlainFileError as e:
            raise _not_plain(name, e.kind, what) from None
        except OSError as e:
            raise SignatureError(f"{what}: cannot read {name}: {e.strerror}", "missing",
                                 hint="do not use this artifact: get it again from its publisher") from None
    return out


# -- keys ----------------------------------------------------------------------------------------------

def keygen(private: PathLike, public: PathLike, force: bool = False) -> None:
    """Write a new EC P-256 key pair as PEM: ``private`` (PKCS#8, unencrypted, mode 0600) and ``public``
    (SubjectPublicKeyInfo). Existing files are kept unless ``force``."""
    serialization, ec = _crypto()
    private, public = os.fspath(private), os.fspath(public)
    if os.path.abspath(private) == os.path.abspath(public):
        raise CuvilError(f"--private and --public are both {private}", hint="give two files: key.pem and pub.pem")
    if not force:
        there = [p for p in (private, public) if os.path.lexists(p)]
        if there:
            raise CuvilError(f"{', '.join(there)} already exist{'s' if len(there) == 1 else ''}; not overwriting a key",
                             hint="choose other paths, or pass --force (Python: force=True) to replace them; "
                                  "artifacts signed with the old key then need the old public key to verify")
    key = ec.generate_private_key(ec.SECP256R1())
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_atomic(private, priv, 0o600)
    _write_atomic(public, pub, 0o644)


def _write_atomic(path: str, data: bytes, mode: int) -> None:
    """``data`` into ``path`` through a new file of mode ``mode`` renamed over it (never a moment where the
    file exists with looser permissions, or half written)."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cuvil-", dir=d)
    except OSError as e:
        raise CuvilError(f"cannot write {path}: {e.strerror}", hint="choose a writable directory") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _public_key(key):
    """A public key from a PEM file path, PEM bytes or a cryptography key object."""
    serialization, ec = _crypto()
    if isinstance(key, ec.EllipticCurvePublicKey):
        return key
    if isinstance(key, (str, os.PathLike)):
        p = os.fspath(key)
        try:
            with open(p, "rb") as f:
                pem = f.read()
        except OSError as e:
            raise CuvilError(f"public key {p}: {e.strerror}",
                             hint="give the PUB.pem that `cuvil keygen` wrote beside the private key") from None
        what = p
    elif isinstance(key, (bytes, bytearray)):
        pem, what = bytes(key), "the public key given"
    else:
        raise CuvilError(f"verify= takes a public key file, PEM bytes or an EC public key, not {type(key).__name__}",
                         hint="verify='pub.pem'")
    if b"PRIVATE KEY" in pem:
        raise CuvilError(f"{what} is a private key; verification takes the public key",
                         hint="give PUB.pem (cuvil keygen --private KEY.pem --public PUB.pem wrote both); keep the "
                              "private key with whoever signs")
    try:
        pk = serialization.load_pem_public_key(pem)
    except ValueError as e:
        raise CuvilError(f"{what}: not a PEM public key ({e})", hint="give the PUB.pem `cuvil keygen` wrote") from None
    if not isinstance(pk, ec.EllipticCurvePublicKey) or pk.curve.name not in ("secp256r1", "secp384r1", "secp521r1"):
        raise CuvilError(f"{what}: not an EC P-256/P-384/P-521 public key, the keys model-signing verifies",
                         hint="make a key pair with cuvil keygen --private KEY.pem --public PUB.pem")
    return pk


# -- signing -------------------------------------------------------------------------------------------

def sign(path: PathLike, key: PathLike, password: Optional[str] = None) -> str:
    """Sign artifact ``path`` (``libNAME.so`` or ``NAME.cuvil``) with the PEM private key file ``key``;
    returns the signature's path (:func:`signature_path`). The signature covers every file of the artifact
    as it is now (:func:`artifact_files`)."""
    manifest, hashing, sign_ec_key, _, signing = _model_signing()
    path = os.fspath(path).rstrip(os.sep)
    kind = _kind(path)
    root, names = _root_and_names(path, kind)
    sig = signature_path(path)
    try:
        data = _read_all(names, path)
        digests = file_digests(data)
        try:
            signer = sign_ec_key.Signer(pathlib.Path(key), password)
        except FileNotFoundError:
            raise CuvilError(f"private key {os.fspath(key)}: no such file",
                             hint="make a key pair first: cuvil keygen --private KEY.pem --public PUB.pem") from None
        except (ValueError, TypeError) as e:
            raise CuvilError(f"private key {os.fspath(key)}: cannot use it to sign: {e}",
                             hint="give the EC (P-256) private key in PEM that cuvil keygen --private KEY.pem "
                                  "wrote (an encrypted key: Python sign(..., password=...))") from None
        serialization = manifest.SerializationType.from_args(
            {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
             **({"ignore_paths": [SIGNATURE_FILE]} if kind == "bundle" else {})})
        items = [manifest.FileManifestItem(path=pathlib.PurePosixPath(n), digest=hashing.Digest("sha256",
                                                                                              bytes.fromhex(h)))
                 for n, h in sorted(digests.items())]
        model_name = os.path.basename(path) if kind == "bundle" else os.path.splitext(os.path.basename(path))[0]
        signature = signer.sign(signing.Payload(manifest.Manifest(model_name, items, serialization)))
        _write_atomic(sig, signature.bundle.to_json().encode("utf-8"), 0o644)
    except CuvilError as e:
        audit.record("sign", artifact=path, digest=lambda: artifact_digest(path), outcome="error", reason=e.message)
        raise
    audit.record("sign", artifact=path, digest=_name_digest(kind, path, digests), files=len(digests))
    return sig


def _name_digest(kind: str, path: str, digests: Dict[str, str]) -> str:
    return digests[os.path.basename(path)] if kind == "x86" else root_digest(digests)


# -- verification ----------------------------------------------------------------------------------------

def verify_artifact(path: PathLike, key) -> VerifiedArtifact:
    """Check artifact ``path`` against its signature with ``key`` (a PEM public key file, PEM bytes or a
    cryptography EC public key). Returns the :class:`VerifiedArtifact` (the bytes checked); raises
    :class:`SignatureError` saying why not (CuvilError for a key that cannot be read)."""
    path = os.fspath(path).rstrip(os.sep)
    kind = _kind(path)
    try:
        v = _verify(path, kind, key)
    except SignatureError as e:
        audit.record("verify", artifact=path, digest=lambda: artifact_digest(path), outcome="refused",
                     reason=f"{e.reason}: {e.message}")
        raise
    audit.record("verify", artifact=path, digest=v.digest, files=len(v.files))
    return v


def _verify(path: str, kind: str, key) -> VerifiedArtifact:
    manifest, hashing, sign_ec_key, sign_sigstore_pb, signing = _model_signing()
    pk = _public_key(key)
    sig = signature_path(path)
    resign = f"sign it: cuvil sign {path} --key KEY.pem (or get the signature its publisher made)"
    if not os.path.lexists(sig):
        raise SignatureError(f"{path}: unsigned (no signature {os.path.basename(sig)})", "unsigned", hint=resign)
    sig_bytes = _read_all({os.path.basename(sig): sig}, path)[os.path.basename(sig)]
    root, names = _root_and_names(path, kind)
    data = _read_all(names, path)                     # each file read once: these bytes are checked and used

    class _Verifier(sign_ec_key.Verifier):           # model-signing's verifier, with a key already in memory
        def __init__(self, public_key):
            self._public_key = public_key

    try:
        signature = _parse_signature(sig_bytes, sign_sigstore_pb)
        expected = _Verifier(pk).verify(signature)
    except Exception as e:  # noqa: BLE001 - model-signing raises ValueError, KeyError, InvalidSignature, ...
        text = str(e) or type(e).__name__
        if "Key mismatch" in text:
            raise SignatureError(f"{path}: signed with another key than the one given", "wrong-key",
                                 hint="verify with the public key of whoever signed it (their PUB.pem); if it "
                                      "should be yours, sign it again with your KEY.pem") from None
        lines = text.splitlines()            # a parser's report can run to many lines: the first in the message
        raise SignatureError(f"{path}: the signature {os.path.basename(sig)} does not verify ({lines[0]})",
                             "bad-signature", hint=f"the signature or what it signs was altered: get the "
                             f"artifact again from its publisher, or {resign}", details=lines[1:]) from None
    ser = expected.serialization_type
    if ser.get("method") != "files" or ser.get("hash_type") != "sha256":
        raise SignatureError(f"{path}: signed with model-signing's {ser.get('method')}/{ser.get('hash_type')} "
                             f"serialization; Cuvil verifies files/sha256", "bad-signature", hint=resign)
    signed = {rd.identifier: rd.digest.digest_hex for rd in expected.resource_descriptors()
              if rd.digest.algorithm == "sha256"}
    actual = file_digests(data)
    missing = sorted(set(signed) - set(actual))
    extra = sorted(set(actual) - set(signed))
    altered = sorted(n for n in set(signed) & set(actual) if signed[n] != actual[n])
    problems = ([f"altered: {n}" for n in altered] + [f"missing: {n}" for n in missing]
                + [f"not signed: {n}" for n in extra])
    if problems:
        reason = "altered" if altered else "missing" if missing else "extra"
        first = altered[0] if altered else missing[0] if missing else extra[0]
        what = {"altered": f"{first} was altered after signing",
                "missing": f"{first} is missing (it was signed)",
                "extra": f"{first} is not covered by the signature (added after signing)"}[reason]
        raise SignatureError(f"{path}: {what}", reason, details=problems,
                             hint="do not use this artifact: get it again from its publisher (or compile and "
                                  f"sign it again: cuvil sign {path} --key KEY.pem)")
    return VerifiedArtifact(path=path, kind=kind, root=root, files=data, digest=_name_digest(kind, path, actual),
                            signature=sig)


def _parse_signature(raw: bytes, sign_sigstore_pb):
    """model-signing's ``Signature.read``, from bytes already read (the same normalisation)."""
    from sigstore_models.bundle import v1 as bundle_pb
    d = json.loads(raw.decode("utf-8"))
    # DSSE leaves an envelope's keyid outside what is signed; model-signing's key signer writes one signature
    # with keyid "". Anything else is a signature file edited after signing: refused, not ignored.
    sigs = d["dsseEnvelope"]["signatures"]
    if len(sigs) != 1 or sigs[0].get("keyid", "") != "":
        raise ValueError("the envelope's unsigned keyid or signature list was edited")
    vm = d["verificationMaterial"]
    vm.setdefault("tlogEntries", [])
    if "publicKey" in vm:
        vm["publicKey"].setdefault("hint", None)
        for k in ("rawBytes", "keyDetails"):
            vm["publicKey"].pop(k, None)
    return sign_sigstore_pb.Signature(bundle_pb.Bundle.from_dict(d))


def ok_line(v: VerifiedArtifact) -> str:
    """One line naming what a verification covered."""
    return f"OK {v.path}: signature {os.path.basename(v.signature)} holds for {len(v.files)} files " \
           f"({', '.join(v.names)})"


__all__ = ["SignatureError", "VerifiedArtifact", "keygen", "sign", "verify_artifact", "signature_path",
           "artifact_files", "artifact_digest", "ok_line"]
