"""The Ray Serve deployments: :class:`ModelServer`, one per artifact and its own Serve application at route
``/v2/models/NAME``, whose replicas load the artifact and answer that model's HTTP requests themselves (parse,
``@serve.batch``, run, encode: Ray's HTTP proxy hands the request straight to the replica, no hop between), and
:class:`Health`, a small deployment at ``/`` for the server-wide routes (``/v2``, ``/v2/health/*``) and for
models this server does not have.

Imported only by :mod:`cuvil.serve.app` when a server is built: this module is where Ray is imported. The
classes are plain; ``app`` turns them into deployments with the options of the command line.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from typing import Dict, List, Mapping, Optional

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from ..errors import CuvilError
from . import protocol
from .batching import BatchRunner, Failure

#: How long a readiness probe waits for a model's replica to answer before it says "not ready" (seconds).
READY_TIMEOUT_S = 2.0


class ModelServer:
    """One replica of one model: loads the artifact (a GPU bundle on this replica's GPU, or its x86
    ``fallback`` where there is none; an x86 library with ``threads`` threads) and answers ``infer``
    (batched), ``describe`` (metadata) and ``ready``."""

    def __init__(self, path: str, name: str, threads: int = 0, max_batch_size: int = 8,
                 batch_wait_s: float = 0.002, fallback: Optional[str] = None,
                 max_body: int = protocol.DEFAULT_MAX_BODY):
        import warnings

        from ..artifact import load
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # the GPU -> x86 fallback warns; describe() says it
            self.model = load(path, num_threads=threads, fallback=fallback)
        self.name = name
        self.platform = "cuvil_gpu" if type(self.model).__name__ == "GpuModel" else "cuvil_x86"
        self.fell_back = fallback is not None and self.platform == "cuvil_x86" and not path.endswith(".so")
        self.runner = BatchRunner(self.model, max_rows=max_batch_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuvil-model")
        self.infer_batch.set_max_batch_size(max(1, self.runner.max_rows))
        self.infer_batch.set_batch_wait_timeout_s(max(0.0, batch_wait_s))
        self.max_body = int(max_body)
        self.replica = f"{_node_id()}/{os.getpid()}"
        self._meta = self.describe()
        self._order = [o.name for o in self.model.outputs]

    def ready(self) -> bool:
        return True

    def describe(self) -> dict:
        params = {"batch_symbol": self.runner.symbol or "", "max_batch_rows": self.runner.max_rows,
                  "artifact": os.path.basename(os.path.normpath(self.model.path)),
                  "symbols": {k: {"min": p.min, "opt": p.opt, "max": p.max, "multiple": p.multiple}
                              for k, p in self.model.symbols.items()}}
        if self.fell_back:
            params["fallback"] = "no GPU on this replica: running the x86 fallback library"
        meta = protocol.model_metadata(self.name, self.model.inputs, self.model.outputs, self.platform, params)
        return meta

    def stats(self) -> dict:
        return {"calls": self.runner.calls, "requests": self.runner.requests, "pid": os.getpid(),
                "replica": self.replica}

    async def __call__(self, request: Request) -> Response:
        """This model's HTTP routes: its metadata, its readiness, its infer. Every answer is JSON (or the
        binary extension), never a traceback."""
        return await _answer(self._handle, request)

    async def _handle(self, request: Request) -> Response:
        r = protocol.route(request.method, _path(request))
        if r.kind is None:
            return _error(404, f"no such route {_path(request)!r} (the Open Inference Protocol's routes are /v2, "
                               f"/v2/health/live|ready, /v2/models/NAME[/ready|/infer])")
        if r.model != self.name:
            raise protocol.OIPError(400, f"unknown model {r.model!r}")
        if not r.method_ok:
            return _error(405, f"{request.method} is not allowed on {_path(request)}")
        if r.kind == "model_ready":
            return _json(200, {"name": self.name, "ready": True})
        if r.kind == "model_metadata":
            return _json(200, self._meta)
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise protocol.OIPError(400, f"Content-Encoding {request.headers['content-encoding']!r} is not "
                                         f"supported; send the body uncompressed")
        body = await _body(request, self.max_body)
        req = protocol.parse_infer_request(body, request.headers.get(protocol.HEADER_LENGTH), self.max_body)
        result = await self.infer(req.inputs)
        if isinstance(result, Failure):
            return _error(result.status, result.message)
        body, headers = protocol.encode_infer_response(self.name, result, req, self._order)
        headers[REPLICA_HEADER] = self.replica
        return Response(body, status_code=200, headers=headers)

    async def infer(self, inputs: Mapping[str, np.ndarray]):
        """One request's outputs (a dict by name) or its :class:`Failure`."""
        if self.runner.symbol is None or self.runner.rows(inputs) > self.runner.max_rows:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.runner.run_one, inputs)
        return await self.infer_batch(inputs)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.002,
                 batch_size_fn=lambda items: sum(_rows(x) for x in items))
    async def infer_batch(self, requests: List[Mapping[str, np.ndarray]]):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.runner.run_batch, requests)


