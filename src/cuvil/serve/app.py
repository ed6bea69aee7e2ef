"""Build the Ray Serve application of ``cuvil serve`` and start it: :func:`start` (Ray, then Serve on a host and
port, then the app; returns the base URL), :func:`stop`. One :class:`~cuvil.serve.deployment.ModelServer`
deployment per artifact (``--replicas N`` or ``--autoscale MIN:MAX``; a GPU bundle asks for one GPU per replica
when the cluster has GPUs, and one replica per GPU unless told otherwise) behind one
:class:`~cuvil.serve.deployment.Ingress` that speaks HTTP.

Ray is imported here only inside functions (:func:`import_ray`), so that this module, like the rest of
:mod:`cuvil.serve` but ``deployment``, imports without it.
"""
from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence, Tuple

import attrs

from ..errors import CuvilError
from . import protocol

#: The Serve application's name (``serve status`` lists it).
APP_NAME = "cuvil"
INSTALL_HINT = "pip install 'cuvil[serve]' (Ray Serve), then run cuvil serve again"


@attrs.frozen
class ServeOptions:
    """How to serve: where (``host``, ``port``), how many replicas (``replicas``, or ``autoscale`` (min, max)),
    ``threads`` per replica (0: all cores), ``cpus`` Ray reserves per replica (default: ``threads``; none
    for 0, so that replicas of all cores never wait for CPUs Ray cannot give),
    dynamic batching (``max_batch_size`` rows, ``batch_wait_s``), the served ``names`` (default: from the file
    names), the GPU bundles' x86 ``fallbacks`` (by artifact path), the largest request body ``max_body_bytes``; ``quiet``:
    Ray's and Serve's log lines at warnings only."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: Optional[int] = None
    autoscale: Optional[Tuple[int, int]] = None
    threads: int = 0
    cpus: Optional[float] = None
    max_batch_size: int = 8
    batch_wait_s: float = 0.002
    names: Optional[Sequence[str]] = None
    fallbacks: dict = attrs.field(factory=dict)
    max_body_bytes: int = protocol.DEFAULT_MAX_BODY
    quiet: bool = False


def import_ray():
    """``(ray, ray.serve)``, or a CuvilError that says what to install."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise CuvilError(f"serving needs Ray Serve, which is not installed ({e})", hint=INSTALL_HINT) from None
    return ray, serve


def is_bundle(path: str) -> bool:
    return os.path.isdir(path) or path.rstrip(os.sep).endswith(".cuvil")


def artifact_name(path: str) -> str:
    """``libNAME.so`` and ``NAME.cuvil`` -> ``NAME``."""
    base = os.path.basename(os.path.normpath(path))
    if base.endswith(".so"):
        base = base[:-3]
        if base.startswith("lib") and len(base) > 3:
            base = base[3:]
    elif base.endswith(".cuvil"):
        base = base[:-6]
    return base


def model_names(paths: Sequence[str], names: Optional[Sequence[str]] = None) -> List[str]:
    """The name each artifact is served as (``libNAME.so``/``NAME.cuvil`` -> ``NAME``, or ``names`` in order);
    refuses a count that does not match, a duplicate, a name a URL path cannot carry."""
    if names:
        if len(names) != len(paths):
            raise CuvilError(f"{len(names)} --name for {len(paths)} artifacts",
                             hint="give one --name per artifact, in the same order, or none")
        out = list(names)
    else:
        out = [artifact_name(p) for p in paths]
    for n in out:
        if not n or "/" in n or n in (".", ".."):
            raise CuvilError(f"model name {n!r} cannot be a URL path segment", hint="give --name NAME")
    dup = sorted({n for n in out if out.count(n) > 1})
    if dup:
        raise CuvilError(f"two artifacts would both be served as {', '.join(map(repr, dup))}",
                         hint="give each one a --name")
    return out


def check_artifacts(paths: Sequence[str], fallbacks: Sequence[str] = ()) -> None:
    """Refuses a path that is not a compiled artifact, or a fallback that is not an x86 library, before Ray
    starts (a replica that cannot load its artifact would otherwise be retried by Ray)."""
    for f in fallbacks:
        if not (f.endswith(".so") and os.path.isfile(f)):
            raise CuvilError(f"--fallback {f}: not an x86 library (libNAME.so) here",
                             hint="give the libNAME.so compiled from the same model for the x86 target")
    for p in paths:
        if is_bundle(p):
            if not os.path.isdir(p):
                raise CuvilError(f"{p}: no such bundle", hint="give a NAME.cuvil directory (cuvil compile "
                                 "--target cuda writes one) or a libNAME.so")
        elif not os.path.isfile(p):
            raise CuvilError(f"{p}: no such file", hint="give a compiled libNAME.so (cuvil compile MODEL -o "
                             "libNAME.so writes one) or a NAME.cuvil bundle")
        elif not p.endswith(".so"):
            raise CuvilError(f"{p}: not a compiled artifact (libNAME.so or NAME.cuvil)",
                             hint=f"compile it first: cuvil compile {p} -o build/libNAME.so")


