"""Weights outside the code (issue 24 part 5): ``--external-weights`` writes ``libNAME.weights`` beside the
library, which binds them at run time (``PREFIX_bind_weights``, checked against the size and SHA-256 the
library embeds); ``--encrypt-weights KEYFILE`` keeps that file AES-256-GCM encrypted, decrypted in memory by
``cuvil.load(path, weights_key=...)``."""
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil import CuvilError, Pipeline
from cuvil.cli import main as cli_main
from cuvil.targets.x86.artifact import sidecars
from cuvil.targets.x86.link import check_dependencies, unexpected_dependencies
from cuvil.targets.x86.weights_file import HEADER_BYTES, WeightsKey, new_key_file, read_key

pytest.importorskip("cryptography", reason="encrypted weights need the cryptography package (cuvil[encrypt])")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")
C_EXAMPLE = os.path.join(ROOT, "examples", "c", "run_model.c")


def image(n=1, seed=3):
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def opt_weights_model() -> onnx.ModelProto:
    """``y[N, 8] = x[N, 4] @ w + ConstantOfShape([N, 8], 0.5)``: at the opt point the constant folds into a
    weight of its own, so the opt kernels' weights differ from the generic ones (manifest: "of their own")."""
    w = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Shape", ["m"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["c"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Add", ["m", "c"], ["y"])]
    g = helper.make_graph(nodes, "opt_weights", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def demo():
    return Pipeline.from_onnx(DEMO).optimize()


@pytest.fixture(scope="module")
def built(demo, tmp_path_factory):
    """The demo CNN at N = 1 three ways: weights embedded, external, external and encrypted (key ``key``)."""
    d = tmp_path_factory.mktemp("weights")
    new_key_file(str(d / "key"))
    new_key_file(str(d / "other.key"))
    paths = {}
    for name, opts in (("emb", {}), ("ext", {"external_weights": True}), ("enc", {"encrypt_weights": str(d / "key")})):
        paths[name] = demo.compile(fixed={"N": 1}, **opts).save(d / name / "libnet.so")
    return d, paths


def weights_of(so) -> str:
    return str(so)[:-3] + ".weights"


def copy_artifact(so, dest_dir):
    """The library and its weights file copied to ``dest_dir`` (another path: another library instance when
    loaded, so tests that damage the copy never meet the original's binding)."""
    os.makedirs(dest_dir, exist_ok=True)
    out = os.path.join(dest_dir, "libnet.so")
    for src, dst in ((so, out), (weights_of(so), weights_of(out)), (str(so)[:-3] + ".manifest.json",
                                                                      out[:-3] + ".manifest.json")):
        shutil.copyfile(src, dst)
    return out


def test_external_weights_give_the_embedded_library_bits(built):
    d, paths = built
    x = image()
    want = cuvil.load(paths["emb"]).run(image=x)[0]
    ext = cuvil.load(paths["ext"])
    np.testing.assert_array_equal(ext.run(image=x)[0], want)
    assert os.path.isfile(weights_of(paths["ext"])) and not os.path.exists(weights_of(paths["emb"]))
    wbytes = ext.manifest["weights_bytes"]
    assert os.path.getsize(paths["emb"]) - os.path.getsize(paths["ext"]) >= wbytes - 4096   # not in the code
    info = ext.manifest["weights_file"]
    assert info["bytes"] == wbytes and not info["encrypted"]
    assert os.path.getsize(weights_of(paths["ext"])) == HEADER_BYTES + wbytes
    np.testing.assert_array_equal(cuvil.load(paths["enc"], weights_key=d / "key").run(image=x)[0], want)


def test_the_weights_file_is_mapped_read_only_and_shared(built):
    _, paths = built
    a, b = cuvil.load(paths["ext"]), cuvil.load(paths["ext"])
    a.run(image=image()), b.run(image=image())
    target = os.path.realpath(weights_of(paths["ext"]))
    with open("/proc/self/maps") as f:
        perms = [line.split()[1] for line in f if line.rstrip().endswith(target)]
    assert perms and all(p == "r--s" for p in perms), perms    # shared, read only: the page cache's pages
    assert a._weights is b._weights and a._weights.shared_file == weights_of(paths["ext"])


def test_dynamic_shapes_with_opt_point_weights_of_their_own(tmp_path):
    p = Pipeline.from_onnx(opt_weights_model()).optimize()
    emb = p.compile(shape_profiles={"N": (1, 3, 8)})
    ext = p.compile(shape_profiles={"N": (1, 3, 8)}, external_weights=True)
    assert ext.manifest["opt_weights"].endswith("of their own")
    assert ext.manifest["weights_file"]["opt_offset"] > 0
    m = cuvil.load(ext.save(tmp_path / "libopt.so"))
    for n in (1, 3, 8):     # 3: the opt point, its own kernels and weights
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        np.testing.assert_array_equal(m.run(x)[0], emb.run([x])[0])


def test_encrypted_weights_need_the_right_key(built):
    d, paths = built
    with pytest.raises(CuvilError, match=r"encrypted: give their key") as e:
        cuvil.load(paths["enc"])
    assert "weights_key=" in e.value.hint
    with pytest.raises(CuvilError, match=r"authentication failed") as e:
        cuvil.load(paths["enc"], weights_key=d / "other.key")
    assert "--encrypt-weights" in e.value.hint
    with pytest.raises(CuvilError, match="not encrypted: weights_key= has nothing to decrypt"):
        cuvil.load(paths["ext"], weights_key=d / "key")
    with pytest.raises(CuvilError, match="embeds its weights"):
        cuvil.load(paths["emb"], weights_key=d / "key")


def test_a_flipped_ciphertext_or_header_byte_fails_authentication(built, tmp_path):
    d, paths = built
    for k, at in enumerate((HEADER_BYTES + 100, os.path.getsize(weights_of(paths["enc"])) - 1)):  # data, tag
        so = copy_artifact(paths["enc"], tmp_path / str(k))
        data = bytearray(open(weights_of(so), "rb").read())
        data[at] ^= 0x01
        open(weights_of(so), "wb").write(data)
        with pytest.raises(CuvilError, match="authentication failed"):
            cuvil.load(so, weights_key=d / "key")
    so = copy_artifact(paths["enc"], tmp_path / "head")
    data = bytearray(open(weights_of(so), "rb").read())
    data[100] ^= 0x01                  # the reserved part of the header: bound as associated data
    open(weights_of(so), "wb").write(data)
    with pytest.raises(CuvilError, match="authentication failed"):
        cuvil.load(so, weights_key=d / "key")


def test_encrypted_weights_are_decrypted_in_private_memory_only(built):
    d, paths = built
    m = cuvil.load(paths["enc"], weights_key=read_key(d / "key"))      # the key's bytes work as well as its file
    assert m._weights.shared_file is None
    target = os.path.realpath(weights_of(paths["enc"]))
    with open("/proc/self/maps") as f:
        assert not any(line.rstrip().endswith(target) for line in f)   # no mapping of the file is left


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-10], "the file truncated"),
    (lambda b: b[:2000], "the file truncated"),
    (lambda b: b + b"x", "has trailing bytes"),
    (lambda b: b"", "empty file"),
    (lambda b: b"PK" + b[2:], "not a Cuvil weights file"),
], ids=["payload", "header", "trailing", "empty", "magic"])
def test_a_damaged_weights_file_is_refused(built, tmp_path, damage, message):
    so = copy_artifact(built[1]["ext"], tmp_path)
    data = open(weights_of(so), "rb").read()
    open(weights_of(so), "wb").write(damage(data))
    with pytest.raises(CuvilError, match=message):
        cuvil.load(so)


