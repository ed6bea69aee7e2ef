"""Issue 24, a hostile second look: the tamper campaign of bench/tamper.py in small (every tampered artifact
refused by a verified load, none crashing or hanging the loader), and one test per hole found in review:
a FIFO where a signed file or the signature belongs (an open that would wait forever), a file swapped for a
symbolic link (refused without following it), one file list for signing and the SBOM (symlinks refused
alike), bundle file names that reach outside the bundle, and cache entries holding links."""
import importlib.util
import json
import os
import shutil
import warnings

import pytest

pytest.importorskip("model_signing", reason="the sign extra is not installed (pip install 'cuvil[sign]')")

import cuvil  # noqa: E402
from cuvil import Pipeline, artifact, signing  # noqa: E402
from cuvil.errors import CuvilError  # noqa: E402
from cuvil.signing import SignatureError  # noqa: E402
from cuvil.supply_chain.digests import PlainFileError, read_plain  # noqa: E402
from cuvil.targets.ptx.bundle import bundle_file, bundle_has  # noqa: E402
from cuvil.targets.x86.artifact import sidecars  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(os.path.dirname(cuvil.__file__), "data", "demo_cnn.onnx")


def _bench():
    spec = importlib.util.spec_from_file_location("tamper", os.path.join(ROOT, "bench", "tamper.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tamper():
    return _bench()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    cuvil.keygen(d / "key.pem", d / "pub.pem")
    return d


@pytest.fixture
def signed(keys, tmp_path):
    so = Pipeline.from_onnx(DEMO).compile().save(tmp_path / "a" / "libdemo.so")
    cuvil.sign(so, keys / "key.pem")
    return so


def test_campaign_every_tampered_artifact_refused(tamper, tmp_path):
    """20 variants of the demo and of its external-weights build (code, constants, ELF headers, truncation,
    manifest/header/SBOM/provenance/weights edits, removed and added files, links, FIFOs, the signature edited,
    swapped, or made with another key over altered files): each one is refused by cuvil.load(verify=), in a
    child process that neither crashes nor hangs."""
    res = tamper.campaign(["demo", "external"], per_artifact=10, timeout=60, work=str(tmp_path), unverified=False)
    rows = res["rows"]
    assert len(rows) == 20
    assert len({r["family"] for r in rows}) >= 8
    bad = [r for r in rows if r["verified"] != "refused"]
    assert not bad, bad
    assert all("SignatureError" in r["verified_detail"] and "next:" in r["verified_detail"] for r in rows)
    assert "| refused | 20 |" in tamper.table(res, unverified=False)


def test_campaign_on_a_gpu_bundle(tamper, tmp_path):
    """10 variants of a signed GPU bundle (PTX and a ptxas cubin): each refused at verification, before any
    driver (this host needs no GPU for that)."""
    if shutil.which("ptxas") is None:
        pytest.skip("needs ptxas (the CUDA toolkit) to build the bundle with its cubin")
    res = tamper.campaign(["gpu"], per_artifact=10, timeout=60, work=str(tmp_path), unverified=False)
    assert len(res["rows"]) == 10 and len({r["family"] for r in res["rows"]}) >= 5
    bad = [r for r in res["rows"] if r["verified"] != "refused"]
    assert not bad, bad


def test_campaign_sees_a_silent_change_unverified(tamper, tmp_path):
    """The contrast is measured, not assumed: a flipped embedded weight runs and changes the outputs when the
    load does not verify."""
    s = tamper.build(["demo"], str(tmp_path), _key(tmp_path))[0]
    s.reference = tamper.run_isolated(s.path, None, None, s.inputs, 60)[1]
    dest = tmp_path / "copy"
    shutil.copytree(s.folder, dest)
    so = str(dest / os.path.basename(s.path))
    with open(so, "rb") as f:
        off, size = tamper._elf_sections(f.read())[".rodata"]
    with open(so, "r+b") as f:           # the sign of every 4-byte word of .rodata (the embedded weights) flipped
        f.seek(off)
        blob = bytearray(f.read(size))
        for i in range(3, len(blob), 4):
            blob[i] ^= 0x80
        f.seek(off)
        f.write(blob)
    out = tamper.classify(tamper.run_isolated(so, None, None, s.inputs, 60), s.reference)
    assert out[0] in ("ran, different", "crashed", "refused", "traceback")
    assert out[0] != "ran, same"


def _key(tmp_path):
    k = tmp_path / "k"
    cuvil.keygen(k / "key.pem", k / "pub.pem")
    return str(k / "key.pem")


# -- holes found in review -------------------------------------------------------------------------------------

def test_fifo_signature_is_refused_not_waited_on(tamper, signed, keys):
    """Before: the signature was opened with open(), which blocks forever on a FIFO (a hung loader)."""
    sig = signing.signature_path(signed)
    os.unlink(sig)
    os.mkfifo(sig)
    kind, detail = tamper.run_isolated(str(signed), str(keys / "pub.pem"), None, [], 30)
    assert kind == "refused", (kind, detail)
    assert "not a regular file" in detail
    with pytest.raises(SignatureError) as e:
        signing.verify_artifact(signed, keys / "pub.pem")
    assert e.value.reason == "special"


def test_fifo_in_a_bundle_is_refused_when_signing(tmp_path, keys):
    """Every file of a bundle is read to sign it: a FIFO there is refused at once (before: sign() hung)."""
    b = tmp_path / "x.cuvil"
    b.mkdir()
    (b / "plan.json").write_text("{}")
    os.mkfifo(b / "kernels.ptx")
    with pytest.raises(SignatureError) as e:
        signing.sign(b, keys / "key.pem")
    assert e.value.reason == "special" and "kernels.ptx" in e.value.message


def test_fifo_sidecar_is_refused(signed, keys):
    h = sidecars(str(signed))["h"]
    os.unlink(h)
    os.mkfifo(h)
    with pytest.raises(SignatureError) as e:
        signing.verify_artifact(signed, keys / "pub.pem")
    assert e.value.reason == "special"


def test_read_plain_never_follows_a_link(tmp_path):
    """The check and the open are one step (O_NOFOLLOW): a link swapped in after a check is still refused."""
    (tmp_path / "real").write_bytes(b"x")
    os.symlink("real", tmp_path / "link")
    assert read_plain(str(tmp_path / "real")) == b"x"
    with pytest.raises(PlainFileError) as e:
        read_plain(str(tmp_path / "link"))
    assert e.value.kind == "link"
    with pytest.raises(PlainFileError) as e:
        read_plain(str(tmp_path))
    assert e.value.kind == "special"


def test_one_artifact_file_list_refusing_links(signed, keys):
    """cuvil.artifact.artifact_files (what the SBOM/provenance list) is cuvil.signing's (what a signature
    covers): one function, which refuses a symbolic link as signing and verifying do."""
    assert artifact.artifact_files is signing.artifact_files
    files = signing.artifact_files(signed)
    assert os.path.basename(str(signed)) in files and "libdemo.sig" not in files
    assert "libdemo.intoto.json" in files
    assert "libdemo.intoto.json" not in signing.artifact_files(signed, provenance=False)
    m = sidecars(str(signed))["manifest"]
    os.rename(m, m + ".real")
    os.symlink(os.path.basename(m) + ".real", m)
    for call in (lambda: signing.artifact_files(signed), lambda: signing.verify_artifact(signed, keys / "pub.pem"),
                 lambda: signing.sign(signed, keys / "key.pem")):
        with pytest.raises(SignatureError) as e:
            call()
        assert e.value.reason == "link"


@pytest.mark.parametrize("name", ["../outside.cubin", "/etc/passwd", "a/../../b", "", "./x", "a\\b"])
def test_bundle_names_stay_inside_the_bundle(tmp_path, name):
    """A manifest edited to name ``../../elsewhere.cubin`` (unverified load) reads nothing outside."""
    (tmp_path / "outside.cubin").write_bytes(b"evil")
    b = tmp_path / "x.cuvil"
    b.mkdir()
    with pytest.raises(CuvilError, match="not a file inside the bundle"):
        bundle_file(str(b), name)
    with pytest.raises(CuvilError, match="not a file inside the bundle"):
        bundle_has(str(b), name)
    (b / "k.cubin").write_bytes(b"ok")
    assert bundle_file(str(b), "k.cubin") == b"ok" and bundle_has(str(b), "k.cubin", {"k.cubin": b""})


def test_cache_entry_with_a_link_is_discarded(tmp_path, monkeypatch):
    """A cached file replaced by a link to identical bytes (which a later write elsewhere would change) does
    not match the entry's digests: discarded and built again."""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    art = Pipeline.from_onnx(DEMO).compile()
    entry = os.path.dirname(art.path)
    key = os.path.basename(entry)
    assert artifact.cached_path(key, "libcuvil.so") == art.path
    real = tmp_path / "elsewhere.so"
    shutil.copyfile(art.path, real)
    os.unlink(art.path)
    os.symlink(real, art.path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert artifact.cached_path(key, "libcuvil.so") is None
    assert any("does not match the digests" in str(x.message) for x in w)
    assert not os.path.exists(entry)
    assert json.loads(open(sidecars(Pipeline.from_onnx(DEMO).compile().path)["manifest"]).read())


def test_signature_keyid_edit_is_refused(signed, keys):
    """DSSE does not sign an envelope's keyid: the campaign found an edited keyid accepted. Refused now (a
    second signature entry likewise); re-serialising the same JSON differently still verifies."""
    sig = signing.signature_path(signed)
    doc = json.loads(open(sig).read())
    with open(sig, "w") as f:
        json.dump(doc, f, indent=3)                   # the same JSON, other whitespace: fine
    signing.verify_artifact(signed, keys / "pub.pem")
    for edit in (lambda d: d["dsseEnvelope"]["signatures"][0].__setitem__("keyid", "attacker"),
                 lambda d: d["dsseEnvelope"]["signatures"].append(dict(d["dsseEnvelope"]["signatures"][0]))):
        d = json.loads(json.dumps(doc))
        edit(d)
        with open(sig, "w") as f:
            json.dump(d, f)
        with pytest.raises(SignatureError) as e:
            signing.verify_artifact(signed, keys / "pub.pem")
        assert e.value.reason == "bad-signature"


def test_the_c_verifier_refuses_a_fifo_and_a_link(signed, keys, tmp_path):
    """examples/c/verify_and_load.c opened with O_NOFOLLOW but would wait forever on a FIFO (a hung
    loader): a FIFO signature, a FIFO sidecar and a linked library are refused (exit 1) within the time limit."""
    import subprocess
    if shutil.which("cc") is None or not os.path.isfile("/usr/include/openssl/evp.h"):
        pytest.skip("needs a C compiler and the OpenSSL libcrypto headers (libssl-dev)")
    exe = tmp_path / "verify_and_load"
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", os.path.join(ROOT, "examples", "c", "verify_and_load.c"),
                    "-lcrypto", "-ldl", "-o", str(exe)], check=True)
    run = lambda: subprocess.run([str(exe), str(keys / "pub.pem"), str(signed)], capture_output=True, text=True,  # noqa: E731
                                 timeout=60)
    assert run().returncode == 0
    for path in (sidecars(str(signed))["h"], signing.signature_path(signed)):
        saved = open(path, "rb").read()
        os.unlink(path)
        os.mkfifo(path)
        res = run()
        assert res.returncode == 1 and "not a regular file" in res.stderr, res.stderr
        os.unlink(path)
        open(path, "wb").write(saved)
    assert run().returncode == 0
    os.rename(signed, str(signed) + ".real")
    os.symlink(os.path.basename(str(signed)) + ".real", signed)
    res = run()
    assert res.returncode == 1 and "symbolic link" in res.stderr, res.stderr


def test_a_damaged_symbol_name_is_a_clear_error_unverified(tamper, tmp_path):
    """The campaign's one traceback: a .dynstr byte flipped to a non-UTF-8 byte made dlopen's message (which
    quotes the symbol) a UnicodeDecodeError out of ctypes. Now a CuvilError with its next step, also without
    verify=."""
    so = Pipeline.from_onnx(DEMO).compile().save(tmp_path / "libdemo.so")
    data = bytearray(open(so, "rb").read())
    off, size = tamper._elf_sections(bytes(data))[".dynstr"]
    at = data.index(b"\0vsnprintf\0", off, off + size) + 2
    data[at] = 0xE5                                         # v\xe5snprintf: undefined, and not UTF-8
    open(so, "wb").write(bytes(data))
    kind, detail = tamper.run_isolated(str(so), None, None, [], 60)
    assert kind == "refused", (kind, detail)
    assert "cannot load" in detail and "next:" in detail


def test_the_audit_user_comes_from_the_uid_not_the_environment(tmp_path, monkeypatch):
    """getpass.getuser() reads $USER first: any process could log its events as someone else."""
    import pwd
    from cuvil import audit
    monkeypatch.setenv("USER", "someone-else")
    monkeypatch.setenv("LOGNAME", "someone-else")
    log = tmp_path / "audit.jsonl"
    audit.configure(log)
    try:
        audit.record("verify", artifact=str(tmp_path / "libx.so"), digest="00" * 32)
    finally:
        audit.reset()
    (e,) = audit.read(log)
    assert e["user"] == pwd.getpwuid(os.getuid()).pw_name != "someone-else"


def test_a_verified_load_never_reads_unsigned_weights_from_disk(keys, tmp_path, monkeypatch):
    """An external-weights library signed without its weights file: before, cuvil.load(verify=) verified the
    files there were, then the loader mapped libNAME.weights from the disk (a file put there between the check
    and the bind was used). Now such a load is refused: only verified bytes are bound."""
    art = Pipeline.from_onnx(DEMO).compile(external_weights=True)
    so = art.save(tmp_path / "libdemo.so")
    wfile = sidecars(str(so))["weights"]
    os.rename(wfile, tmp_path / "kept.weights")
    cuvil.sign(so, keys / "key.pem")                           # signs what is there: no weights file
    real_verify = signing.verify_artifact

    def verify_then_race(path, key):
        v = real_verify(path, key)
        shutil.copyfile(tmp_path / "kept.weights", wfile)      # appears after the check, before the bind
        return v
    monkeypatch.setattr(artifact, "verify_artifact", verify_then_race)
    with pytest.raises(CuvilError, match="signature does not cover libdemo.weights"):
        cuvil.load(so, verify=keys / "pub.pem")
