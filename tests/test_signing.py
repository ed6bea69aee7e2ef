"""Signed artifacts (issue 24, part 1): keygen, sign, verify-artifact and cuvil.load(verify=).

Acceptance: each file of a signed artifact tampered with (one byte of code in the .so, one byte of the weights
embedded in it, the manifest, the header, the SBOM/provenance/external weights where they exist) is refused by
both `cuvil verify-artifact` and `cuvil.load(verify=)`; a replaced public key and an artifact re-signed with
another key are refused; x86 and GPU bundles round-trip; the load runs the bytes verified, not what the disk
holds afterwards. One small model is compiled once per module (the demo CNN)."""
import json
import os
import pathlib
import shutil
import struct
import sys

import numpy as np
import pytest

pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install 'cuvil[sign]')")

import cuvil  # noqa: E402
from cuvil import Pipeline, signing  # noqa: E402
from cuvil.cli import main as cli_main  # noqa: E402
from cuvil.errors import CuvilError  # noqa: E402
from cuvil.signing import SignatureError  # noqa: E402
from cuvil.supply_chain.digests import root_digest  # noqa: E402
from cuvil.targets.x86.artifact import sidecars  # noqa: E402

DEMO = os.path.join(os.path.dirname(cuvil.__file__), "data", "demo_cnn.onnx")


@pytest.fixture(scope="module")
def compiled():
    return Pipeline.from_onnx(DEMO).compile()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    cuvil.keygen(d / "key.pem", d / "pub.pem")
    cuvil.keygen(d / "key2.pem", d / "pub2.pem")
    return d


@pytest.fixture
def signed(compiled, keys, tmp_path):
    """A fresh signed copy of the demo library in its own folder."""
    so = compiled.save(tmp_path / "libdemo.so")
    cuvil.sign(so, keys / "key.pem")
    return so


def _input(m):
    shape = [d if isinstance(d, int) else 2 for d in m.inputs[0].shape]
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# -- where things are in an ELF file (code, the embedded weights) -------------------------------------------