def test_a_changed_weight_in_a_plain_file_is_refused_by_the_library(built, tmp_path):
    so = copy_artifact(built[1]["ext"], tmp_path)
    data = bytearray(open(weights_of(so), "rb").read())
    data[HEADER_BYTES + 5] ^= 0x40
    open(weights_of(so), "wb").write(data)
    with pytest.raises(CuvilError, match=r"bind_weights refused the weights \(code -22\).*SHA-256"):
        cuvil.load(so)


def test_the_weights_of_another_model_are_refused(built, tmp_path):
    p = Pipeline.from_onnx(opt_weights_model()).optimize()
    other = p.compile(fixed={"N": 2}, external_weights=True)
    so = copy_artifact(built[1]["ext"], tmp_path)
    shutil.copyfile(weights_of(other.path), weights_of(so))
    with pytest.raises(CuvilError, match="weights of another model or build") as e:
        cuvil.load(so)
    assert "compiled together with libnet.so" in e.value.hint
    os.unlink(weights_of(so))
    with pytest.raises(CuvilError, match="compiled with external weights, and libnet.weights is not beside it"):
        cuvil.load(so)


def test_weights_given_as_bytes(built, tmp_path):
    d, paths = built
    x = image(seed=9)
    want = cuvil.load(paths["emb"]).run(image=x)[0]
    for name, key in (("ext", None), ("enc", d / "key")):
        so = copy_artifact(paths[name], tmp_path / name)
        data = open(weights_of(so), "rb").read()
        os.unlink(weights_of(so))            # the file beside it is not read
        m = cuvil.load(so, weights=data, weights_key=key)
        np.testing.assert_array_equal(m.run(image=x)[0], want)
    with pytest.raises(CuvilError, match="libnet.weights: not a Cuvil weights file"):
        cuvil.load(copy_artifact(paths["ext"], tmp_path / "bad"), weights=b"\0" * 64)


