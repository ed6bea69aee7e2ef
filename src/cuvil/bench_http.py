"""``cuvil bench --url``: a closed-loop HTTP load generator speaking the Open Inference Protocol (KServe v2), with
the figures, report and SLA verdict of the in-process ``cuvil bench`` (:mod:`cuvil.bench`).

    from cuvil.bench_http import HttpBenchOptions, run_http_benchmark
    res = run_http_benchmark(HttpBenchOptions("http://127.0.0.1:8000/v2/models/demo", concurrency=8, duration=10))
    res["cuvil"]["p99_ms"], res["cuvil"]["throughput_ips"], res["cuvil"]["error_rate_pct"]

How it loads the server: ``GET /v2/models/NAME`` gives the inputs (name, datatype, shape with -1 for a symbolic
dim); each symbol is set to the size ``--fix``/``--input-shape`` give, else to the ``opt`` of its profile when the
server publishes one (``parameters.symbols`` of the metadata), else the command asks for ``--input-shape``. The
inputs are seeded random data (:func:`cuvil.bench.random_inputs`), encoded once with the binary-data extension
(``Inference-Header-Content-Length``: a JSON header, then the raw tensors) and asking for binary outputs. Then
``concurrency`` worker threads, each with its own keep-alive connection (urllib3), send the same request back to
back (closed loop: a worker sends its next request when the last answer has come) through
:func:`cuvil.bench.run_workers`, the timed loop of the in-process benchmark: the same warm-up, run count or
duration, latency percentiles, throughput (sum over workers of completed requests / time spent in them) and
error rate. A request is timed from sending to the last byte of the answer; one that fails (a connection error,
a status other than 200, or an answer without every output) counts as an error, the first one's message shown.

No Ray here: this is a client, usable against any OIP server (Cuvil's ``cuvil serve``, Triton, KServe).
"""
from __future__ import annotations

import json
import math
import urllib.parse
from typing import Any

import numpy as np

from . import bench
from .errors import CuvilError

#: OIP tensor datatypes and numpy's (BYTES, strings, has no fixed-size numpy dtype: unsupported here).
DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64}
NUMPY_TO_OIP = {np.dtype(t): name for name, t in DATATYPES.items()}

HEADER_LENGTH = "Inference-Header-Content-Length"
DEFAULT_TIMEOUT_S = 60.0


class HttpError(Exception):
    """One failed request: ``status`` (None: no answer) and the server's message."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.status, self.message = status, message


# -- the URL and the model's metadata ---------------------------------------------------------------

def split_url(url: str) -> tuple[str, str]:
    """``http://host:port/v2/models/NAME`` (optionally ``/versions/V``, ``/infer``) -> (``http://host:port``,
    the model's path ``/v2/models/NAME[/versions/V]``)."""
    u = urllib.parse.urlsplit(url)
    parts = [p for p in u.path.split("/") if p]
    if u.scheme not in ("http", "https") or not u.netloc or parts[:2] != ["v2", "models"] or len(parts) < 3:
        raise CuvilError(f"--url {url!r} is not an Open Inference Protocol model URL",
                         hint="give --url http://HOST:PORT/v2/models/NAME (`cuvil serve` prints it)")
    rest = parts[3:]
    if rest and rest[-1] in ("infer", "ready"):
        rest = rest[:-1]
    path = "/v2/models/" + "/".join([parts[2]] + (rest[:2] if rest[:1] == ["versions"] else []))
    return f"{u.scheme}://{u.netloc}", path


def _urllib3():
    try:
        import urllib3  # the HTTP client (keep-alive pools); imported here so `import cuvil.bench_http` stays light
    except ImportError:
        raise CuvilError("cuvil bench --url needs urllib3, which is not installed",
                         hint="pip install urllib3 (or pip install 'cuvil[bench]')") from None
    return urllib3