def _rows(inputs) -> int:
    """Rows of one request along the leading dim (the batch size ``@serve.batch`` counts)."""
    for a in (inputs.values() if isinstance(inputs, Mapping) else ()):
        return int(a.shape[0]) if isinstance(a, np.ndarray) and a.ndim else 1
    return 1


#: The infer response header naming the replica that ran it (``NODE_ID/PID``).
REPLICA_HEADER = "cuvil-replica"


def _node_id() -> str:
    try:
        import ray
        return ray.get_runtime_context().get_node_id()
    except Exception:          # outside Ray (tests of the class itself)
        return "local"


def _path(request: Request) -> str:
    """The request's full path (Serve may hand it with the route prefix moved to ``root_path``)."""
    path = request.scope.get("path", "")
    root = request.scope.get("root_path", "") or ""
    return path if path.startswith("/v2") or not root else root.rstrip("/") + path


def _json(status: int, obj) -> Response:
    return Response(json.dumps(obj).encode(), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(protocol.error_body(message), status_code=status, media_type="application/json")


async def _answer(handle, request: Request) -> Response:
    try:
        return await handle(request)
    except protocol.OIPError as e:
        return _error(e.status, e.message)
    except CuvilError as e:
        return _error(400, protocol.cuvil_error_text(e))
    except Exception as e:        # never a traceback to the client: one line, and the server stays up
        return _error(500, f"internal error: {type(e).__name__}: {e}")


async def _body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise protocol.OIPError(400, f"request body of {length} bytes is over the limit of {limit} bytes "
                                     f"(cuvil serve --max-body-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise protocol.OIPError(400, f"request body over the limit of {limit} bytes (cuvil serve --max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


class Health:
    """The server-wide routes, at ``/``: ``/v2`` (server metadata), ``/v2/health/live``, ``/v2/health/ready``
    (every model has a replica that answers ``ready`` within :data:`READY_TIMEOUT_S`), and any
    ``/v2/models/NAME...`` of a model not served here (a served model's routes go to its own application).
    ``models``: name -> its Serve application's name (or a handle, for tests)."""

    def __init__(self, models: Dict[str, object]):
        self.models = dict(models)
        self._handles: Dict[str, object] = {}

    def handle(self, name: str):
        h = self._handles.get(name)
        if h is None:
            target = self.models[name]
            h = self._handles[name] = (serve.get_deployment_handle(f"model-{name}", app_name=target)
                                       if isinstance(target, str) else target)
        return h

    async def __call__(self, request: Request) -> Response:
        return await _answer(self._handle, request)

    async def _handle(self, request: Request) -> Response:
        path = _path(request)
        r = protocol.route(request.method, path)
        if r.kind is None:
            return _error(404, f"no such route {path!r} (the Open Inference Protocol's routes are /v2, "
                               f"/v2/health/live|ready, /v2/models/NAME[/ready|/infer])")
        if not r.method_ok:
            return _error(405, f"{request.method} is not allowed on {path}")
        if r.kind == "server_metadata":
            return _json(200, protocol.server_metadata())
        if r.kind == "live":
            return _json(200, {"live": True})
        if r.kind == "ready":
            states = await asyncio.gather(*(self._ready(n) for n in self.models))
            ready = all(states)
            return _json(200 if ready else 503, {"ready": ready})
        if r.model in self.models:       # its application is not routing (being deployed or deleted)
            ready = await self._ready(r.model)
            return _error(503, f"model {r.model!r} is {'starting' if not ready else 'not routed yet'}; try again")
        raise protocol.OIPError(400, f"unknown model {r.model!r}; this server serves "
                                     f"{', '.join(map(repr, self.models)) or 'no model'}")

    async def _ready(self, name: str) -> bool:
        try:
            return bool(await asyncio.wait_for(self.handle(name).ready.remote(), READY_TIMEOUT_S))
        except Exception:
            return False
