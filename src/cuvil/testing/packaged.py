"""Models as they ship inside PyPI packages (PaddleOCR's detector and recogniser in ``rapidocr-onnxruntime``,
ddddocr's detector and CRNN), fetched with ``pip download`` into a cache (``CUVIL_TEST_MODELS``, default
``~/.cache/cuvil/test-models``) and checked by sha256: the wheel as published, the model file in it. Used by
tests/test_packaged_models.py and bench/ocr_detector.py."""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

import onnx

CACHE = pathlib.Path(os.environ.get("CUVIL_TEST_MODELS", pathlib.Path.home() / ".cache" / "cuvil" / "test-models"))

RAPIDOCR = ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
            "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf")
DDDDOCR = ("ddddocr==1.6.1", "ddddocr-1.6.1-py3-none-any.whl",
           "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935")
FETCHED = {
    "captcha_det": (DDDDOCR, "ddddocr/common_det.onnx", "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6"),
    "captcha_ocr": (DDDDOCR, "ddddocr/common.onnx", "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8"),
    "ocr_det": (RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9"),
    "ocr_rec": (RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b"),
}


class FetchError(RuntimeError):
    """The wheel could not be downloaded (offline, or PyPI unreachable)."""


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetched_path(key: str, cache: pathlib.Path = CACHE) -> pathlib.Path:
    """The model file ``key`` of FETCHED, from the cache or from PyPI; FetchError when it cannot be fetched, an
    AssertionError when a wheel or model does not have the sha256 this was written against."""
    (requirement, wheel_name, wheel_sha), member, model_sha = FETCHED[key]
    target = cache / pathlib.Path(member).name
    if target.exists() and sha256(target) == model_sha:
        return target
    wheel = cache / wheel_name
    if not (wheel.exists() and sha256(wheel) == wheel_sha):
        cache.mkdir(parents=True, exist_ok=True)
        try:
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                  "--disable-pip-version-check", "-q", "-d", str(cache), requirement],
                                 capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"cannot fetch {requirement} from PyPI: {e}") from e
        if run.returncode != 0 or not wheel.exists():
            last = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise FetchError(f"cannot fetch {requirement} from PyPI (offline?): {last}")
        assert sha256(wheel) == wheel_sha, f"{wheel_name} is not the wheel this was written against"
    with zipfile.ZipFile(wheel) as z:
        target.write_bytes(z.read(member))
    assert sha256(target) == model_sha, f"{member} in {wheel_name} changed"
    return target


def fetched(key: str, cache: pathlib.Path = CACHE) -> onnx.ModelProto:
    """The model ``key`` of FETCHED, loaded (see :func:`fetched_path`)."""
    return onnx.load(fetched_path(key, cache))
