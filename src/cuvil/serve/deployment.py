"""The Ray Serve deployments: :class:`ModelServer` (one per artifact, its replicas load the artifact and run
requests batched by ``@serve.batch``) and :class:`Ingress` (the HTTP side: routes, parses and encodes the Open
Inference Protocol through :mod:`cuvil.serve.protocol`, and calls the model deployments through their handles).

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
                 batch_wait_s: float = 0.002, fallback: Optional[str] = None):
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

    def ready(self) -> bool:
        return True

    def describe(self) -> dict:
        params = {"batch_symbol": self.runner.symbol or "", "max_batch_rows": self.runner.max_rows,
                  "artifact": os.path.basename(os.path.normpath(self.model.path))}
        if self.fell_back:
            params["fallback"] = "no GPU on this replica: running the x86 fallback library"
        meta = protocol.model_metadata(self.name, self.model.inputs, self.model.outputs, self.platform, params)
        return meta

    def stats(self) -> dict:
        return {"calls": self.runner.calls, "requests": self.runner.requests, "pid": os.getpid()}

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


def _json(status: int, obj) -> Response:
    return Response(json.dumps(obj).encode(), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(protocol.error_body(message), status_code=status, media_type="application/json")


class Ingress:
    """The HTTP side of the server: every OIP route (``protocol.route``), the models by name (``models``:
    deployment handles), a body limit of ``max_body`` bytes. It answers every request with JSON, never with a
    traceback: a refusal is a 400, a model that failed or a replica that died a 500."""

    def __init__(self, models: Dict[str, object], max_body: int = protocol.DEFAULT_MAX_BODY):
        self.models = dict(models)
        self.max_body = int(max_body)
        self._meta: Dict[str, dict] = {}

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._handle(request)
        except protocol.OIPError as e:
            return _error(e.status, e.message)
        except CuvilError as e:
            return _error(400, protocol.cuvil_error_text(e))
        except Exception as e:        # never a traceback to the client: one line, and the server stays up
            return _error(500, f"internal error: {type(e).__name__}: {e}")

    async def _handle(self, request: Request) -> Response:
        r = protocol.route(request.method, request.url.path)
        if r.kind is None:
            return _error(404, f"no such route {request.url.path!r} (the Open Inference Protocol's routes are "
                               f"/v2, /v2/health/live|ready, /v2/models/NAME[/ready|/infer])")
        if not r.method_ok:
            return _error(405, f"{request.method} is not allowed on {request.url.path}")
        if r.kind == "server_metadata":
            return _json(200, protocol.server_metadata())
        if r.kind == "live":
            return _json(200, {"live": True})
        if r.kind == "ready":
            states = await asyncio.gather(*(self._ready(n) for n in self.models))
            ready = all(states)
            return _json(200 if ready else 503, {"ready": ready})
        handle = self.models.get(r.model)
        if handle is None:
            raise protocol.OIPError(400, f"unknown model {r.model!r}; this server serves "
                                         f"{', '.join(map(repr, self.models)) or 'no model'}")
        if r.kind == "model_ready":
            ready = await self._ready(r.model)
            return _json(200 if ready else 503, {"name": r.model, "ready": ready})
        if r.kind == "model_metadata":
            return _json(200, await self._metadata(r.model))
        return await self._infer(r.model, handle, request)

    async def _ready(self, name: str) -> bool:
        try:
            return bool(await asyncio.wait_for(self.models[name].ready.remote(), READY_TIMEOUT_S))
        except Exception:
            return False

    async def _metadata(self, name: str) -> dict:
        meta = self._meta.get(name)
        if meta is None:
            meta = self._meta[name] = await self.models[name].describe.remote()
        return meta

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise protocol.OIPError(400, f"request body of {length} bytes is over the limit of {self.max_body} "
                                         f"bytes (cuvil serve --max-body-mb)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise protocol.OIPError(400, f"request body over the limit of {self.max_body} bytes "
                                             f"(cuvil serve --max-body-mb)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _infer(self, name: str, handle, request: Request) -> Response:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise protocol.OIPError(400, f"Content-Encoding {request.headers['content-encoding']!r} is not "
                                         f"supported; send the body uncompressed")
        body = await self._body(request)
        req = protocol.parse_infer_request(body, request.headers.get(protocol.HEADER_LENGTH), self.max_body)
        meta = await self._metadata(name)
        try:
            result = await handle.infer.remote(req.inputs)
        except Exception as e:      # the replica died or was restarted with this request in flight
            return _error(500, f"model {name!r} did not answer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if isinstance(result, Failure):
            return _error(result.status, result.message)
        body, headers = protocol.encode_infer_response(name, result, req, [o["name"] for o in meta["outputs"]])
        return Response(body, status_code=200, headers=headers)