def _pool(base: str, timeout_s: float, maxsize: int = 1):
    urllib3 = _urllib3()
    return urllib3.connection_from_url(base, maxsize=maxsize, block=True, retries=False,
                                       timeout=urllib3.Timeout(connect=min(10.0, timeout_s), read=timeout_s))


def _message(body: bytes) -> str:
    """The server's ``{"error": "..."}`` message, else the body's start."""
    try:
        return str(json.loads(body)["error"])
    except Exception:  # noqa: BLE001 - any other body is shown as text
        text = body[:300].decode("utf-8", "replace").strip()
        return text or "(empty body)"


def get_json(pool, path: str) -> dict[str, Any]:
    """``GET path`` -> the JSON answer; HttpError for another status or a body that is not JSON."""
    urllib3 = _urllib3()
    try:
        r = pool.request("GET", path)
    except urllib3.exceptions.HTTPError as e:
        raise HttpError(None, f"{type(e).__name__}: {e}") from None
    if r.status != 200:
        raise HttpError(r.status, _message(r.data))
    try:
        return json.loads(r.data)
    except ValueError:
        raise HttpError(r.status, f"the answer is not JSON: {r.data[:200]!r}") from None


def fetch_metadata(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The model's OIP metadata (``GET /v2/models/NAME``), checked: inputs and outputs with name, datatype and
    shape. A server that does not answer, or no such model, is a CuvilError naming the next step."""
    base, path = split_url(url)
    pool = _pool(base, timeout_s)
    try:
        meta = get_json(pool, path)
    except HttpError as e:
        if e.status is None:
            raise CuvilError(f"no answer from {base}: {e.message}",
                             hint=f"start the server first (cuvil serve LIB --port {urllib.parse.urlsplit(base).port or 80})"
                                  f", or fix --url") from None
        if e.status in (400, 404):
            raise CuvilError(f"{base} has no model at {path}: {e}",
                             hint=f"list the server's models (curl {base}/v2/repository/index or the `cuvil serve` "
                                  f"output) and give --url {base}/v2/models/NAME") from None
        raise CuvilError(f"{base}{path}: {e}", hint="check the server's log") from None
    finally:
        pool.close()
    for key in ("inputs", "outputs"):
        specs = meta.get(key)
        if not isinstance(specs, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  and isinstance(t.get("shape"), list) for t in specs):
            raise CuvilError(f"{base}{path}: the metadata has no valid {key!r} list (name, datatype, shape each)",
                             hint="is this an Open Inference Protocol (KServe v2) server?")
    for t in meta["inputs"]:
        if t.get("datatype") not in DATATYPES:
            raise CuvilError(f"input {t['name']!r} has datatype {t.get('datatype')!r}, which the load generator "
                             f"cannot make random data for", hint="benchmark it with inputs of a numeric datatype")
    return meta


class _InputSpec:
    """What :func:`cuvil.bench.random_inputs` reads of an input: name and numpy dtype."""

    def __init__(self, name: str, dtype):
        self.name, self.dtype, self.code = name, np.dtype(dtype), None


def input_shapes(meta: dict[str, Any], fixed: dict[str, int], shapes: dict[str, tuple]) -> list[tuple]:
    """A concrete shape for each input of ``meta``: ``shapes[name]`` (``--input-shape``, checked against the
    metadata), else each -1 dim from its symbol (``parameters.dims`` of the input names it): ``fixed[symbol]``
    (``--fix``), else the symbol's ``opt`` in ``parameters.symbols`` of the model."""
    params = meta.get("parameters") if isinstance(meta.get("parameters"), dict) else {}
    profiles = params.get("symbols") if isinstance(params.get("symbols"), dict) else {}
    names = {t["name"] for t in meta["inputs"]}
    for name in shapes:
        if name not in names:
            raise CuvilError(f"--input-shape {name}=...: the model has no input {name!r}",
                             hint=f"its inputs: {', '.join(sorted(names))}")
    known = set(profiles) | {d for t in meta["inputs"] for d in _dims(t) if isinstance(d, str)}
    for name in fixed:
        if name not in known:
            raise CuvilError(f"--fix {name}=...: the server names no symbol {name!r}"
                             + (f" (its symbols: {', '.join(sorted(known))})" if known else
                                " (its metadata names no symbols)"),
                             hint="give the whole shape: --input-shape INPUT=D0xD1x...")
    out = []
    for t in meta["inputs"]:
        shape, dims = t["shape"], _dims(t)
        given = shapes.get(t["name"])
        if given is not None:
            if len(given) != len(shape) or any(v >= 0 and v != g for v, g in zip(shape, given)):
                fit = "x".join(str(v if v >= 0 else g) for v, g in zip(shape, given)) if len(given) == len(shape) \
                    else "x".join(str(v) if v >= 0 else "D" for v in shape)
                raise CuvilError(f"--input-shape {t['name']}={'x'.join(map(str, given))} does not fit the model's "
                                 f"input {t['name']}: {shape}", hint=f"--input-shape {t['name']}={fit}")
            out.append(tuple(given))
            continue
        concrete = []
        for k, v in enumerate(shape):
            if isinstance(v, int) and v >= 0:
                concrete.append(v)
                continue
            sym = dims[k] if k < len(dims) and isinstance(dims[k], str) else None
            prof = profiles.get(sym) if sym else None
            if sym is not None and isinstance(fixed.get(sym), int):
                concrete.append(fixed[sym])
            elif isinstance(prof, dict) and isinstance(prof.get("opt"), int):
                concrete.append(prof["opt"])
            else:
                raise CuvilError(f"input {t['name']!r} has a dynamic dim {k}" + (f" ({sym})" if sym else "")
                                 + " and the server gives no size for it",
                                 hint=(f"--fix {sym}=DIM or " if sym else "") + f"--input-shape {t['name']}="
                                      + "x".join(str(d) if isinstance(d, int) and d >= 0 else "D" for d in shape))
        out.append(tuple(concrete))
    return out


def _dims(t: dict[str, Any]) -> list:
    p = t.get("parameters")
    dims = p.get("dims") if isinstance(p, dict) else None
    return dims if isinstance(dims, list) and len(dims) == len(t["shape"]) else [None] * len(t["shape"])


def random_inputs(meta: dict[str, Any], shapes: list[tuple], seed: int = 0) -> list[np.ndarray]:
    """Seeded random arrays of the inputs' datatypes and ``shapes``, as the in-process benchmark makes them."""
    specs = [_InputSpec(t["name"], DATATYPES[t["datatype"]]) for t in meta["inputs"]]
    return bench.random_inputs(type("M", (), {"inputs": specs}), shapes, seed)


# -- one request ------------------------------------------------------------------------------------

def encode_request(names: list[str], arrays: list[np.ndarray], outputs: list[str] | None = None,
                   binary: bool = True) -> tuple[bytes, dict[str, str]]:
    """An infer request: (body, headers). ``binary``: the binary-data extension (a JSON header of
    ``Inference-Header-Content-Length`` bytes, then each tensor's raw little-endian bytes), asking for binary
    outputs; else plain JSON tensors (``data`` as a flat list)."""
    ins, blobs = [], []
    for name, a in zip(names, arrays):
        a = np.ascontiguousarray(a)
        dt = NUMPY_TO_OIP.get(a.dtype)
        if dt is None:
            raise CuvilError(f"input {name!r}: dtype {a.dtype} has no Open Inference Protocol datatype",
                             hint="give it as one of " + ", ".join(str(np.dtype(t)) for t in DATATYPES.values()))
        t: dict[str, Any] = {"name": name, "shape": list(a.shape), "datatype": dt}
        if binary:
            raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            t["data"] = a.reshape(-1).tolist()
        ins.append(t)
    req: dict[str, Any] = {"inputs": ins}
    if outputs is not None:
        req["outputs"] = [{"name": n, "parameters": {"binary_data": binary}} for n in outputs]
    elif binary:
        req["parameters"] = {"binary_data_output": True}
    head = json.dumps(req, separators=(",", ":")).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}


