"""``cuvil doctor``: the machine as Cuvil sees it, as text and as JSON, never failing for a missing optional part."""
import json
import os
import subprocess
import sys

from cuvil import doctor
from cuvil.targets.ptx import runtime as gpu_runtime
from cuvil.targets.x86.cpu import host_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cuvil", "doctor", *args], capture_output=True, text=True, env=ENV)


def test_doctor_json_has_every_section():
    out = _cli("--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    info = json.loads(out.stdout)
    assert set(info) == {"cuvil", "platform", "python", "cpu", "llvm", "cc", "packages", "optional", "cuda", "gpu",
                         "cache_dir"}
    cpu = host_cpu()
    assert info["cpu"]["model_name"] == cpu.model_name and info["cpu"]["vendor"] == cpu.vendor
    assert info["cpu"]["vector_bits"] == cpu.vector_bits and info["cpu"]["isa_features"] == sorted(cpu.features)
    assert info["llvm"]["llvmlite"] and info["llvm"]["llvm"].count(".") == 2
    assert set(info["optional"]) == {"onnxruntime", "onnxruntime-gpu", "torch", "cuda-python", "matplotlib", "tqdm"}
    assert info["packages"]["numpy"] and info["packages"]["onnx"]
    assert set(info["cuda"]) == {"ptxas", "libdevice"} and set(info["cuda"]["ptxas"]) == {"path", "version"}
    assert isinstance(info["gpu"]["available"], bool) and (info["gpu"]["available"] or info["gpu"]["reason"])


def test_doctor_text_names_the_cpu_and_the_width():
    out = _cli()
    assert out.returncode == 0 and out.stderr == "", out.stderr
    text = out.stdout
    assert f"CPU:        {host_cpu().model_name or 'unknown'}" in text
    assert f"{host_cpu().vector_bits}-bit" in text and "LLVM:" in text and "llvmlite" in text
    for line in ("ptxas:", "libdevice:", "GPU:", "optional:", "cache:"):
        assert line in text


def test_doctor_reports_a_failing_gpu_driver_instead_of_failing(monkeypatch):
    def no_driver(ordinal=0):
        raise gpu_runtime.NoGpuError("no CUDA driver/GPU: cuInit failed: CUDA_ERROR_NO_DEVICE")
    monkeypatch.setattr(doctor, "_version", lambda dist: "12.6.0" if dist == "cuda-python" else None)
    monkeypatch.setattr(gpu_runtime, "device_info", no_driver)
    info = doctor.collect()
    assert info["gpu"] == {"available": False, "reason": "NoGpuError: no CUDA driver/GPU: cuInit failed: "
                                                          "CUDA_ERROR_NO_DEVICE"}
    assert "GPU:        none (NoGpuError" in doctor.report_text(info)


def test_doctor_shows_a_gpu():
    info = doctor.collect()
    info["gpu"] = {"available": True, "name": "NVIDIA H200", "arch": "sm_90", "compute_capability": "9.0",
                   "multiprocessors": 132, "memory_bytes": 150 << 30, "driver_cuda_version": "12.8"}
    assert "GPU:        NVIDIA H200 (sm_90, 150.0 GiB), driver CUDA 12.8" in doctor.report_text(info)
