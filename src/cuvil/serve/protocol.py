"""The Open Inference Protocol (KServe v2, the HTTP/REST protocol Triton and KServe speak), pure: routes, request
parsing, response encoding and errors, with no Ray and no model in sight, so it is unit-tested in milliseconds.

A request body is JSON, ``{"id": ..., "parameters": {...}, "inputs": [{"name", "datatype", "shape", "data" |
"parameters": {"binary_data_size": N}}], "outputs": [{"name", "parameters": {"binary_data": bool}}]}``; with the
binary-data extension the header ``Inference-Header-Content-Length: N`` says the first N bytes are that JSON and
the tensors whose ``binary_data_size`` is given follow it as raw little-endian bytes, in input order. A response
carries its outputs the same way: as JSON ``data`` (flat, row-major), or as binary when the request asked for it
(an output's ``binary_data``, or the request's ``binary_data_output``).

Every refusal is an :class:`OIPError` (an HTTP status and one message), sent as ``{"error": message}``.
"""
from __future__ import annotations

import json
import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..errors import CuvilError
from ..targets.model_api import TensorSpec, code_name
from ..version import __version__

#: The binary-data extension's header: the length of the JSON part of a body.
HEADER_LENGTH = "inference-header-content-length"
#: The largest request body accepted by default (bytes); ``cuvil serve --max-body-mb`` sets another.
DEFAULT_MAX_BODY = 64 << 20

#: OIP tensor datatypes and their numpy dtypes (little-endian, as the binary extension sends them).
DATATYPES: Dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
#: The OIP datatype of each ONNX dtype code that has one (codes without one are shown by their ONNX name).
CODE_DATATYPES = {1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64", 8: "BYTES",
                  9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64", 16: "BF16"}


class OIPError(CuvilError):
    """A request the server refuses (``status`` 400) or could not answer (500, 503): one message for the
    client, sent as ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def cuvil_error_text(e: CuvilError) -> str:
    """A CuvilError as one line for a client: the message, then its next step (what the Python user reads too)."""
    return e.message + (f" (next: {e.hint})" if e.hint else "")


# --- routes -------------------------------------------------------------------------------------------------

_MODEL_ROUTE = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer)?/?$")


@attrs.frozen
class Route:
    """What a request asks for: ``kind`` one of server_metadata, live, ready, model_metadata, model_ready, infer
    (or ``None``: no such route); ``model`` the model's name for the model routes."""

    kind: Optional[str]
    model: Optional[str] = None
    method_ok: bool = True


def route(method: str, path: str) -> Route:
    """The OIP route of ``method path`` (``/v2/models/NAME[/versions/V][/ready|/infer]``, ``/v2/health/...``)."""
    path = path.rstrip("/") or "/"
    if path == "/v2":
        return Route("server_metadata", method_ok=method in ("GET", "HEAD"))
    if path in ("/v2/health/live", "/v2/health/ready"):
        return Route(path.rsplit("/", 1)[1], method_ok=method in ("GET", "HEAD"))
    m = _MODEL_ROUTE.match(path)
    if not m:
        return Route(None)
    name, tail = m.group(1), m.group(3)
    if tail == "/infer":
        return Route("infer", name, method_ok=method == "POST")
    return Route("model_ready" if tail == "/ready" else "model_metadata", name, method_ok=method in ("GET", "HEAD"))


# --- metadata -----------------------------------------------------------------------------------------------

def datatype_of(spec: TensorSpec) -> str:
    return CODE_DATATYPES.get(spec.code, code_name(spec.code).upper())


def tensor_metadata(spec: TensorSpec) -> dict:
    """``{"name", "datatype", "shape"}`` of one input or output; a symbolic dim is -1 in ``shape``, and then
    ``parameters.dims`` gives every dim by name (``["N", 3, 224, 224]``; null for an unnamed one)."""
    out = {"name": spec.name, "datatype": datatype_of(spec),
           "shape": [d if isinstance(d, int) else -1 for d in spec.dims]}
    if not all(isinstance(d, int) for d in spec.dims):
        out["parameters"] = {"dims": list(spec.dims)}
    return out


def model_metadata(name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], platform: str,
                   parameters: Optional[Mapping] = None) -> dict:
    """The OIP model metadata response: name, versions, platform, inputs and outputs (from the artifact's
    manifest, as the loaded model reads it); ``parameters`` extra facts (the batch symbol, the profiles)."""
    out = {"name": name, "versions": ["1"], "platform": platform,
           "inputs": [tensor_metadata(s) for s in inputs], "outputs": [tensor_metadata(s) for s in outputs]}
    if parameters:
        out["parameters"] = dict(parameters)
    return out


def server_metadata() -> dict:
    return {"name": "cuvil", "version": __version__, "extensions": ["binary_tensor_data"]}


# --- requests -----------------------------------------------------------------------------------------------

@attrs.frozen
class InferRequest:
    """A parsed infer request: ``inputs`` by name (numpy arrays of the datatype and shape the client gave);
    ``outputs`` the names asked for (None: all, in the model's order); ``binary`` the names to send back as
    binary data; ``binary_default`` whether outputs not listed go back as binary (``binary_data_output``)."""

    inputs: Dict[str, np.ndarray]
    outputs: Optional[Tuple[str, ...]] = None
    binary: frozenset = frozenset()
    binary_default: bool = False
    id: Optional[str] = None


def _field(obj, key: str, kind, where: str, required: bool = True):
    if not isinstance(obj, dict):
        raise OIPError(400, f"{where} is not a JSON object")
    if key not in obj:
        if required:
            raise OIPError(400, f"{where} has no '{key}'")
        return None
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OIPError(400, f"{where}: '{key}' is {type(value).__name__}, expected {getattr(kind, '__name__', kind)}")
    return value


def _shape(value, where: str) -> Tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in value):
        raise OIPError(400, f"{where}: 'shape' must be a list of non-negative integers, got {json.dumps(value)[:80]}")
    return tuple(value)


def _datatype(value: str, where: str) -> np.dtype:
    dt = DATATYPES.get(value)
    if dt is None:
        raise OIPError(400, f"{where}: datatype {value!r} is not supported (use one of {', '.join(DATATYPES)})")
    return dt


def _json_tensor(data, dtype: np.dtype, shape: Tuple[int, ...], where: str) -> np.ndarray:
    """A JSON ``data`` list (flat or nested, row-major) as an array of ``dtype`` and ``shape``; values of the
    wrong kind (a float for an INT64, a string anywhere) are refused, never cast."""
    if not isinstance(data, list):
        raise OIPError(400, f"{where}: 'data' must be a list, got {type(data).__name__}")
    try:
        raw = np.asarray(data)
    except (ValueError, TypeError) as e:
        raise OIPError(400, f"{where}: 'data' is not a rectangular list of numbers ({e})") from None
    count = math.prod(shape)
    if raw.size == 0 and count == 0:
        return np.zeros(shape, dtype)
    kinds = {"b": "b", "u": "biu", "i": "biu", "f": "biuf"}[dtype.kind]
    if raw.dtype.kind not in kinds:
        got = {"f": "floats", "U": "strings", "O": "mixed values or integers out of range", "b": "booleans",
               "i": "integers", "u": "integers"}.get(raw.dtype.kind, str(raw.dtype))
        raise OIPError(400, f"{where}: 'data' holds {got}, not {dtype.name} values as its datatype says")
    if raw.size != count:
        raise OIPError(400, f"{where}: 'data' has {raw.size} values, shape {list(shape)} needs {count}")
    if dtype.kind in "iu" and raw.dtype.kind in "iu" and raw.size:
        info = np.iinfo(dtype)
        if int(raw.min()) < info.min or int(raw.max()) > info.max:
            raise OIPError(400, f"{where}: 'data' holds integers outside the range of {dtype.name}")
    return raw.astype(dtype, copy=False).reshape(shape)