def decode_response(body: bytes, headers) -> dict[str, np.ndarray]:
    """An infer answer's outputs by name (binary-data extension or JSON ``data``); ValueError if malformed."""
    n = headers.get(HEADER_LENGTH)
    head_len = int(n) if n is not None else len(body)
    if not 0 <= head_len <= len(body):
        raise ValueError(f"{HEADER_LENGTH} {head_len} is outside the body of {len(body)} bytes")
    head = json.loads(body[:head_len])
    pos, out = head_len, {}
    for t in head.get("outputs") or ():
        dtype = np.dtype(DATATYPES[t["datatype"]]).newbyteorder("<")
        shape = tuple(int(d) for d in t["shape"])
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if pos + size > len(body) or size != dtype.itemsize * math.prod(shape):
                raise ValueError(f"output {t['name']!r}: {size} binary bytes do not fit shape {list(shape)} "
                                 f"{t['datatype']} or the body")
            out[t["name"]] = np.frombuffer(body, dtype, math.prod(shape), pos).reshape(shape)
            pos += size
        else:
            out[t["name"]] = np.asarray(t["data"], dtype).reshape(shape)
    return out


class Client:
    """One keep-alive connection to an OIP server sending one prepared infer request over and over:
    ``client.infer()`` returns the outputs (decoded when ``decode``, else only their names checked) or raises
    :class:`HttpError`; ``last_headers``: the last answer's headers. Not thread-safe: one per worker thread."""

    def __init__(self, url: str, names: list[str], arrays: list[np.ndarray], outputs: list[str],
                 binary: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
        base, path = split_url(url)
        self.pool = _pool(base, timeout_s)
        self.path, self.outputs = path + "/infer", list(outputs)
        self.body, self.headers = encode_request(names, arrays, self.outputs, binary)
        self._failed = _urllib3().exceptions.HTTPError
        self.last_headers = None

    def infer(self, decode: bool = False) -> dict[str, Any]:
        try:
            r = self.pool.urlopen("POST", self.path, body=self.body, headers=self.headers)
        except self._failed as e:
            raise HttpError(None, f"{type(e).__name__}: {e}") from None
        self.last_headers = r.headers
        if r.status != 200:
            raise HttpError(r.status, _message(r.data))
        try:
            got = decode_response(r.data, r.headers) if decode else _output_names(r.data, r.headers)
        except (ValueError, KeyError, TypeError) as e:
            raise HttpError(r.status, f"malformed answer: {e}") from None
        missing = [n for n in self.outputs if n not in got]
        if missing:
            raise HttpError(r.status, f"the answer lacks output(s) {missing}")
        return got

    def close(self) -> None:
        self.pool.close()


def _output_names(body: bytes, headers) -> dict[str, None]:
    n = headers.get(HEADER_LENGTH)
    head = json.loads(body[:int(n)] if n is not None else body)
    return {t["name"]: None for t in head["outputs"]}


# -- the benchmark ----------------------------------------------------------------------------------

class HttpBenchOptions(bench.BenchOptions):
    """What to load and how: ``url`` of the model (``http://HOST:PORT/v2/models/NAME``); ``concurrency`` closed-loop
    workers, ``runs`` requests in all or ``duration`` seconds, ``warmup`` untimed requests per worker; ``shapes``
    as in :class:`cuvil.bench.BenchOptions` (a symbol's size or an input's shape); ``binary``: the binary-data
    extension (default) or JSON tensors; ``timeout_s`` per request; ``stop``: a ``threading.Event`` that, once
    set, ends the load after each worker's current request (campaigns that load until something happened)."""

    def __init__(self, url: str, *, binary: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S, stop=None, **kw):
        kw.setdefault("cold_runs", 0)
        super().__init__(url, **kw)
        self.url, self.binary, self.timeout_s, self.stop = url, binary, timeout_s, stop


def run_http_benchmark(opts: HttpBenchOptions) -> dict[str, Any]:
    """Loads the server and returns the in-process benchmark's result dict (``cuvil``: p50/p90/p99/max latency,
    throughput, error rate, runs; ``latencies_ms``; ``settings``; ``host``: the client's machine), with ``url``,
    ``server_model`` (the metadata) and no library, cold start or comparison."""
    if opts.concurrency < 1:
        raise CuvilError(f"--concurrency must be >= 1, got {opts.concurrency}", hint="give --concurrency 1 or more")
    if opts.duration is None and (opts.runs is None or opts.runs < 1):
        raise CuvilError(f"--runs must be >= 1, got {opts.runs}", hint="give --runs 1 or more, or --duration 10s")
    meta = fetch_metadata(opts.url, opts.timeout_s)
    fixed = {k: v for k, v in opts.shapes.items() if isinstance(v, int)}
    given = {k: v for k, v in opts.shapes.items() if isinstance(v, tuple)}
    for name, spec in given.items():
        if bench.is_profile(spec):
            raise CuvilError(f"--input-shape {name}=MIN:OPT:MAX: a server's profile was set when it was compiled",
                             hint=f"give the one shape to time: --input-shape {name}=" + "x".join(map(str, spec[1])))
    shapes = input_shapes(meta, fixed, given)
    arrays = random_inputs(meta, shapes, opts.seed)
    names = [t["name"] for t in meta["inputs"]]
    outputs = [t["name"] for t in meta["outputs"]]
    probe = Client(opts.url, names, arrays, outputs, opts.binary, opts.timeout_s)
    try:
        first = probe.infer(decode=True)
    except HttpError as e:
        raise CuvilError(f"the server fails the benchmark's request: {e}",
                         hint="try one request by hand (cuvil serve's docs: docs/serving.md), or give other sizes "
                              "with --fix/--input-shape") from None
    finally:
        probe.close()
    opts.log(f"timing: {opts.warmup} warm-up request(s) per worker, then "
             + (f"{opts.duration:g} s" if opts.duration is not None else f"{opts.runs} requests")
             + f", {opts.concurrency} closed-loop worker(s) on {opts.url}")
    clients = [Client(opts.url, names, arrays, outputs, opts.binary, opts.timeout_s) for _ in range(opts.concurrency)]
    try:
        phase, wall = bench.run_workers(opts, [{"cuvil": c.infer} for c in clients], ["cuvil"])
    finally:
        for c in clients:
            c.close()
    stats, flat = phase["cuvil"]
    return {
        "model": meta.get("name") or opts.url, "url": opts.url, "library": None, "artifact_bytes": None,
        "compiled": None, "server_model": {k: meta.get(k) for k in ("name", "versions", "platform", "inputs", "outputs")},
        "inputs": [{"name": n, "dtype": str(a.dtype), "shape": list(a.shape)} for n, a in zip(names, arrays)],
        "outputs": [{"name": n, "dtype": str(y.dtype), "shape": list(y.shape)} for n, y in first.items()],
        "settings": {"threads": None, "concurrency": opts.concurrency, "warmup": opts.warmup,
                     "runs": opts.runs if opts.duration is None else None, "duration_s": opts.duration, "vs": None,
                     "opt_level": None, "seed": opts.seed, "cold_runs": 0, "pause_ms": opts.pause_ms,
                     "binary_data": opts.binary, "timeout_s": opts.timeout_s},
        "host": bench.host_info(), "agreement": None, "wall_s": wall,
        "latencies_ms": {"cuvil": [1e3 * x for x in flat]}, "cuvil": stats,
    }
