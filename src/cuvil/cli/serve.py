"""``cuvil serve ARTIFACT [ARTIFACT ...]``: serve compiled models over HTTP with the Open Inference Protocol
(KServe v2: Triton's and KServe's clients work unchanged) on Ray Serve, with replicas, autoscaling and dynamic
batching; a local Ray instance, or a cluster (``--address``). Blocks until Ctrl-C (or SIGTERM). docs/serving.md."""
from __future__ import annotations

import signal
import time

from ..errors import CuvilError
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("serve", help="serve compiled models over HTTP (Open Inference Protocol, Ray Serve)",
                        description="Serve each ARTIFACT (a libNAME.so, or a NAME.cuvil GPU bundle) over HTTP with "
                                    "the Open Inference Protocol (KServe v2: /v2/health/ready, /v2/models/NAME, "
                                    "POST /v2/models/NAME/infer, JSON or binary tensors; tritonclient works "
                                    "unchanged), on Ray Serve: replicas or autoscaling, dynamic batching along the "
                                    "model's symbolic batch dim, one replica per GPU for a bundle. Without "
                                    "--address it starts a local Ray instance; with one it joins that cluster. "
                                    "Needs pip install 'cuvil[serve]'. Example: cuvil serve build/libmodel.so "
                                    "--port 8000 (then curl http://127.0.0.1:8000/v2/models/model)")
    sp.add_argument("artifacts", nargs="+", metavar="ARTIFACT",
                    help="DIR/libNAME.so or DIR/NAME.cuvil (from cuvil compile), served as NAME")
    sp.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    scale = sp.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, metavar="N",
                       help="replicas per model (default 1; a GPU bundle: one per GPU of the cluster)")
    scale.add_argument("--autoscale", metavar="MIN:MAX",
                       help="let Ray Serve scale each model between MIN and MAX replicas with the load")
    sp.add_argument("--threads-per-replica", type=int, default=0, metavar="T",
                    help="threads each replica's library runs on (default 0 = all cores)")
    sp.add_argument("--max-batch-size", type=int, default=8, metavar="B",
                    help="most rows one call joins along the batch dim (default 8; 1 turns batching off)")
    sp.add_argument("--batch-wait-ms", type=float, default=2.0, metavar="W",
                    help="how long a call waits for more requests to join it (default 2 ms)")
    sp.add_argument("--address", metavar="RAY_ADDRESS",
                    help="join this Ray cluster (auto, or HOST:6379 of `ray start --head`); default: a local one")
    sp.add_argument("--name", action="append", metavar="NAME",
                    help="serve the artifact as NAME (one per artifact, in order; default from its file name)")
    sp.add_argument("--fallback", action="append", metavar="LIB",
                    help="the x86 libNAME.so a GPU bundle's replica runs where it has no GPU (one per bundle, in "
                         "order)")
    sp.add_argument("--max-body-mb", type=float, default=64.0, metavar="M",
                    help="refuse request bodies over M MiB with a 400 (default 64)")
    sp.add_argument("--front", choices=("auto", "haproxy", "proxy"), default="auto",
                    help="what answers HTTP on the port, for a local Ray instance: HAProxy (Serve's HAProxy mode, "
                         "replicas answer directly; about twice the throughput on few cores), Serve's Python proxy, "
                         "or auto (default: HAProxy when a haproxy binary is on PATH)")
    # -q: Ray's and Serve's own log lines at warnings only; the URLs still print
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_serve)


def parse_autoscale(text: str):
    """``MIN:MAX`` -> (MIN, MAX), 0 <= MIN <= MAX, MAX >= 1."""
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise CuvilError(f"--autoscale {text!r}: expected MIN:MAX replicas", hint="e.g. --autoscale 1:4") from None
    if lo < 0 or hi < max(lo, 1):
        raise CuvilError(f"--autoscale {text!r}: needs 0 <= MIN <= MAX and MAX >= 1", hint="e.g. --autoscale 1:4")
    return lo, hi


def options(args):
    """The ServeOptions of the parsed command line (checked: a bad value is a CuvilError before Ray starts)."""
    from ..serve.app import ServeOptions, is_bundle
    if args.replicas is not None and args.replicas < 1:
        raise CuvilError(f"--replicas {args.replicas}: needs at least 1", hint="--replicas 1, or --autoscale 0:N")
    for flag, value, least in (("--threads-per-replica", args.threads_per_replica, 0),
                               ("--max-batch-size", args.max_batch_size, 1), ("--batch-wait-ms", args.batch_wait_ms, 0),
                               ("--max-body-mb", args.max_body_mb, 0)):
        if value < least or (flag == "--max-body-mb" and value == 0):
            raise CuvilError(f"{flag} {value}: must be {'positive' if least or flag == '--max-body-mb' else 'at least 0'}",
                             hint=f"cuvil serve --help explains {flag}")
    if not 0 < args.port < 65536:
        raise CuvilError(f"--port {args.port}: not a TCP port", hint="a port in 1-65535, e.g. --port 8000")
    bundles = [p for p in args.artifacts if is_bundle(p)]
    fallbacks = args.fallback or []
    if len(fallbacks) > len(bundles):
        raise CuvilError(f"{len(fallbacks)} --fallback for {len(bundles)} GPU bundle(s)",
                         hint="give one --fallback libNAME.so per NAME.cuvil bundle, in order")
    return ServeOptions(host=args.host, port=args.port, replicas=args.replicas,
                        autoscale=parse_autoscale(args.autoscale) if args.autoscale else None,
                        threads=args.threads_per_replica, max_batch_size=args.max_batch_size,
                        batch_wait_s=args.batch_wait_ms / 1e3, names=args.name,
                        fallbacks=dict(zip(bundles, fallbacks)), max_body_bytes=int(args.max_body_mb * (1 << 20)),
                        quiet=args.quiet, front=args.front)


def cmd_serve(args) -> int:
    """Start the server, print its URLs, block until Ctrl-C or SIGTERM, then shut it down."""
    from ..serve.app import apply_front, check_artifacts, import_ray, model_names, start, stop
    opts = options(args)
    check_artifacts(args.artifacts, list(opts.fallbacks.values()))
    names = model_names(args.artifacts, opts.names)
    apply_front(opts.front, args.address)        # before Ray is imported: Serve reads its settings then
    import_ray()                          # missing Ray: the install hint before Ray is asked to start
    previous = signal.getsignal(signal.SIGTERM)
    try:
        url = start(args.artifacts, opts, address=args.address)
        # `kill` stops it as cleanly as Ctrl-C (set after Ray's start, which installs a SIGTERM handler that aborts)
        signal.signal(signal.SIGTERM, _interrupt)
        for name in names:
            print(f"serving {name} at {url}/v2/models/{name}", flush=True)
        print(f"ready: {url}/v2/health/ready (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        stop()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt
