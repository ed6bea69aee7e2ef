"""The CPU Cuvil builds for (cuvil.targets.x86.cpu): kernel widths from ISA features, never from CPU names;
``--cpu`` checked against the names LLVM knows before any work; the ISA features a library needs in its
manifest, and a library refused (in Python and in its own C code) on a CPU without them."""
import json
import os
import shutil
import subprocess
import sys

import llvmlite.binding as llvm
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil import CuvilError, Pipeline
from cuvil.targets.x86.cpu import (C_CHECKED_FEATURES, CpuDescription, check_runs_here, describe_cpu, describe_host,
                                   host_cpu, llvm_cpu_features, llvm_cpu_names, missing_features, portable_cpu,
                                   tuning_name, validate_cpu, vector_bits_of)
from cuvil.targets.x86.target import X86Options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout first, the caller's path after it (a machine whose deps live on PYTHONPATH still finds them)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")) if p)}
DEMO = os.path.join(ROOT, "src", "cuvil", "data", "demo_cnn.onnx")


# ----------------------------------------------------------------------------------------- widths from features

@pytest.mark.parametrize("features, bits", [
    ({"avx512f", "avx2", "fma", "avx"}, 512),
    ({"avx512f"}, 512),                        # AVX-512 Foundation alone decides 512
    ({"avx2", "fma", "avx", "f16c"}, 256),
    ({"avx2", "avx"}, 128),                    # AVX2 without FMA: the 256-bit micro-kernels need both
    ({"fma", "avx"}, 128),
    ({"sse2", "sse4.2"}, 128),
    (set(), 128),
])
def test_vector_width_comes_from_features(features, bits):
    assert vector_bits_of(features) == bits
    desc = CpuDescription(llvm_name="whatever-llvm-guessed", features=frozenset(features), is_host=True)
    assert desc.vector_bits == bits


def _fake_llvm(enabled):
    return {f: f in enabled for f in ("avx", "avx2", "avx512f", "fma", "sse2", "amx-tile")}


def test_host_identity_from_cpuinfo_and_features_from_cpuid():
    info = {"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Platinum 8488C", "cpu family": "6",
            "model": "143", "stepping": "8", "flags": "fpu sse2 avx avx2 fma avx512f amx_tile"}
    d = describe_host(info, _fake_llvm({"avx", "avx2", "avx512f", "fma", "sse2", "amx-tile"}), "sapphirerapids")
    assert (d.vendor, d.model_name, d.family, d.model, d.stepping) == ("GenuineIntel", info["model name"], 6, 143, 8)
    assert d.vector_bits == 512 and "amx-tile" in d.features and d.notes == ()
    assert d.label() == "Intel(R) Xeon(R) Platinum 8488C (family 6, model 143, stepping 8)"
    assert d.llvm_features == "+amx-tile,+avx,+avx2,+avx512f,+fma,+sse2"


def test_a_width_feature_the_kernel_disabled_is_not_used():
    """cpuid says AVX-512 but the kernel's flags lack it (clearcpuid, no OS support): 256-bit kernels, a note,
    and the target machine told -avx512f."""
    info = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 9B45", "flags": "sse2 avx avx2 fma"}
    d = describe_host(info, _fake_llvm({"avx", "avx2", "avx512f", "fma", "sse2"}), "znver4")
    assert d.vector_bits == 256 and "avx512f" not in d.features
    assert "-avx512f" in d.llvm_features.split(",") and any("avx512f" in n for n in d.notes)


def test_this_host_is_described():
    h = host_cpu()
    assert h.is_host and h.features and h.vector_bits in (128, 256, 512)
    enabled = {k for k, v in llvm.get_host_cpu_features().items() if v}
    assert h.features <= enabled and (h.notes or h.features == enabled)
    assert h.vector_bits == vector_bits_of(h.features)


# ------------------------------------------------------------------------------------------------ named CPUs

# -------------------------------------------------------------------------- the LLVM name tuned for (issue 20)

#: A Sapphire Rapids VM's cpuid: LLVM's sapphirerapids features less those hypervisors commonly hide.
_VM_HIDDEN = {"enqcmd", "pconfig", "ptwrite", "uintr", "waitpkg"}


def _spr_vm_features():
    return llvm_cpu_features("sapphirerapids") - _VM_HIDDEN


def test_a_guess_lacking_the_cpus_features_is_replaced(tmp_path, monkeypatch):
    """LLVM names a Sapphire Rapids-class VM reporting model 167 `rocketlake` (no AMX, no AVX512-FP16): the
    name tuned for is one of LLVM's CPUs with every feature the guess had and the AMX/FP16 ones too."""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    feats = _spr_vm_features()
    assert {"amx-tile", "avx512fp16"} - llvm_cpu_features("rocketlake")      # the premise: the guess lacks them
    name = tuning_name("rocketlake", feats)
    have = llvm_cpu_features(name)
    assert name != "rocketlake" and {"amx-tile", "amx-bf16", "amx-int8", "avx512fp16"} <= have
    assert feats & llvm_cpu_features("rocketlake") <= have
    assert len(have & feats) >= len(llvm_cpu_features("sapphirerapids") & feats)   # none covers more
    # kept per LLVM, guess and features: the second answer comes from the file, a damaged file is recomputed
    (entry,) = (tmp_path / "cpu-names").iterdir()
    assert tuning_name("rocketlake", feats) == name
    for damaged in ("{not json", '{"name": 5}', '{"name": "--help"}'):
        entry.write_text(damaged)
        assert tuning_name("rocketlake", feats) == name


def test_a_guess_with_every_feature_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    for guess in ("znver4", "sapphirerapids", "x86-64-v3"):
        assert tuning_name(guess, llvm_cpu_features(guess)) == guess
    # a CPU with fewer features than the guess names (a VM hiding AVX-512) keeps it too: nothing to gain
    assert tuning_name("znver4", llvm_cpu_features("x86-64-v3")) == "znver4"


def test_the_tuning_name_never_widens_what_the_library_may_use(tmp_path, monkeypatch):
    """The library's ISA is cpuid's, not the name's: features the name has but this CPU lacks (hidden by the
    hypervisor) are switched off in the target machine's feature string and never required of a CPU."""
    monkeypatch.setenv("CUVIL_CACHE_DIR", str(tmp_path))
    feats = _spr_vm_features()
    keys = sorted(llvm.get_host_cpu_features())
    if not _VM_HIDDEN <= set(keys):
        pytest.skip(f"this LLVM does not read {sorted(_VM_HIDDEN - set(keys))} from cpuid")
    info = {"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "cpu family": "6",
            "model": "167", "stepping": "8", "flags": "sse2 avx avx2 fma avx512f amx_tile"}
    d = describe_host(info, {k: k in feats for k in keys}, "rocketlake")
    assert d.llvm_name != "rocketlake" and any("rocketlake" in n and d.llvm_name in n for n in d.notes)
    assert d.features == feats & set(keys)
    assert _VM_HIDDEN & llvm_cpu_features(d.llvm_name)      # the name has features this CPU lacks ...
    off = {f[1:] for f in d.llvm_features.split(",") if f.startswith("-")}
    assert _VM_HIDDEN <= off and not _VM_HIDDEN & d.features        # ... which are switched off, not required
    assert missing_features(d.features, d) == ()


def test_this_hosts_name_has_at_least_the_guesss_features():
    h = host_cpu()
    guess = llvm.get_host_cpu_name()
    assert h.features & llvm_cpu_features(guess) <= llvm_cpu_features(h.llvm_name)
    assert (h.llvm_name == guess) == (not any("LLVM guessed" in n for n in h.notes))