def test_the_c_abi_refuses_sessions_before_binding_and_checks_the_buffer(built, tmp_path):
    so = copy_artifact(built[1]["ext"], tmp_path)         # a fresh instance: nothing bound yet
    lib = ctypes.CDLL(so)
    lib.cuvil_session_create.restype = ctypes.c_void_p
    lib.cuvil_last_error.restype = ctypes.c_char_p
    lib.cuvil_bind_weights.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.cuvil_session_destroy.argtypes = [ctypes.c_void_p]
    nbytes, digest = ctypes.c_int64(), (ctypes.c_uint8 * 32)()
    assert lib.cuvil_weights_info(ctypes.byref(nbytes), digest) == 1
    data = open(weights_of(so), "rb").read()[HEADER_BYTES:]
    assert nbytes.value == len(data) and bytes(digest) == hashlib.sha256(data).digest()
    assert lib.cuvil_session_create(1) is None
    assert b"call bind_weights before creating a session" in lib.cuvil_last_error()
    buf = (ctypes.c_uint8 * (len(data) + 128))()
    base = (ctypes.addressof(buf) + 63) // 64 * 64
    ctypes.memmove(base, data, len(data))
    assert lib.cuvil_bind_weights(base, len(data) - 4) == -22
    assert b"the weights of another model, or a truncated file" in lib.cuvil_last_error()
    assert lib.cuvil_bind_weights(base + 4, len(data)) == -9
    ctypes.memset(base + 7, data[7] ^ 0x55, 1)
    assert lib.cuvil_bind_weights(base, len(data)) == -22 and b"SHA-256" in lib.cuvil_last_error()
    ctypes.memmove(base, data, len(data))
    assert lib.cuvil_bind_weights(base, len(data)) == 0
    s = lib.cuvil_session_create(1)
    assert s
    assert lib.cuvil_bind_weights(base, len(data)) == -13           # sessions are live
    assert lib.cuvil_bind_weights(None, 0) == -13
    lib.cuvil_session_destroy(s)
    assert lib.cuvil_bind_weights(None, 0) == 0                      # unbound again
    assert lib.cuvil_session_create(1) is None
    emb = ctypes.CDLL(built[1]["emb"])
    emb.cuvil_bind_weights.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert emb.cuvil_weights_info(None, None) == 0
    assert emb.cuvil_bind_weights(base, len(data)) == -18


def test_the_library_still_needs_only_libc_libm_and_libpthread(built):
    for so in built[1].values():
        assert unexpected_dependencies(check_dependencies(str(so))) == []


def test_encrypted_builds_are_byte_identical(demo, tmp_path):
    """Two builds with one key, read from key files in two places: every file of the artifact the same bytes
    (the weights file's nonces derive from the key and the weights; the records name the key by its id)."""
    new_key_file(str(tmp_path / "k"))
    os.makedirs(tmp_path / "elsewhere")
    shutil.copyfile(tmp_path / "k", tmp_path / "elsewhere" / "k2")
    builds = []
    for keyfile in (tmp_path / "k", tmp_path / "elsewhere" / "k2"):
        art = demo.compile(fixed={"N": 1}, encrypt_weights=str(keyfile), cache=False)
        builds.append({os.path.basename(p): open(p, "rb").read()
                       for p in [art.path, *sidecars(art.path).values()]})
    assert "libcuvil.weights" in builds[0] and builds[0] == builds[1]


def test_save_copies_the_weights_and_drops_a_stale_one(built, demo, tmp_path):
    _, paths = built
    ext = demo.compile(fixed={"N": 1}, external_weights=True)
    out = ext.save(tmp_path / "libnet.so")
    assert open(weights_of(out), "rb").read() == open(weights_of(paths["ext"]), "rb").read()
    demo.compile(fixed={"N": 1}).save(out)             # the embedded build replaces it
    assert not os.path.exists(weights_of(out))
    cuvil.load(out).run(image=image())