def _scale(opts: ServeOptions, default_replicas: int = 1) -> dict:
    if opts.autoscale is not None:
        lo, hi = opts.autoscale
        return {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                                       "target_ongoing_requests": max(2, opts.max_batch_size)}}
    return {"num_replicas": opts.replicas if opts.replicas is not None else default_replicas}


def model_deployment_options(path: str, name: str, opts: ServeOptions, gpus: float = 0) -> dict:
    """The Ray Serve options of the deployment serving ``path`` as ``name``: the CPUs each replica reserves,
    one GPU per replica for a GPU bundle when the cluster has GPUs (and one replica per GPU unless ``replicas``
    or ``autoscale`` say otherwise), the replica count or the autoscaling range."""
    cpus = opts.cpus if opts.cpus is not None else float(opts.threads)
    actor = {"num_cpus": cpus}
    replicas = 1
    if is_bundle(path) and gpus >= 1:
        actor["num_gpus"] = 1
        replicas = int(gpus)
    return dict(name=f"model-{name}", ray_actor_options=actor, max_ongoing_requests=max(16, 4 * opts.max_batch_size),
                **_scale(opts, replicas))


def build_app(paths: Sequence[str], opts: ServeOptions, gpus: float = 0):
    """The Serve application serving ``paths`` (``gpus``: the GPUs of the cluster, for the bundles), and the
    models' names."""
    _, serve = import_ray()
    from .deployment import Ingress, ModelServer
    check_artifacts(paths)
    names = model_names(paths, opts.names)
    handles = {}
    for path, name in zip(paths, names):
        d = serve.deployment(ModelServer, **model_deployment_options(path, name, opts, gpus))
        fallback = opts.fallbacks.get(path)
        handles[name] = d.bind(os.path.abspath(path), name, opts.threads, opts.max_batch_size, opts.batch_wait_s,
                               os.path.abspath(fallback) if fallback else None)
    ingress = serve.deployment(Ingress, name="oip-ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1000, **_scale(opts))
    return ingress.bind(handles, opts.max_body_bytes), names


_started_ray = [False]


def start(paths: Sequence[str], opts: ServeOptions = ServeOptions(), address: Optional[str] = None,
          num_cpus: Optional[int] = None) -> str:
    """Serve ``paths``: join the Ray cluster at ``address`` (None: start a local Ray instance with ``num_cpus``),
    start Serve's HTTP proxy on ``opts.host``:``opts.port``, deploy, wait until every replica is up. Returns
    the base URL (``http://HOST:PORT``)."""
    ray, serve = import_ray()
    check_artifacts(paths, list(opts.fallbacks.values()))
    model_names(paths, opts.names)
    if not ray.is_initialized():
        kwargs = dict(include_dashboard=False, log_to_driver=not opts.quiet,
                      logging_level=logging.WARNING if opts.quiet else logging.INFO)
        if address is None:
            kwargs["num_cpus"] = num_cpus
        # "local": a new Ray instance even where `ray start` runs one on this machine (None would join that one)
        ray.init(address=address or "local", **kwargs)
        _started_ray[0] = True
    app, _ = build_app(paths, opts, gpus=ray.cluster_resources().get("GPU", 0))
    try:
        if opts.quiet:
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": opts.host, "port": opts.port},
                    logging_config={"log_level": "WARNING" if opts.quiet else "INFO"})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as e:      # a port in use, a replica that failed to load: one line, not Ray's traceback
        text = str(e).strip().splitlines()
        raise CuvilError(f"the server did not start: {type(e).__name__}: {text[-1] if text else ''}",
                         hint="check the artifact loads (cuvil run ARTIFACT) and the port is free (--port)") from None
    return f"http://{opts.host}:{opts.port}"


def stop() -> None:
    """Shut Serve down, and Ray too when :func:`start` started it."""
    ray, serve = import_ray()
    if ray.is_initialized():
        serve.shutdown()
        if _started_ray[0]:
            ray.shutdown()
            _started_ray[0] = False