def _elf_sections(data: bytes) -> list:
    """[(name, addr, offset, size)] of a little-endian ELF64 file."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = raw[shstrndx][4]
    name = lambda off: data[strtab + off:data.index(b"\0", strtab + off)].decode()  # noqa: E731
    return [(name(s[0]), s[3], s[4], s[5], s) for s in raw]


def _code_offset(data: bytes) -> int:
    (off, size), = [(o, n) for name, _, o, n, _ in _elf_sections(data) if name == ".text"]
    return off + size // 2


def _weights_offset(data: bytes) -> int:
    """The file offset of the first byte of the weights embedded in the library (symbol ``cuvil_weights``)."""
    secs = _elf_sections(data)
    (symtab,) = [s for s in secs if s[0] == ".symtab"]
    strtab = secs[symtab[4][6]][2]             # sh_link: the symbol names' string table
    for k in range(symtab[3] // 24):
        st_name, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, symtab[2] + 24 * k)
        if data[strtab + st_name:data.index(b"\0", strtab + st_name)] == b"cuvil_weights":
            _, addr, off, _, _ = secs[st_shndx]
            return off + (st_value - addr)
    raise AssertionError("no cuvil_weights symbol")


def _flip(path, offset=None):
    """One bit of ``path`` flipped, in a new file renamed over it (a library this process has mapped keeps its
    pages: rewriting it in place would truncate them under the mapping)."""
    data = bytearray(pathlib.Path(path).read_bytes())
    k = len(data) // 2 if offset is None else offset
    data[k] ^= 0x01
    _replace(path, bytes(data))


def _replace(path, data: bytes):
    pathlib.Path(f"{path}.new").write_bytes(data)
    os.replace(f"{path}.new", path)


def _refused_both_ways(so, pub, reason, capsys):
    with pytest.raises(SignatureError) as e:
        cuvil.load(so, verify=pub)
    assert e.value.reason == reason and e.value.hint
    assert cli_main(["verify-artifact", str(so), "--key", str(pub)]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "next:" in err
    return e.value


# -- keys ---------------------------------------------------------------------------------------------------

def test_keygen_writes_a_private_key_only_its_owner_reads_and_keeps_existing_keys(tmp_path):
    cuvil.keygen(tmp_path / "k.pem", tmp_path / "p.pem")
    assert os.stat(tmp_path / "k.pem").st_mode & 0o777 == 0o600
    assert b"BEGIN PUBLIC KEY" in (tmp_path / "p.pem").read_bytes()
    before = (tmp_path / "k.pem").read_bytes()
    with pytest.raises(CuvilError, match="not overwriting") as e:
        cuvil.keygen(tmp_path / "k.pem", tmp_path / "p.pem")
    assert "--force" in e.value.hint and (tmp_path / "k.pem").read_bytes() == before
    cuvil.keygen(tmp_path / "k.pem", tmp_path / "p.pem", force=True)
    assert (tmp_path / "k.pem").read_bytes() != before
    assert os.stat(tmp_path / "k.pem").st_mode & 0o777 == 0o600


# -- round trips --------------------------------------------------------------------------------------------

def test_x86_round_trip_loads_the_verified_library(signed, keys, capsys):
    assert os.path.isfile(signing.signature_path(signed)) and signing.signature_path(signed).endswith("libdemo.sig")
    v = cuvil.verify_artifact(signed, keys / "pub.pem")
    assert set(v.files) == {"libdemo.so", "libdemo.h", "libdemo.manifest.json"} | {
        os.path.basename(p) for p in sidecars(signed).values() if os.path.exists(p)}
    m = cuvil.load(signed, verify=keys / "pub.pem")
    assert m._mapped.startswith("/proc/self/fd/")
    x = _input(m)
    np.testing.assert_array_equal(m.run(x)[0], cuvil.load(signed).run(x)[0])
    assert cli_main(["verify-artifact", signed, "--key", str(keys / "pub.pem")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "libdemo.so" in out and "libdemo.manifest.json" in out


def test_the_signature_is_model_signing_format_and_its_own_verifier_accepts_it(signed, keys):
    from model_signing import verifying
    verifying.Config().use_elliptic_key_verifier(public_key=keys / "pub.pem").set_ignore_unsigned_files(
        True).verify(pathlib.Path(signed).parent, signing.signature_path(signed))
    import base64
    bundle = json.loads(pathlib.Path(signing.signature_path(signed)).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    digests = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert statement["subject"][0]["digest"]["sha256"] == root_digest(digests)


def test_other_models_in_the_same_folder_are_no_part_of_an_artifact(signed, keys):
    folder = pathlib.Path(signed).parent
    for key, p in sidecars(signed).items():            # a second model beside it, signed on its own
        if os.path.exists(p):
            shutil.copyfile(p, sidecars(str(folder / "libother.so"))[key])
    shutil.copyfile(signed, folder / "libother.so")
    (folder / "notes.txt").write_text("unrelated")
    cuvil.sign(folder / "libother.so", keys / "key.pem")
    assert "libother.so" not in cuvil.verify_artifact(signed, keys / "pub.pem").files
    cuvil.verify_artifact(folder / "libother.so", keys / "pub.pem")
    # another model's signature under this one's name covers that model's files, not these
    shutil.copyfile(folder / "libother.sig", folder / "libdemo.sig")
    with pytest.raises(SignatureError) as e:
        cuvil.verify_artifact(signed, keys / "pub.pem")
    assert e.value.reason in ("altered", "missing", "extra")


# -- refusals -----------------------------------------------------------------------------------------------

TAMPERED = ["code", "weights", "manifest", "header", "sbom", "provenance"]   # external weights: below


@pytest.mark.parametrize("what", TAMPERED)
def test_one_byte_changed_in_any_file_is_refused(what, signed, keys, capsys):
    cars = sidecars(signed)
    data = pathlib.Path(signed).read_bytes()
    target, offset = {"code": (signed, _code_offset(data)), "weights": (signed, _weights_offset(data)),
                      "manifest": (cars["manifest"], None), "header": (cars["h"], None),
                      "sbom": (cars.get("cdx"), None), "provenance": (cars.get("intoto"), None)}[what]
    if target is None or not os.path.exists(target):
        pytest.skip(f"this compile writes no {what} file (another part of issue 24)")
    _flip(target, offset)
    e = _refused_both_ways(signed, keys / "pub.pem", "altered", capsys)
    assert os.path.basename(target) in e.message


def test_a_missing_or_added_file_is_refused(signed, keys, capsys):
    header = sidecars(signed)["h"]
    saved = pathlib.Path(header).read_bytes()
    os.unlink(header)
    e = _refused_both_ways(signed, keys / "pub.pem", "missing", capsys)
    assert "libdemo.h" in e.message
    # signed without its header, then a header added beside it: not covered, refused
    cuvil.sign(signed, keys / "key.pem")
    pathlib.Path(header).write_bytes(saved)
    e = _refused_both_ways(signed, keys / "pub.pem", "extra", capsys)
    assert "libdemo.h" in e.message


def test_unsigned_is_refused(compiled, keys, tmp_path, capsys):
    so = compiled.save(tmp_path / "libdemo.so")
    e = _refused_both_ways(so, keys / "pub.pem", "unsigned", capsys)
    assert "cuvil sign" in e.hint


def test_a_replaced_public_key_is_refused(signed, keys, capsys):
    _refused_both_ways(signed, keys / "pub2.pem", "wrong-key", capsys)


def test_an_artifact_altered_and_signed_again_with_another_key_is_refused(signed, keys, capsys):
    _flip(sidecars(signed)["manifest"])
    cuvil.sign(signed, keys / "key2.pem")
    assert cuvil.verify_artifact(signed, keys / "pub2.pem")      # the attacker's own key holds
    _refused_both_ways(signed, keys / "pub.pem", "wrong-key", capsys)
    # the key hint removed from the signature: the signature itself then fails under the original key
    sig = pathlib.Path(signing.signature_path(signed))
    bundle = json.loads(sig.read_text())
    bundle["verificationMaterial"]["publicKey"]["hint"] = ""
    sig.write_text(json.dumps(bundle))
    _refused_both_ways(signed, keys / "pub.pem", "bad-signature", capsys)


def test_an_altered_signature_is_refused(signed, keys, capsys):
    import base64
    sig = pathlib.Path(signing.signature_path(signed))
    bundle = json.loads(sig.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    lib = [r for r in statement["predicate"]["resources"] if r["name"] == "libdemo.so"][0]
    lib["digest"] = "0" * 64                         # claims other bytes for the library
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    sig.write_text(json.dumps(bundle))
    _refused_both_ways(signed, keys / "pub.pem", "bad-signature", capsys)


def test_the_cli_refuses_a_private_key_for_verification_and_a_missing_key(signed, keys, capsys):
    assert cli_main(["verify-artifact", signed, "--key", str(keys / "key.pem")]) == 2
    assert "private key" in capsys.readouterr().err
    assert cli_main(["sign", signed, "--key", str(keys / "nokey.pem")]) == 2
    assert "cuvil keygen" in capsys.readouterr().err


# -- what is loaded is what was verified ----------------------------------------------------------------------

def test_load_runs_the_verified_bytes_not_what_the_disk_holds_after(signed, keys, monkeypatch):
    import cuvil.artifact as artifact_mod
    expected = cuvil.load(signed)
    real = artifact_mod.verify_artifact

    def verify_then_swap(path, key):
        v = real(path, key)
        # after the check, before the load: the library and its manifest replaced on disk (new files renamed
        # over them: `expected` keeps its own mapping of the old library)
        for p, data in ((path, b"\x7fELF not a library any more"), (sidecars(path)["manifest"], b'{"prefix": "evil"}')):
            _replace(p, data)
        return v

    monkeypatch.setattr(artifact_mod, "verify_artifact", verify_then_swap)
    m = cuvil.load(signed, verify=keys / "pub.pem")
    assert m.prefix == "cuvil"                      # the verified manifest, not the one on disk now
    x = _input(m)
    np.testing.assert_array_equal(m.run(x)[0], expected.run(x)[0])
    fd = int(m._mapped.rsplit("/", 1)[1])
    maps = pathlib.Path("/proc/self/maps").read_text()
    assert "memfd:libdemo.so" in maps               # mapped from the sealed memory file
    import fcntl
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & (fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == (
        fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    with pytest.raises(PermissionError):
        os.write(os.open(f"/proc/self/fd/{fd}", os.O_WRONLY), b"x")


def test_without_the_sign_extra_the_error_says_what_to_install(signed, keys, monkeypatch):
    monkeypatch.setitem(sys.modules, "model_signing", None)
    with pytest.raises(CuvilError, match="model-signing") as e:
        cuvil.verify_artifact(signed, keys / "pub.pem")
    assert "cuvil[sign]" in e.value.hint


# -- GPU bundles (compiled without a GPU: needs ptxas and libdevice) -------------------------------------------

def _bundle_tools():
    from cuvil.targets.ptx import find_libdevice, find_ptxas
    return find_ptxas() is not None and find_libdevice() is not None


needs_ptx_tools = pytest.mark.skipif(not _bundle_tools(), reason="ptxas or libdevice not found (no CUDA toolkit)")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from cuvil.testing import small_cnn
    return Pipeline.from_onnx(small_cnn()).compile("nvptx64-nvidia-cuda", arch="sm_90")


@needs_ptx_tools
def test_gpu_bundle_round_trip_and_refusals(bundle, keys, tmp_path, capsys):
    path = bundle.save(str(tmp_path / "net.cuvil"))
    assert cli_main(["sign", path, "--key", str(keys / "key.pem")]) == 0
    assert os.path.isfile(os.path.join(path, "model.sig"))
    v = cuvil.verify_artifact(path, keys / "pub.pem")
    assert set(v.files) == set(os.listdir(path)) - {"model.sig"} and "kernels.sm_90.cubin" in v.files
    assert cli_main(["verify-artifact", path, "--key", str(keys / "pub.pem")]) == 0
    capsys.readouterr()
    # a file added after signing is refused, whatever its name
    extra = pathlib.Path(path, "extra.ptx")
    extra.write_text("// not signed")
    _refused_both_ways(path, keys / "pub.pem", "extra", capsys)
    extra.unlink()
    for name in ("weights.bin", "kernels.ptx", "kernels.sm_90.cubin", "plan.json", "manifest.json"):
        p = pathlib.Path(path, name)
        saved = p.read_bytes()
        _flip(p)
        e = _refused_both_ways(path, keys / "pub.pem", "altered", capsys)
        assert name in e.message
        p.write_bytes(saved)
    _refused_both_ways(path, keys / "pub2.pem", "wrong-key", capsys)


@needs_ptx_tools
def test_a_verified_bundle_loads_the_bytes_it_verified(bundle, keys, tmp_path, monkeypatch):
    """Up to the CUDA driver (a recording fake: no GPU here): the cubin and weights handed to it are the
    verified bytes, although the files on disk were replaced after the check."""
    import cuvil.artifact as artifact_mod
    from cuvil.targets.ptx import runtime as rt
    sys.path.insert(0, os.path.dirname(__file__))
    from test_gpu_bundle import FakeDriver
    drv = FakeDriver()
    monkeypatch.setattr(rt, "driver", lambda: drv)
    path = bundle.save(str(tmp_path / "net.cuvil"))
    cuvil.sign(path, keys / "key.pem")
    weights = pathlib.Path(path, "weights.bin").read_bytes()
    cubin = pathlib.Path(path, "kernels.sm_90.cubin").read_bytes()
    real = artifact_mod.verify_artifact

    def verify_then_swap(p, key):
        v = real(p, key)
        pathlib.Path(p, "weights.bin").write_bytes(bytes(len(weights)))
        pathlib.Path(p, "kernels.sm_90.cubin").write_bytes(b"\0" * 16)
        return v

    monkeypatch.setattr(artifact_mod, "verify_artifact", verify_then_swap)
    m = cuvil.load(path, verify=keys / "pub.pem")
    assert m.module_source == "kernels.sm_90.cubin" and drv.module_image == cubin[:16]
    assert bytes(drv.mem[m.weights][:len(weights)]) == weights


# -- the C verifier (examples/c/verify_and_load.c, OpenSSL libcrypto) -----------------------------------------

C_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "c",
                        "verify_and_load.c")


def _libcrypto_reason():
    import shutil as sh
    if sh.which("cc") is None:
        return "needs a C compiler"
    if not any(os.path.isfile(os.path.join(d, "openssl", "evp.h")) for d in ("/usr/include", "/usr/local/include")):
        return "needs the OpenSSL libcrypto headers (libssl-dev)"
    return None


@pytest.fixture(scope="module")
def c_verifier(tmp_path_factory):
    reason = _libcrypto_reason()
    if reason:
        pytest.skip(reason)
    import subprocess
    exe = tmp_path_factory.mktemp("cver") / "verify_and_load"
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", C_SOURCE, "-lcrypto", "-ldl", "-o", str(exe)],
                   check=True)
    return exe


def test_the_c_verifier_verifies_then_runs_the_sealed_library(c_verifier, signed, keys):
    import subprocess
    run = lambda pub: subprocess.run([str(c_verifier), str(pub), signed], capture_output=True, text=True)  # noqa: E731
    res = run(keys / "pub.pem")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"verified {signed}: 3 files") or lines[0].startswith(f"verified {signed}:")
    name, rest = lines[1].split(" shape ")
    assert name == "probs" and rest.startswith("[1,10] values")
    m = cuvil.load(signed)
    x = (np.float32(0.1) * (np.arange(3 * 16 * 16) % 7).astype(np.float32) - np.float32(0.3)).reshape(1, 3, 16, 16)
    want = m.run(x.astype(np.float32))[0].reshape(-1)
    np.testing.assert_allclose([float(v) for v in rest.split("values ")[1].split()], want[:10], rtol=1e-5)
    # refused: another key; each file altered; a sidecar added after signing; unsigned
    res = run(keys / "pub2.pem")
    assert res.returncode == 1 and "does not verify" in res.stderr
    cars = sidecars(signed)
    for path, offset in ((signed, _code_offset(pathlib.Path(signed).read_bytes())), (cars["manifest"], None),
                         (cars["h"], None)):
        saved = pathlib.Path(path).read_bytes()
        _flip(path, offset)
        res = run(keys / "pub.pem")
        assert res.returncode == 1 and f"{os.path.basename(path)} was altered" in res.stderr, res.stderr
        _replace(path, saved)
    assert run(keys / "pub.pem").returncode == 0
    header = pathlib.Path(cars["h"])
    saved = header.read_bytes()
    header.unlink()
    cuvil.sign(signed, keys / "key.pem")
    header.write_bytes(saved)
    res = run(keys / "pub.pem")
    assert res.returncode == 1 and "libdemo.h is not covered" in res.stderr
    os.unlink(signing.signature_path(signed))
    res = run(keys / "pub.pem")
    assert res.returncode == 1 and "unsigned" in res.stderr


# -- external weights (issue 24 part 5; these run once that part is in) -------------------------------------

def _external_options():
    import attrs
    from cuvil.targets.x86.target import X86Options
    return {f.name for f in attrs.fields(X86Options)}


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    if "external_weights" not in _external_options():
        pytest.skip("this build has no external weights (issue 24 part 5)")
    return Pipeline.from_onnx(DEMO).compile(external_weights=True)


def test_external_weights_are_signed_and_the_verified_bytes_are_bound(external, keys, tmp_path, monkeypatch, capsys):
    import cuvil.artifact as artifact_mod
    so = external.save(tmp_path / "libdemo.so")
    weights = sidecars(so)["weights"]
    assert os.path.isfile(weights)
    cuvil.sign(so, keys / "key.pem")
    assert "libdemo.weights" in cuvil.verify_artifact(so, keys / "pub.pem").files
    expected = cuvil.load(so)
    x = _input(expected)
    want = expected.run(x)[0]
    real = artifact_mod.verify_artifact

    def verify_then_swap(path, key):                  # the weights file replaced after the check
        v = real(path, key)
        data = bytearray(pathlib.Path(weights).read_bytes())
        data[-1] ^= 0x01
        _replace(weights, bytes(data))
        return v

    monkeypatch.setattr(artifact_mod, "verify_artifact", verify_then_swap)
    np.testing.assert_array_equal(cuvil.load(so, verify=keys / "pub.pem").run(x)[0], want)
    monkeypatch.undo()
    _refused_both_ways(so, keys / "pub.pem", "altered", capsys)       # the flipped file, now checked


def test_encrypted_weights_load_verified_with_their_key(keys, tmp_path, capsys):
    import inspect
    if "encrypt_weights" not in _external_options() or "weights_key" not in inspect.signature(cuvil.load).parameters:
        pytest.skip("this build has no encrypted weights (issue 24 part 5)")
    key = os.urandom(32)
    art = Pipeline.from_onnx(DEMO).compile(encrypt_weights=key)
    so = art.save(tmp_path / "libdemo.so")
    cuvil.sign(so, keys / "key.pem")
    x = _input(cuvil.load(so, weights_key=key))
    np.testing.assert_array_equal(cuvil.load(so, verify=keys / "pub.pem", weights_key=key).run(x)[0],
                                  cuvil.load(so, weights_key=key).run(x)[0])
    _flip(sidecars(so)["weights"])
    _refused_both_ways(so, keys / "pub.pem", "altered", capsys)


def test_verify_takes_a_pem_file_pem_bytes_or_a_key_object_and_refuses_links(signed, keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    pem = (keys / "pub.pem").read_bytes()
    assert cuvil.verify_artifact(signed, pem).files
    assert cuvil.verify_artifact(signed, serialization.load_pem_public_key(pem)).files
    with pytest.raises(CuvilError, match="not a PEM public key"):
        cuvil.verify_artifact(signed, b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    # a signed file replaced by a link (to its own original bytes, even) is not a plain file: refused
    header = pathlib.Path(sidecars(signed)["h"])
    real = tmp_path / "elsewhere.h"
    shutil.copyfile(header, real)
    header.unlink()
    header.symlink_to(real)
    with pytest.raises(SignatureError, match="symbolic link"):
        cuvil.verify_artifact(signed, keys / "pub.pem")


def test_the_c_verifier_binds_the_verified_external_weights(c_verifier, external, keys, tmp_path):
    import subprocess
    so = external.save(tmp_path / "libdemo.so")
    cuvil.sign(so, keys / "key.pem")
    run = lambda: subprocess.run([str(c_verifier), str(keys / "pub.pem"), so], capture_output=True, text=True)  # noqa: E731
    res = run()
    assert res.returncode == 0, res.stderr
    m = cuvil.load(so)
    x = (np.float32(0.1) * (np.arange(3 * 16 * 16) % 7).astype(np.float32) - np.float32(0.3)).reshape(1, 3, 16, 16)
    printed = [float(v) for v in res.stdout.splitlines()[1].split("values ")[1].split()]
    np.testing.assert_allclose(printed, m.run(x.astype(np.float32))[0].reshape(-1)[:10], rtol=1e-5)
    _flip(sidecars(so)["weights"])
    res = run()
    assert res.returncode == 1 and "libdemo.weights was altered" in res.stderr