def test_key_files(tmp_path):
    path = str(tmp_path / "k")
    new_key_file(path)
    assert len(read_key(path)) == 32 and oct(os.stat(path).st_mode & 0o777) == "0o600"
    with pytest.raises(CuvilError, match="never overwritten"):
        new_key_file(path)
    (tmp_path / "raw").write_bytes(bytes(range(32)))
    assert read_key(tmp_path / "raw") == bytes(range(32))
    (tmp_path / "bad").write_text("not a key\n")
    with pytest.raises(CuvilError, match="not a key file") as e:
        read_key(tmp_path / "bad")
    assert "cuvil weights-key" in e.value.hint
    with pytest.raises(CuvilError, match="encrypt_weights: cannot read the key file"):
        Pipeline.from_onnx(DEMO).compile(fixed={"N": 1}, encrypt_weights=str(tmp_path / "absent"))


def test_cli_key_compile_and_run(tmp_path, capsys):
    key, lib = str(tmp_path / "model.key"), str(tmp_path / "out" / "libdemo.so")
    assert cli_main(["weights-key", key]) == 0
    assert cli_main(["weights-key", key]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert cli_main(["compile", DEMO, "-o", lib, "--fix", "N=1", "--encrypt-weights", key, "-q"]) == 0
    assert "libdemo.weights (encrypted)" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", image())
    assert cli_main(["run", lib, "--input", f"image={tmp_path / 'x.npy'}"]) == 2
    assert "--weights-key KEYFILE" in capsys.readouterr().err
    assert cli_main(["run", lib, "--input", f"image={tmp_path / 'x.npy'}", "--weights-key", key]) == 0
    assert cli_main(["compile", DEMO, "-o", str(tmp_path / "g.cuvil"), "--target", "nvptx64-nvidia-cuda",
                     "--external-weights", "-q"]) == 2
    assert "applies to the x86 target only" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_c_example_maps_and_binds_the_weights_file(built, tmp_path):
    so = copy_artifact(built[1]["ext"], tmp_path)
    shutil.copyfile(str(built[1]["ext"])[:-3] + ".h", tmp_path / "libnet.h")
    exe = tmp_path / "run_net"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", C_EXAMPLE, '-DMODEL_HEADER="libnet.h"', f"-I{tmp_path}",
                    f"-L{tmp_path}", "-lnet", f"-Wl,-rpath,{tmp_path}", "-o", str(exe)], check=True)
    x = image(seed=5)
    np.save(tmp_path / "x.npy", x)
    res = subprocess.run([str(exe), str(tmp_path / "x.npy")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    want = cuvil.load(built[1]["emb"]).run(image=x)[0].reshape(-1)
    printed = np.array([float(v) for v in res.stdout.split("values ")[1].split()])
    np.testing.assert_allclose(printed, want[:10], rtol=1e-5)
    data = bytearray(open(weights_of(so), "rb").read())
    data[HEADER_BYTES] ^= 1
    open(weights_of(so), "wb").write(data)
    res = subprocess.run([str(exe), str(tmp_path / "x.npy")], capture_output=True, text=True)
    assert res.returncode == 1 and "does not match the library (size or SHA-256)" in res.stderr


SHA_HARNESS = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
%s
int main(int argc, char **argv) {  /* the SHA-256 of bytes k*7 + (k>>8) (mod 256), k < n, for each n given */
  for (int a = 1; a < argc; ++a) {
    size_t n = strtoull(argv[a], NULL, 10);
    uint8_t *p = malloc(n + 1), d[32];
    for (size_t k = 0; k < n; ++k) p[k] = (uint8_t)(k * 7 + (k >> 8));
    sha256(p, n, d);
    for (int i = 0; i < 32; ++i) printf("%%02x", d[i]);
    printf("\n");
    free(p);
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_runtime_sha256_agrees_with_hashlib_on_both_paths(tmp_path):
    src = open(os.path.join(ROOT, "src", "cuvil", "targets", "x86", "runtime.c")).read()
    start = src.index("/* SHA-256 (FIPS 180-4)")
    section = src[start:src.index("/* ----", start)]
    (tmp_path / "sha.c").write_text(SHA_HARNESS % section)
    sizes = list(range(0, 200)) + [1000, 4096, 65536 + 55, (1 << 20) + 63]
    want = []
    for n in sizes:
        k = np.arange(n, dtype=np.uint64)
        want.append(hashlib.sha256(((k * 7 + (k >> 8)) & 255).astype(np.uint8).tobytes()).hexdigest())
    # plain, then under AddressSanitizer and UBSan (every read inside the buffer, no undefined shift or overflow)
    for flags in ((), ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g")):
        exe = str(tmp_path / f"sha{len(flags)}")
        subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", "-Werror", "-Wno-unused-function", *flags,
                        str(tmp_path / "sha.c"), "-o", exe], check=True)
        for env in ({}, {"CUVIL_SHA256": "portable"}):
            out = subprocess.run([exe, *map(str, sizes)], capture_output=True, text=True, check=True,
                                 env={**os.environ, **env}).stdout.split()
            assert out == want, (flags, env)


def test_a_model_without_weights_writes_no_weights_file(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out = Pipeline.from_onnx(model).compile(external_weights=True).save(tmp_path / "librelu.so")
    assert not os.path.exists(weights_of(out)) and "weights_file" not in cuvil.load(out).manifest
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_array_equal(cuvil.load(out).run(x)[0], np.maximum(x, 0))


CHILD = """
import sys, cuvil, numpy as np
m = cuvil.load(sys.argv[1])
m.run(image=np.zeros((1, 3, 16, 16), np.float32))
print("ready", flush=True)
sys.stdin.readline()
"""


def test_two_processes_share_the_weights_pages(built):
    """Each process maps the file shared and read-only; every page it holds is also the other's (the page
    cache's): /proc/PID/smaps counts them all as Shared_*, none as Private_*."""
    so = built[1]["ext"]
    target = os.path.realpath(weights_of(so))
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(so)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            fields, inside = {}, False
            with open(f"/proc/{p.pid}/smaps") as f:
                for line in f:
                    if "-" in line.split()[0] and len(line.split()) >= 5:
                        inside = line.rstrip().endswith(target)
                        if inside:
                            assert line.split()[1] == "r--s", line
                    elif inside and line.split()[0].endswith(":") and line.split()[1].isdigit():
                        key = line.split()[0][:-1]
                        fields[key] = fields.get(key, 0) + int(line.split()[1])
            shared = fields.get("Shared_Clean", 0) + fields.get("Shared_Dirty", 0)   # dirty: not written back yet
            assert shared == fields["Rss"] > 0, sorted(fields.items())
            assert fields.get("Private_Clean", 0) == fields.get("Private_Dirty", 0) == 0, sorted(fields.items())
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)


def test_cuvil_bench_binds_external_weights_in_its_cold_start(built, capsys):
    assert cli_main(["bench", str(built[1]["ext"]), "--runs", "5", "--warmup", "1", "--cold-runs", "1",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "cold start" in out and "error rate                 0 %" in out


def test_the_build_records_name_the_key_by_its_id_only(demo, tmp_path):
    new_key_file(str(tmp_path / "k"))
    key = read_key(tmp_path / "k")
    for given in (str(tmp_path / "k"), key):
        art = demo.compile(fixed={"N": 1}, encrypt_weights=given)
        base = art.path[:-3]
        text = "".join(open(base + ext).read() for ext in (".intoto.json", ".cdx.json", ".manifest.json"))
        assert key.hex() not in text and repr(key) not in text and str(tmp_path) not in text
        assert f"WeightsKey(id={WeightsKey(key).id})" in text
        subjects = {x["name"]: x["digest"]["sha256"] for x in json.load(open(base + ".intoto.json"))["subject"]}
        assert subjects[os.path.basename(weights_of(art.path))] == hashlib.sha256(
            open(weights_of(art.path), "rb").read()).hexdigest()       # the ciphertext, as every file: by digest
    with pytest.raises(CuvilError, match="encrypt_weights: give a key file's path or the key's 32 bytes"):
        demo.compile(fixed={"N": 1}, encrypt_weights=42)


def test_the_audit_log_records_weights_loads_and_refusals(built, tmp_path):
    from cuvil import audit
    d, paths = built
    log = tmp_path / "audit.jsonl"
    audit.configure(log)
    try:
        cuvil.load(paths["enc"], weights_key=d / "key")
        with pytest.raises(CuvilError, match="authentication failed"):
            cuvil.load(paths["enc"], weights_key=d / "other.key")
        with pytest.raises(CuvilError, match="give their key"):
            cuvil.load(paths["enc"])
    finally:
        audit.reset()
    loads = [(e["outcome"], e.get("weights")) for e in audit.read(log) if e["event"] == "load"]
    assert loads == [("ok", "encrypted"), ("refused", None), ("error", None)]
    assert str(d / "key") not in log.read_text() and "other.key" not in log.read_text()
