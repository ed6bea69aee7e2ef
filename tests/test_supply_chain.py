"""The supply-chain records of every compile (issue 24, docs/supply-chain.md): the CycloneDX 1.6 SBOM
validates against the schema and names the model's digest, the compiler and its dependencies, the rules with
their verdicts and the ISA features; the in-toto / SLSA v1 provenance names the exact digests of the
artifact's files, the input model and the rule files; the artifact cache checks an entry's digests before
using it and keys x86 libraries by the ISA features they need."""
import hashlib
import json
import os
import shutil

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from cuvil import Pipeline
from cuvil.artifact import DIGESTS_FILE, artifact_cache_dir, artifact_files
from cuvil.targets.x86 import target as x86_target
from cuvil.targets.x86.artifact import sidecars
from cuvil.targets.x86.cpu import CpuDescription
from cuvil.version import __version__

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "cuvil", "data", "demo_cnn.onnx")
PROFILE = {"N": (1, 2, 4)}


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo CNN as a file, compiled with a shape profile (cache off: the files of this build)."""
    d = tmp_path_factory.mktemp("model")
    path = str(d / "demo_cnn.onnx")
    shutil.copyfile(DEMO, path)
    art = Pipeline.from_onnx(path).optimize().compile(shape_profiles=PROFILE, cache=False)
    yield path, art
    shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_every_compile_writes_an_sbom_and_a_provenance_beside_the_library(demo):
    _, art = demo
    s = sidecars(art.path)
    assert os.path.basename(s["cdx"]) == "libcuvil.cdx.json" and os.path.isfile(s["cdx"])
    assert os.path.basename(s["intoto"]) == "libcuvil.intoto.json" and os.path.isfile(s["intoto"])
    assert art.timings and art.timings["compile_seconds"] > 0       # times on the object, not in the artifact
    assert not {"compile_seconds", "codegen_seconds"} & set(art.manifest)
    assert "proof_seconds" not in art.manifest["memory_safety"]


def test_sbom_validates_against_the_cyclonedx_1_6_schema(demo):
    _, art = demo
    with open(sidecars(art.path)["cdx"], encoding="utf-8") as f:
        text = f.read()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    broken = json.loads(text)
    broken["components"][0]["type"] = "not-a-type"              # the validator does refuse a wrong document
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(json.dumps(broken)) is not None


def test_sbom_names_the_model_compiler_dependencies_rules_and_isa_features(demo):
    model_path, art = demo
    bom = load(sidecars(art.path)["cdx"])
    assert bom["specVersion"] == "1.6" and "timestamp" not in bom["metadata"]
    assert bom["serialNumber"].startswith("urn:uuid:")
    by_type = {}
    for c in bom["components"]:
        by_type.setdefault(c["type"], []).append(c)
    (model,) = by_type["machine-learning-model"]
    assert model["name"] == "demo_cnn.onnx"
    assert model["hashes"] == [{"alg": "SHA-256", "content": sha256(model_path)}]
    apps = {c["name"]: c["version"] for c in by_type["application"]}
    assert apps["cuvil"] == __version__ and apps["cc"].startswith("cc ")
    libs = {c["name"]: c["version"] for c in by_type["library"]}
    import importlib.metadata as md
    for pkg in ("onnx", "numpy", "llvmlite", "z3-solver", "lark"):
        assert libs[pkg] == md.version(pkg)
    rules = {c["name"]: {p["name"]: p["value"] for p in c["properties"]} for c in by_type["data"]}
    assert set(rules) == set(art.manifest["rules_applied"]) and "fold_conv_bn" in rules
    assert all(r["cuvil:rule:verdict"] == "proved" for r in rules.values())
    subject = bom["metadata"]["component"]
    props = {p["name"]: p["value"] for p in subject["properties"]}
    assert json.loads(props["cuvil:target:isa_features"]) == art.manifest["target"]["isa_features"]
    assert props["cuvil:target:triple"] == art.manifest["target"]["triple"]
    files = {c["name"]: c["hashes"][0]["content"] for c in subject["components"]}
    assert files["libcuvil.so"] == sha256(art.path)
    assert files["libcuvil.manifest.json"] == sha256(sidecars(art.path)["manifest"])


def test_provenance_names_the_exact_digests(demo):
    model_path, art = demo
    st = load(sidecars(art.path)["intoto"])
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in st["subject"]}
    on_disk = {n: sha256(p) for n, p in artifact_files(art.path, provenance=False).items()}
    assert subjects == on_disk and "libcuvil.cdx.json" in subjects and "libcuvil.so" in subjects
    bd = st["predicate"]["buildDefinition"]
    deps = {d["name"]: d["digest"]["sha256"] for d in bd["resolvedDependencies"]}
    assert deps["demo_cnn.onnx"] == sha256(model_path)
    rules_dir = os.path.join(os.path.dirname(__file__), "..", "rules")
    assert deps["rules/fold.rule"] == sha256(os.path.join(rules_dir, "fold.rule"))
    ext = bd["externalParameters"]
    assert ext["target"] == "x86_64-linux-gnu" and ext["options"]["opt_level"] == 3
    assert ext["shape_profiles"] == {"N": [1, 2, 4]} and ext["model"]["sha256"] == sha256(model_path)
    run = st["predicate"]["runDetails"]
    assert run["builder"]["version"]["cuvil"] == __version__ and run["metadata"] == {}


def test_user_rule_files_are_named_with_their_digests(tmp_path):
    rule = tmp_path / "mine.rule"
    rule.write_text("rule double_neg\n  Neg(Neg(x)) => x\n  prove exact\n")
    import onnx
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
                           helper.make_node("Relu", ["b"], ["y"])], "negneg",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    path = str(tmp_path / "negneg.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    art = Pipeline.from_onnx(path).optimize(rules=[str(rule)], builtin=False).compile(cache=False)
    try:
        st = load(sidecars(art.path)["intoto"])
        deps = {d["name"]: d["digest"]["sha256"] for d in st["predicate"]["buildDefinition"]["resolvedDependencies"]}
        assert deps == {"negneg.onnx": sha256(path), "mine.rule": sha256(str(rule))}
    finally:
        shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def test_save_copies_every_sidecar(demo, tmp_path):
    _, art = demo
    out = art.save(tmp_path / "libcuvil.so")
    copied = 0
    for key, src in sidecars(art.path).items():
        if key == "weights":      # only with external weights: none here, and none saved
            assert not os.path.exists(src) and not os.path.exists(sidecars(out)[key])
            continue
        with open(src, "rb") as a, open(sidecars(out)[key], "rb") as b:
            assert a.read() == b.read(), key
        copied += 1
    assert copied == 4


def test_saved_under_another_name_the_records_name_the_files_as_they_are(demo, tmp_path):
    _, art = demo
    out = art.save(tmp_path / "libdemo.so")
    st = load(sidecars(out)["intoto"])
    subjects = {s["name"]: s["digest"]["sha256"] for s in st["subject"]}
    assert subjects == {n: sha256(p) for n, p in artifact_files(out, provenance=False).items()}
    assert "libdemo.so" in subjects and "libdemo.cdx.json" in subjects
    with open(sidecars(out)["cdx"], encoding="utf-8") as f:
        text = f.read()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    bom = json.loads(text)
    assert bom["metadata"]["component"]["name"] == "libdemo.so"
    assert {c["name"] for c in bom["metadata"]["component"]["components"]} == {
        "libdemo.so", "libdemo.h", "libdemo.manifest.json"}


def test_gpu_bundle_has_its_sbom_and_provenance_inside(tmp_path):
    art = Pipeline.from_onnx(DEMO).optimize().compile("nvptx64-nvidia-cuda", arch="sm_90", cache=False)
    try:
        with open(os.path.join(art.path, "sbom.cdx.json"), encoding="utf-8") as f:
            text = f.read()
        assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
        bom = json.loads(text)
        props = {p["name"]: p["value"] for p in bom["metadata"]["component"]["properties"]}
        assert props["cuvil:target:arch"] == "sm_90"
        st = load(os.path.join(art.path, "provenance.intoto.json"))
        subjects = {s["name"]: s["digest"]["sha256"] for s in st["subject"]}
        files = sorted(f for f in os.listdir(art.path) if f != "provenance.intoto.json")
        assert sorted(subjects) == files
        assert all(subjects[f] == sha256(os.path.join(art.path, f)) for f in files)
        assert art.timings and "compile_seconds" not in art.manifest
    finally:
        shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)


def test_a_poisoned_cache_entry_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path / "cache"))
    p = Pipeline.from_onnx(DEMO).optimize()
    first = p.compile(opt_level=1)
    entry = os.path.dirname(first.path)
    assert os.path.isfile(os.path.join(entry, DIGESTS_FILE)) and entry.startswith(artifact_cache_dir())
    good = sha256(first.path)
    assert p.compile(opt_level=1).cached                         # an intact entry is used
    with open(first.path, "r+b") as f:                           # one byte of the code changed
        f.seek(os.path.getsize(first.path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    with pytest.warns(RuntimeWarning, match="does not match the digests"):
        again = p.compile(opt_level=1)
    assert not again.cached and sha256(again.path) == good      # rebuilt, not the poisoned library
    manifest = sidecars(again.path)["manifest"]                  # a sidecar altered: refused as well
    with open(manifest, "a", encoding="utf-8") as f:
        f.write(" ")
    with pytest.warns(RuntimeWarning, match="does not match the digests"):
        assert not p.compile(opt_level=1).cached


def test_cache_key_names_the_isa_features(monkeypatch):
    """Two CPUs of the same name (and identity string) but different features: different keys, so a shared
    cache never hands the AVX-512 library to the AVX2 host."""
    g = Pipeline.from_onnx(DEMO).optimize().graph
    monkeypatch.setattr(x86_target, "cpu_identity", lambda cpu: "same-cpu")
    keys = []
    for feats in ({"avx", "avx2", "fma"}, {"avx", "avx2", "fma", "avx512f", "avx512bw"}):
        monkeypatch.setattr(x86_target, "describe_cpu",
                            lambda cpu, f=feats: CpuDescription(llvm_name="same-cpu", features=frozenset(f),
                                                                is_host=True))
        keys.append(x86_target.TARGET.plan(g, x86_target.X86Options(), {}).key_parts)
    assert keys[0] != keys[1]
    assert any("avx512f" in k for k in keys[1]) and not any("avx512f" in k for k in keys[0])


def test_external_weights_are_a_subject_and_the_key_is_never_recorded(tmp_path):
    """An encrypted weights file is one of the provenance's subjects; the key (given as its 32 bytes, or as a
    key file) appears in neither record, nor does the key file's path."""
    key = bytes(range(32))
    key_file = tmp_path / "weights.key"
    key_file.write_bytes(key)
    for given in (key, str(key_file)):
        art = Pipeline.from_onnx(DEMO).optimize().compile(fixed={"N": 1}, encrypt_weights=given, cache=False)
        try:
            s = sidecars(art.path)
            subjects = {x["name"]: x["digest"]["sha256"] for x in load(s["intoto"])["subject"]}
            assert subjects["libcuvil.weights"] == sha256(s["weights"])
            for doc in (s["intoto"], s["cdx"]):
                with open(doc, "rb") as f:
                    data = f.read()
                assert key.hex().encode() not in data and repr(key).encode() not in data
                assert str(tmp_path).encode() not in data
            recorded = load(s["intoto"])["predicate"]["buildDefinition"]["externalParameters"]["options"][
                "encrypt_weights"]
            assert isinstance(recorded, str) and recorded      # recorded as given (or by the key's id) ...
            assert repr(key) not in recorded and key.hex() not in recorded and str(key_file) not in recorded
        finally:
            shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)
