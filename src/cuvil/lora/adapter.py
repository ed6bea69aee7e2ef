"""Read a LoRA adapter: a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, read with the
``safetensors`` package's numpy API, no torch) or an onnxruntime ``.onnx_adapter`` file (read here, without
onnxruntime). The result is an :class:`Adapter`: per adapted module its ``A`` [r, in], ``B`` [out, r] in PEFT's
(torch Linear) layout and its scale, every tensor checked (rank > 0, shapes that chain, finite values)."""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import CuvilError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ONNX_ADAPTER_SUFFIX = ".onnx_adapter"
#: PEFT prefixes the module names it saves with the wrapper's attribute path.
PEFT_PREFIX = "base_model.model."
#: ``<module>.lora_A.weight`` (PEFT's saved form) or ``<module>.lora_A.<adapter name>.weight`` (a live state dict).
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<name>[^.]+))?\.weight$")
#: Config keys whose truthy value asks for something this merge does not compute.
_REFUSED_CONFIG = {
    "use_dora": "DoRA (use_dora) rescales each column of the merged weight by a learned magnitude",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
}


@dataclass
class LoraModule:
    """One adapted module. ``A`` [r, in] and ``B`` [out, r] as PEFT stores them (torch Linear layout, whatever
    the base layer's layout); ``scale`` = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora);
    ``fan_in_fan_out``: the base weight is stored [in, out] (GPT-2's Conv1D). The update of W[out, in] is
    ``scale * B @ A``."""

    module: str
    A: np.ndarray
    B: np.ndarray
    scale: float
    fan_in_fan_out: bool = False

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.A.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.B.shape[0])

    def delta(self, dtype=np.float64) -> np.ndarray:
        """``scale * B @ A`` as [out, in] (torch Linear layout), computed in ``dtype``."""
        return (self.B.astype(dtype) @ self.A.astype(dtype)) * dtype(self.scale)