def parse_infer_request(body: bytes, header_length: Optional[str] = None,
                        max_body: int = DEFAULT_MAX_BODY) -> InferRequest:
    """An infer request's body (and its ``Inference-Header-Content-Length`` header, if any) as an
    :class:`InferRequest`; any fault is an :class:`OIPError` 400 that says what and where."""
    if len(body) > max_body:
        raise OIPError(400, f"request body of {len(body)} bytes is over the limit of {max_body} bytes")
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise OIPError(400, f"Inference-Header-Content-Length is {header_length!r}, not a number") from None
        if not 0 < n <= len(body):
            raise OIPError(400, f"Inference-Header-Content-Length {n} does not fit a body of {len(body)} bytes")
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, memoryview(b"")
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise OIPError(400, f"malformed JSON in the request: {e}") from None
    if not isinstance(req, dict):
        raise OIPError(400, "the request is not a JSON object")
    rid = req.get("id")
    if rid is not None and not isinstance(rid, str):
        raise OIPError(400, f"'id' is {type(rid).__name__}, expected a string")
    params = _field(req, "parameters", dict, "the request", required=False) or {}
    specs = _field(req, "inputs", list, "the request")
    if not specs:
        raise OIPError(400, "the request has no inputs")
    inputs: Dict[str, np.ndarray] = {}
    offset = 0
    for k, spec in enumerate(specs):
        where = f"inputs[{k}]"
        name = _field(spec, "name", str, where)
        where = f"input {name!r}"
        if name in inputs:
            raise OIPError(400, f"{where} is given twice")
        dtype = _datatype(_field(spec, "datatype", str, where), where)
        shape = _shape(_field(spec, "shape", list, where), where)
        p = _field(spec, "parameters", dict, where, required=False) or {}
        size = p.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise OIPError(400, f"{where}: binary_data_size is {size!r}, not a byte count")
            if "data" in spec:
                raise OIPError(400, f"{where} has both 'data' and binary_data_size")
            want = math.prod(shape) * dtype.itemsize
            if size != want:
                raise OIPError(400, f"{where}: binary_data_size {size} does not match {dtype.name}{list(shape)} "
                                    f"({want} bytes)")
            if offset + size > len(binary):
                raise OIPError(400, f"{where}: {size} bytes of binary data expected, the body has "
                                    f"{len(binary) - offset} left")
            inputs[name] = np.frombuffer(binary[offset:offset + size], dtype=dtype).reshape(shape)
            offset += size
        else:
            if "data" not in spec:
                raise OIPError(400, f"{where} has neither 'data' nor parameters.binary_data_size")
            inputs[name] = _json_tensor(spec["data"], dtype, shape, where)
    if offset != len(binary):
        raise OIPError(400, f"{len(binary) - offset} bytes of binary data after the last binary input")
    binary_default = bool(params.get("binary_data_output", False))
    outputs, binary_names = None, set()
    wanted = _field(req, "outputs", list, "the request", required=False)
    if wanted is not None:
        names = []
        for k, spec in enumerate(wanted):
            name = _field(spec, "name", str, f"outputs[{k}]")
            op = _field(spec, "parameters", dict, f"output {name!r}", required=False) or {}
            if op.get("binary_data", binary_default):
                binary_names.add(name)
            names.append(name)
        outputs = tuple(names)
    return InferRequest(inputs=inputs, outputs=outputs, binary=frozenset(binary_names),
                        binary_default=binary_default, id=rid)


# --- responses ----------------------------------------------------------------------------------------------

def _datatype_of_array(a: np.ndarray) -> str:
    for name, dt in DATATYPES.items():
        if a.dtype == dt:
            return name
    raise OIPError(500, f"the model returned a {a.dtype} tensor, which the protocol cannot carry")


def encode_infer_response(model: str, outputs: Mapping[str, np.ndarray], request: InferRequest,
                          order: Sequence[str] = ()) -> Tuple[bytes, Dict[str, str]]:
    """The response body and headers for ``outputs`` (by name; ``order`` the model's output order) of
    ``request``: the outputs it asked for (all when it named none), JSON data or binary as it asked."""
    names: List[str] = list(request.outputs) if request.outputs is not None else (list(order) or list(outputs))
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise OIPError(400, f"unknown output(s) {', '.join(map(repr, unknown))}; the model's outputs are "
                            f"{', '.join(map(repr, order or outputs))}")
    entries, chunks = [], []
    for name in names:
        a = np.asarray(outputs[name])
        entry = {"name": name, "datatype": _datatype_of_array(a), "shape": list(a.shape)}
        if name in request.binary or (request.outputs is None and request.binary_default):
            data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = a.ravel().tolist()
        entries.append(entry)
    head = {"model_name": model, "model_version": "1", "outputs": entries}
    if request.id is not None:
        head["id"] = request.id
    text = json.dumps(head).encode()
    if not chunks:
        return text, {"content-type": "application/json"}
    return b"".join([text] + chunks), {"content-type": "application/octet-stream",
                                       HEADER_LENGTH: str(len(text))}
