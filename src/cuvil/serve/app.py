"""Build the Ray Serve applications of ``cuvil serve`` and start them: :func:`start` (Ray, then Serve on a host and
port, then the apps; returns the base URL), :func:`stop`. Each artifact is its own application (``cuvil-NAME``,
route ``/v2/models/NAME``): one :class:`~cuvil.serve.deployment.ModelServer` deployment whose replicas answer
HTTP themselves (``--replicas N`` or ``--autoscale MIN:MAX``; a GPU bundle asks for one GPU per replica when the
cluster has GPUs, and one replica per GPU unless told otherwise). One more application, ``cuvil`` at ``/``, is the
:class:`~cuvil.serve.deployment.Health` deployment (``/v2``, ``/v2/health/*``, unknown models).

Ray is imported here only inside functions (:func:`import_ray`), so that this module, like the rest of
:mod:`cuvil.serve` but ``deployment``, imports without it.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import warnings
from typing import List, Optional, Sequence, Tuple

import attrs

from ..errors import CuvilError
from . import protocol

#: The name of the Serve application of the server-wide routes; each model's is ``cuvil-NAME``
#: (:func:`model_app_name`); ``serve status`` lists them.
APP_NAME = "cuvil"
INSTALL_HINT = "pip install 'cuvil[serve]' (Ray Serve), then run cuvil serve again"
#: How many times a local Ray instance is started before giving up (Ray gives its node a fixed 30 s to come up,
#: which a machine busy with other work can miss).
LOCAL_START_ATTEMPTS = 3


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
    front: str = "auto"


#: Seconds a replica being stopped behind HAProxy keeps answering (Serve's default: 30).
DRAIN_S = 2
#: What may answer HTTP on the server's port (``cuvil serve --front``).
FRONTS = ("auto", "haproxy", "proxy")


def front_env(front: str = "auto", which=None) -> dict:
    """The ``RAY_SERVE_*`` settings of a front end, for a Ray instance this process starts (Serve reads them once,
    in each of its processes, which inherit this process's environment). ``haproxy``: Serve's HAProxy mode
    (``RAY_SERVE_ENABLE_HA_PROXY``): HAProxy, a C program, listens on the port and forwards each request to a
    replica's own HTTP server (direct ingress), in place of Serve's Python HTTP proxy actor and its extra hop
    through Ray: on 2 cores it cut the CPU per SqueezeNet request from about 17-24 ms to 8 ms and doubled the
    throughput (bench/SERVING.md). ``auto``: that when ``haproxy`` is on PATH, else ``{}`` (Serve's proxy);
    ``proxy``: ``{}``. A setting already in the environment is left as it is."""
    if front not in FRONTS:
        raise CuvilError(f"unknown front end {front!r}", hint="give --front " + ", ".join(FRONTS))
    if front == "proxy":
        return {}
    path = (which or shutil.which)("haproxy")
    if path is None:
        if front == "haproxy":
            raise CuvilError("--front haproxy: no haproxy binary on PATH",
                             hint="install it (apt-get install haproxy), or leave --front out to use Serve's proxy")
        return {}
    # a replica being stopped keeps answering this long (default 30 s, for outside load balancers to notice): the
    # HAProxy Serve runs itself is told at once, and 30 s made every `cuvil serve` stop take 35 s (2 s: 6 s)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_BINARY_PATH": path,
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S)}


def apply_front(front: str = "auto", address: Optional[str] = None) -> dict:
    """Put :func:`front_env`'s settings in this process's environment for a local Ray instance (none for a cluster
    at ``address``: its ``ray start`` environment decides), before Ray is imported (Serve reads them at import;
    ``auto`` leaves a process that imported Ray already as it is). Returns the settings."""
    import sys
    env = front_env(front) if address is None else {}
    if "ray" not in sys.modules or front == "haproxy":
        for k, v in env.items():
            os.environ.setdefault(k, v)
    return env


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
    starts (a replica that cannot load its artifact would otherwise be retried by Ray); warns of a library
    without its manifest (served, but one request per call)."""
    from ..targets.x86.loader import manifest_path
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
        elif not os.path.isfile(manifest_path(p)):
            # the library still runs, but only its manifest names the symbolic dims: without it no batch symbol
            # is found (serve.batching) and every request is a call of its own
            warnings.warn(f"{p}: no {os.path.basename(manifest_path(p))} beside it, so its symbolic dims have no "
                          "names and it is served one request per call (no dynamic batching); next: copy the "
                          "manifest `cuvil compile` wrote beside the library", UserWarning, stacklevel=2)


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


def model_app_name(name: str) -> str:
    """The Serve application serving model ``name`` (its deployment is ``model-NAME``)."""
    return f"{APP_NAME}-{name}"


def model_app(cls, path: str, name: str, opts: ServeOptions, gpus: float = 0, *extra):
    """``(application name, route prefix, bound application)`` of one model served by ``cls`` (ModelServer, or a
    subclass taking ``extra`` init arguments after the usual ones)."""
    _, serve = import_ray()
    d = serve.deployment(cls, **model_deployment_options(path, name, opts, gpus))
    fallback = opts.fallbacks.get(path)
    bound = d.bind(os.path.abspath(path), name, opts.threads, opts.max_batch_size, opts.batch_wait_s,
                   os.path.abspath(fallback) if fallback else None, opts.max_body_bytes, *extra)
    return model_app_name(name), f"/v2/models/{name}", bound


def build_apps(paths: Sequence[str], opts: ServeOptions, gpus: float = 0) -> List[tuple]:
    """The Serve applications serving ``paths`` (``gpus``: the GPUs of the cluster, for the bundles), each
    ``(application name, route prefix, bound application)``; the server-wide one (:class:`Health`) last."""
    from .deployment import ModelServer
    check_artifacts(paths)
    names = model_names(paths, opts.names)
    apps = [model_app(ModelServer, path, name, opts, gpus) for path, name in zip(paths, names)]
    return apps + [health_app([a[0] for a in apps], names)]


def health_app(app_names: Sequence[str], names: Sequence[str]) -> tuple:
    _, serve = import_ray()
    from .deployment import Health
    d = serve.deployment(Health, name="oip-health", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return APP_NAME, "/", d.bind(dict(zip(names, app_names)))


def run_apps(apps: Sequence[tuple]) -> None:
    """Deploy ``(name, route prefix, application)`` each, waiting until its replicas are up; remembered for
    :func:`stop`."""
    _, serve = import_ray()
    for name, prefix, app in apps:
        # no access log line per request: it costs the replica and the proxy CPU on every request
        serve.run(app, name=name, route_prefix=prefix, blocking=False,
                  logging_config={"enable_access_log": False, "log_level": "WARNING"})
        if name not in _deployed:
            _deployed.append(name)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` Ray address that nothing answers on is refused at once (Ray itself retries for minutes);
    ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise CuvilError(f"no Ray cluster answers at {address} ({e.strerror or e})",
                         hint="start one there (ray start --head --port PORT), or leave --address out to serve "
                              "from a local Ray instance") from None


def child_pids() -> set:
    """The pids of this process's children (from the parent pids in /proc; empty where there is no /proc)."""
    me, out = os.getpid(), set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _descendants(pids: set) -> list:
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return out


def end_new_children(before: set) -> list:
    """Kill the processes this process started since ``before`` (:func:`child_pids`), with their descendants,
    and reap them; returns their pids. A local ``ray.init`` that timed out leaves its half-started node running
    (GCS, raylet, dashboard, monitors: ``ray.shutdown`` knows nothing of a node that never registered), and on a
    busy machine each retry then started beside the last one's leftovers, which made it slower still (seen: five
    GCS servers of failed attempts under one process)."""
    import signal
    try:
        pids = _descendants(child_pids() - set(before))
    except OSError:
        return []
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    import time
    waiting, deadline = set(pids), time.monotonic() + 2.0
    while waiting and time.monotonic() < deadline:
        for p in list(waiting):
            try:
                if os.waitpid(p, os.WNOHANG)[0] == 0:
                    continue
            except OSError:    # not our child (a grandchild: init reaps it), or reaped already
                pass
            waiting.discard(p)
        if waiting:
            time.sleep(0.02)
    return pids


def init_local_ray(attempts: int = LOCAL_START_ATTEMPTS, **kwargs) -> None:
    """``ray.init(address="local", **kwargs)``: a new local Ray instance (even where `ray start` runs one on this
    machine), tried up to ``attempts`` times (Ray gives its node a fixed 30 s to come up, which a busy machine can
    miss), each failed attempt's processes ended before the next (:func:`end_new_children`). Raises the last
    attempt's error."""
    ray, _ = import_ray()
    for attempt in range(attempts):
        before = child_pids()
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception:
            ray.shutdown()
            end_new_children(before)
            if attempt + 1 >= attempts:
                raise


_started_ray = [False]
#: The Serve applications :func:`run_apps` deployed (what :func:`stop` deletes on a cluster it joined).
_deployed: List[str] = []


def start(paths: Sequence[str], opts: ServeOptions = ServeOptions(), address: Optional[str] = None,
          num_cpus: Optional[int] = None) -> str:
    """Serve ``paths``: join the Ray cluster at ``address`` (None: start a local Ray instance with ``num_cpus``),
    start Serve's HTTP proxy on ``opts.host``:``opts.port``, deploy, wait until every replica is up. Returns
    the base URL (``http://HOST:PORT``). A local Ray instance gets the front end ``opts.front`` asks for
    (:func:`front_env`); a cluster has the one its ``ray start`` environment set."""
    check_artifacts(paths, list(opts.fallbacks.values()))
    model_names(paths, opts.names)
    apply_front(opts.front, address)
    ray, serve = import_ray()
    if not ray.is_initialized():
        if address is not None:
            check_reachable(address)
        kwargs = dict(include_dashboard=False, log_to_driver=not opts.quiet,
                      logging_level=logging.WARNING if opts.quiet else logging.INFO)
        if address is None:
            kwargs["num_cpus"] = num_cpus
        # "local": a new Ray instance even where `ray start` runs one on this machine (None would join that one)
        try:
            if address is None:
                init_local_ray(**kwargs)
            else:
                ray.init(address=address, **kwargs)
        except Exception as e:     # a cluster not there, a node that timed out starting (an overloaded machine)
            text = str(e).strip().splitlines()
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            raise CuvilError(f"could not start or join {where}: {type(e).__name__}: {text[-1] if text else ''}",
                             hint="check `ray status` on the cluster (--address), or try again on a less busy "
                                  "machine (Ray gives its processes 30 s to start)") from None
        _started_ray[0] = True
    apps = build_apps(paths, opts, gpus=ray.cluster_resources().get("GPU", 0))
    try:
        if opts.quiet:
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(http_options={"host": opts.host, "port": opts.port},
                    logging_config={"log_level": "WARNING" if opts.quiet else "INFO"})
        run_apps(apps)
    except Exception as e:      # a port in use, a replica that failed to load: one line, not Ray's traceback
        text = str(e).strip().splitlines()
        raise CuvilError(f"the server did not start: {type(e).__name__}: {text[-1] if text else ''}",
                         hint="check the artifact loads (cuvil run ARTIFACT) and the port is free (--port)") from None
    return f"http://{opts.host}:{opts.port}"


def stop() -> None:
    """Shut down what :func:`start` started: Serve and Ray where it started its own Ray instance; on a cluster it
    joined, only its applications (Serve and the cluster go on)."""
    ray, serve = import_ray()
    if not ray.is_initialized():
        return
    if _started_ray[0]:
        serve.shutdown()
        ray.shutdown()
        _started_ray[0] = False
    else:
        for name in reversed(_deployed):
            try:
                serve.delete(name)
            except Exception:
                pass
    _deployed.clear()