@dataclass
class Adapter:
    """A read adapter: ``name`` (the directory or file stem), ``path``, ``modules`` keyed by module name (the
    PEFT key less ``base_model.model.`` and ``.lora_A.weight``), ``config`` (adapter_config.json as read, or
    ``{}`` for an .onnx_adapter without one)."""

    name: str
    path: str
    modules: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def read_adapter(path, name: Optional[str] = None) -> Adapter:
    """Read the adapter at ``path``: a PEFT directory, its ``adapter_model.safetensors`` or an
    ``.onnx_adapter`` file. Raises one :class:`CuvilError` naming the first problem."""
    p = Path(os.fspath(path))
    if not p.exists():
        raise CuvilError(f"LoRA adapter {str(p)!r} does not exist",
                         hint="give a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                              "or an .onnx_adapter file")
    if p.is_dir():
        cfg_path, weights_path = p / CONFIG_NAME, p / WEIGHTS_NAME
        if not weights_path.exists():
            bins = sorted(x.name for x in p.iterdir() if x.name.endswith((".bin", ".pt", ".onnx_adapter")))
            raise CuvilError(f"LoRA adapter directory {str(p)!r} has no {WEIGHTS_NAME}",
                             details=[f"found: {', '.join(bins)}"] if bins else [],
                             hint="save the adapter with PEFT's save_pretrained(..., safe_serialization=True), "
                                  "or give the .onnx_adapter file itself")
        config = _read_config(cfg_path) if cfg_path.exists() else None
        if config is None:
            raise CuvilError(f"LoRA adapter directory {str(p)!r} has no {CONFIG_NAME}",
                             hint="PEFT's save_pretrained writes it next to the weights; it gives lora_alpha and r")
        tensors = _read_safetensors(weights_path)
        return _build(name or p.name, str(p), tensors, config, str(weights_path))
    if p.name.endswith(ONNX_ADAPTER_SUFFIX):
        cfg_path = p.parent / CONFIG_NAME
        config = _read_config(cfg_path) if cfg_path.exists() else {}
        tensors = read_onnx_adapter(p)
        return _build(name or p.name[:-len(ONNX_ADAPTER_SUFFIX)], str(p), tensors, config, str(p))
    if p.name.endswith(".safetensors"):
        cfg_path = p.parent / CONFIG_NAME
        if not cfg_path.exists():
            raise CuvilError(f"no {CONFIG_NAME} next to {str(p)!r}", hint="give the PEFT adapter directory")
        return _build(name or p.parent.name, str(p.parent), _read_safetensors(p), _read_config(cfg_path), str(p))
    raise CuvilError(f"{str(p)!r} is not a LoRA adapter",
                     hint="give a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                          "or an onnxruntime .onnx_adapter file")


# ---------------------------------------------------------------------------------------------------------------
def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CuvilError(f"cannot read {str(path)!r}: {e}", hint="it must be the JSON PEFT's save_pretrained writes")
    if not isinstance(config, dict):
        raise CuvilError(f"{str(path)!r} is not a JSON object", hint="it must be the JSON PEFT's save_pretrained writes")
    return config


def _read_safetensors(path: Path) -> dict:
    try:
        from safetensors.numpy import load_file
    except ImportError:  # pragma: no cover - the lora extra brings it
        raise CuvilError("reading a PEFT adapter needs the safetensors package",
                         hint="pip install 'cuvil[lora]' (or pip install safetensors)")
    try:
        return dict(load_file(str(path)))
    except Exception as e:  # the package raises its own SafetensorError / TypeError for bf16
        if "bf16" in str(e).lower() or "bfloat16" in str(e).lower():
            return _read_safetensors_raw(path)
        raise CuvilError(f"cannot read {str(path)!r} as safetensors: {e}",
                         hint="save the adapter again with PEFT's save_pretrained(..., safe_serialization=True)")


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_safetensors_raw(path: Path) -> dict:
    """The safetensors layout read directly, for the types numpy lacks (BF16, through ml_dtypes)."""
    import ml_dtypes
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        dt = ml_dtypes.bfloat16 if meta["dtype"] == "BF16" else _ST_DTYPES.get(meta["dtype"])
        if dt is None:
            raise CuvilError(f"{str(path)!r}: tensor {key!r} has dtype {meta['dtype']}",
                             hint="LoRA tensors must be F32, F16 or BF16")
        a, b = meta["data_offsets"]
        out[key] = np.frombuffer(data[8 + n + a:8 + n + b], dtype=dt).reshape(meta["shape"]).copy()
    return out


# onnxruntime's adapter format (onnxruntime/core/flatbuffers/schema/adapter_format.fbs), read without onnxruntime:
#   table Parameter { name:string; dims:[int64]; data_type:TensorDataType; raw_data:[uint8]; }
#   table Adapter { format_version:int; adapter_version:int; model_version:int; parameters:[Parameter]; }
_ORT_DTYPES = {1: np.float32, 10: np.float16, 11: np.float64}


def read_onnx_adapter(path) -> dict:
    """The parameters of an onnxruntime ``.onnx_adapter`` file as ``{name: ndarray}``."""
    data = Path(path).read_bytes()
    try:
        return _parse_onnx_adapter(data)
    except CuvilError:
        raise
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise CuvilError(f"{str(path)!r} is not a readable .onnx_adapter file ({e})",
                         hint="write it with onnxruntime.AdapterFormat (export_adapter)")


def _parse_onnx_adapter(data: bytes) -> dict:
    def u32(pos):
        return struct.unpack_from("<I", data, pos)[0]

    def field_pos(table, index):
        vtable = table - struct.unpack_from("<i", data, table)[0]
        vt_size = struct.unpack_from("<H", data, vtable)[0]
        slot = 4 + 2 * index
        if slot >= vt_size:
            return None
        off = struct.unpack_from("<H", data, vtable + slot)[0]
        return table + off if off else None

    def vector(pos):
        start = pos + u32(pos)
        return start + 4, u32(start)

    if len(data) < 8 or data[4:8] != b"TORT":
        raise CuvilError("not an onnxruntime adapter (no 'TORT' file identifier)",
                         hint="write it with onnxruntime.AdapterFormat (export_adapter)")
    root = u32(0)
    params_pos = field_pos(root, 3)
    if params_pos is None:
        return {}
    vec, count = vector(params_pos)
    out = {}
    for i in range(count):
        elem = vec + 4 * i
        table = elem + u32(elem)
        name_pos = field_pos(table, 0)
        s, n = vector(name_pos)
        name = data[s:s + n].decode("utf-8")
        dims_pos = field_pos(table, 1)
        dims = []
        if dims_pos is not None:
            d, nd = vector(dims_pos)
            dims = list(struct.unpack_from(f"<{nd}q", data, d))
        dt_pos = field_pos(table, 2)
        dtype_code = struct.unpack_from("<i", data, dt_pos)[0] if dt_pos is not None else 0
        if dtype_code == 16:
            import ml_dtypes
            dt = ml_dtypes.bfloat16
        else:
            dt = _ORT_DTYPES.get(dtype_code)
        if dt is None:
            raise CuvilError(f".onnx_adapter parameter {name!r} has ONNX data type {dtype_code}",
                             hint="LoRA tensors must be float32, float16 or bfloat16")
        raw_pos = field_pos(table, 3)
        r, nr = vector(raw_pos) if raw_pos is not None else (0, 0)
        out[name] = np.frombuffer(data[r:r + nr], dtype=dt).reshape(dims).copy()
    return out


# ---------------------------------------------------------------------------------------------------------------
def pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key equal to the module name or matching its end
    as a regular expression (``(.*\\.)?KEY$``), else ``default``."""
    for key, value in (patterns or {}).items():
        if key == module:
            return value
        try:
            if re.match(rf"(.*\.)?(?:{key})$", module):
                return value
        except re.error:   # not a regular expression: an exact name only (checked above)
            continue
    return default


def _build(name: str, path: str, tensors: dict, config: dict, weights_file: str) -> Adapter:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise CuvilError(f"adapter {name!r} is a {peft_type} adapter, not LoRA",
                         hint="Cuvil merges LoRA adapters (peft_type LORA) only")
    for key, why in _REFUSED_CONFIG.items():
        if config.get(key):
            raise CuvilError(f"adapter {name!r}: {key}=true is not supported ({why})",
                             hint=f"train the adapter without {key}, or merge it with PEFT's merge_and_unload() "
                                  "and export the merged model")
    pairs: dict = {}
    others = []
    for key, value in tensors.items():
        m = _KEY.match(key)
        if not m:
            others.append(key)
            continue
        module = m.group("module")
        if module.startswith(PEFT_PREFIX):
            module = module[len(PEFT_PREFIX):]
        pairs.setdefault(module, {})[m.group("which")] = (key, value)
    if others:
        what = ("lora_embedding_A/B (an adapted Embedding)" if any("lora_embedding" in k for k in others)
                else "tensors that are not lora_A/lora_B weights (modules_to_save, biases, magnitudes)")
        raise CuvilError(f"adapter {name!r} has {len(others)} {what}: Cuvil merges Linear/Conv1D LoRA only",
                         details=sorted(others)[:6],
                         hint="train the adapter with target_modules on Linear layers only and no modules_to_save")
    if not pairs:
        raise CuvilError(f"adapter {name!r} ({weights_file}) has no lora_A/lora_B tensors",
                         hint="the keys look like base_model.model.<module>.lora_A.weight; is this a LoRA adapter?")
    r_default = config.get("r", None)
    alpha_default = config.get("lora_alpha", None)
    rslora = bool(config.get("use_rslora", False))
    fifo = bool(config.get("fan_in_fan_out", False))
    modules = {}
    for module in sorted(pairs):
        got = pairs[module]
        for which in "AB":
            if which not in got:
                other = got["B" if which == "A" else "A"][0]
                raise CuvilError(f"adapter {name!r}: module {module!r} has {other!r} but no lora_{which} tensor",
                                 hint=f"the adapter file is incomplete: save it again with PEFT ({weights_file})")
        (ka, A), (kb, B) = got["A"], got["B"]
        if A.ndim != 2 or B.ndim != 2:
            raise CuvilError(f"adapter {name!r}: module {module!r} has lora_A {list(A.shape)} and lora_B "
                             f"{list(B.shape)}; Cuvil merges 2-D (Linear/Conv1D) LoRA only",
                             hint="adapt the Linear layers only (target_modules), not Conv2d/Embedding")
        if A.shape[0] == 0 or B.shape[1] == 0:
            raise CuvilError(f"adapter {name!r}: module {module!r} has rank 0 (lora_A {list(A.shape)}, "
                             f"lora_B {list(B.shape)})", hint="train the adapter with r >= 1")
        if A.shape[0] != B.shape[1]:
            raise CuvilError(f"adapter {name!r}: module {module!r}: lora_A {list(A.shape)} and lora_B "
                             f"{list(B.shape)} do not chain (need A [r, in] and B [out, r])",
                             hint="PEFT stores lora_A.weight as [r, in_features] and lora_B.weight as "
                                  "[out_features, r]; check the adapter's layout")
        for key, t in ((ka, A), (kb, B)):
            if not np.issubdtype(np.dtype(t.dtype), np.floating) and str(t.dtype) != "bfloat16":
                raise CuvilError(f"adapter {name!r}: tensor {key!r} has dtype {t.dtype}",
                                 hint="LoRA tensors must be float32, float16 or bfloat16")
            bad = int(np.count_nonzero(~np.isfinite(t.astype(np.float64))))
            if bad:
                raise CuvilError(f"adapter {name!r}: tensor {key!r} has {bad} non-finite value(s) (NaN or inf) "
                                 f"of {t.size}", hint="the training diverged: use another checkpoint")
        rank = int(A.shape[0])
        r_cfg = pattern_value(config.get("rank_pattern") or {}, module, r_default)
        if r_cfg is None:
            r_cfg = rank
        if int(r_cfg) != rank:
            raise CuvilError(f"adapter {name!r}: module {module!r} has rank {rank} in its tensors but r={r_cfg} "
                             "in adapter_config.json (r / rank_pattern)",
                             hint="the config and the weights come from different adapters; save both again")
        alpha = pattern_value(config.get("alpha_pattern") or {}, module, alpha_default)
        if alpha is None:
            alpha = rank  # an .onnx_adapter without a config: the scale is folded into the tensors (1.0)
        scale = float(alpha) / (math.sqrt(rank) if rslora else rank)
        if not math.isfinite(scale):
            raise CuvilError(f"adapter {name!r}: module {module!r} has a non-finite scale {scale}",
                             hint="check lora_alpha in adapter_config.json")
        modules[module] = LoraModule(module=module, A=A, B=B, scale=scale, fan_in_fan_out=fifo)
    return Adapter(name=name, path=path, modules=modules, config=dict(config))