def test_named_cpus_get_llvm_features():
    v3, base = describe_cpu("x86-64-v3"), describe_cpu("x86-64")
    assert {"avx2", "fma", "bmi2", "f16c", "64bit"} <= v3.features and "avx512f" not in v3.features
    assert v3.vector_bits == 256 and not v3.is_host and v3.llvm_features == ""
    assert "avx" not in base.features and base.vector_bits == 128
    assert {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= describe_cpu("skylake-avx512").features
    assert describe_cpu("x86-64-v4").vector_bits == 512


def test_a_cpu_no_table_names_still_gets_its_width():
    """diamondrapids was missing from the old name table and got 128-bit kernels."""
    if "diamondrapids" not in llvm_cpu_names():
        pytest.skip("this LLVM does not know diamondrapids")
    assert describe_cpu("diamondrapids").vector_bits == 512


def test_native_and_host_mean_this_machine():
    for name in (None, "native", "host"):
        assert validate_cpu(name) == name
        assert describe_cpu(name) is host_cpu()


@pytest.mark.parametrize("name, near", [("zen5", "znver5"), ("skylake_avx", "skylake-avx512"),
                                        ("sapphire-rapids", "sapphirerapids"), ("nativ", "native")])
def test_unknown_cpu_names_are_refused_with_the_nearest(name, near):
    with pytest.raises(CuvilError) as e:
        validate_cpu(name)
    assert f"unknown CPU {name!r}" in e.value.message and near in " ".join(e.value.details)
    assert "--cpu native" in e.value.hint


def test_a_32_bit_cpu_is_refused():
    assert "i686" in llvm_cpu_names()
    with pytest.raises(CuvilError, match="no 64-bit mode") as e:
        validate_cpu("i686")
    assert "x86-64-v3" in e.value.hint


def test_options_check_the_cpu():
    with pytest.raises(CuvilError, match="unknown CPU 'zen5'"):
        X86Options(cpu="zen5")
    assert X86Options(cpu="znver3").cpu == "znver3"


@pytest.mark.parametrize("model", [DEMO, "no-such-model.onnx"])
def test_cli_refuses_an_unknown_cpu_without_llvm_noise(tmp_path, model):
    """Before any work (the model is not even read) and with nothing but Cuvil's error on stderr."""
    out = subprocess.run([sys.executable, "-m", "cuvil", "compile", model, "-o", str(tmp_path / "libx.so"),
                          "--cpu", "zen5"], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("cuvil: error: unknown CPU 'zen5' (--cpu)")
    assert "znver5" in out.stderr and "next: --cpu native" in out.stderr
    # nothing but the error: no LLVM warning ("not a recognized processor") or abort ("LLVM ERROR")
    lines = out.stderr.rstrip("\n").split("\n")
    assert all(ln.startswith("  ") for ln in lines[1:]) and len(lines) <= 4, out.stderr
    assert "LLVM ERROR" not in out.stderr and "not a recognized processor" not in out.stderr
    assert not (tmp_path / "libx.so").exists()


# ------------------------------------------------------------------------- what a library needs, and refusal

def _small_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(48, dtype=np.float32).reshape(8, 6) / 48, "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
                          "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])], initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def native_lib(tmp_path_factory):
    art = Pipeline.from_onnx(_small_model()).optimize().compile(cache=False)
    return art.save(tmp_path_factory.mktemp("native") / "libsmall.so")


def _manifest_path(so):
    return so[:-3] + ".manifest.json"


def test_manifest_records_the_isa_features(native_lib):
    target = json.load(open(_manifest_path(native_lib)))["target"]
    assert target["isa_features"] == sorted(host_cpu().features)
    assert target["vector_bits"] == host_cpu().vector_bits and target["native"] is True
    assert target["built_on"] == host_cpu().label()
    x = np.ones((4, 8), np.float32)
    (y,) = cuvil.load(native_lib).run(x)       # this CPU has them all
    assert y.shape == (4, 6)


def test_a_library_needing_a_feature_this_cpu_lacks_is_refused(native_lib, tmp_path):
    lacking = sorted(k for k, v in llvm.get_host_cpu_features().items() if not v)
    assert lacking, "every CPU lacks some feature LLVM knows (AMX on AMD, SSE4a on Intel)"
    so = shutil.copy(native_lib, tmp_path / "libsmall.so")
    shutil.copy(native_lib[:-3] + ".h", tmp_path / "libsmall.h")
    m = json.load(open(_manifest_path(native_lib)))
    m["target"]["isa_features"] += lacking[:2]
    json.dump(m, open(_manifest_path(str(so)), "w"))
    with pytest.raises(CuvilError) as e:
        cuvil.load(str(so))
    assert e.value.message.startswith("libsmall.so was built for") and all(f in e.value.message for f in lacking[:2])
    assert "--cpu native" in e.value.hint and "--cpu x86-64-v3" in e.value.hint


def _foreign_cpu():
    """A 64-bit CPU LLVM knows with a feature that __builtin_cpu_supports checks and this host lacks (Bulldozer's
    XOP/FMA4 on every recent CPU; AVX-512 on an AVX2-only host), or None."""
    for name in ("bdver4", "skylake-avx512", "znver4"):
        missing = set(llvm_cpu_features(name)) - host_cpu().features
        if missing & set(C_CHECKED_FEATURES):
            return name, missing
    return None


def test_a_library_built_for_another_cpu_is_refused_in_python_and_in_c(tmp_path):
    found = _foreign_cpu()
    if found is None:
        pytest.skip("this CPU has every feature of the candidate CPUs")
    name, missing = found
    art = Pipeline.from_onnx(_small_model()).optimize().compile(cpu=name, cache=False)
    assert art.manifest["target"]["cpu"] == name and set(art.manifest["target"]["isa_features"]) >= missing
    with pytest.raises(CuvilError, match=f"built for {name} and may use instructions this CPU lacks"):
        cuvil.load(art.path)
    # without the manifest's list (a C program reads no manifest), the library's own check refuses the session
    so = art.save(tmp_path / "libforeign.so")
    m = json.load(open(_manifest_path(so)))
    del m["target"]["isa_features"]
    json.dump(m, open(_manifest_path(so), "w"))
    model = cuvil.load(so)
    with pytest.raises(CuvilError, match="this CPU lacks .*recompile the model on this machine"):
        model.run(np.ones((4, 8), np.float32))


def test_check_runs_here_names_every_missing_feature():
    with pytest.raises(CuvilError, match="may use instructions this CPU lacks: no-such-a, no-such-b"):
        check_runs_here(["no-such-b", "no-such-a", *sorted(host_cpu().features)], "libx.so", "somecpu")
    check_runs_here(sorted(host_cpu().features), "libx.so", "native")


def test_the_portable_level_suggested_runs_here():
    level = portable_cpu()
    assert level in ("x86-64-v3", "x86-64-v2", "x86-64")
    assert llvm_cpu_features(level) <= host_cpu().features
