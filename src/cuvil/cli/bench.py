"""``cuvil bench MODEL|LIB`` or ``cuvil bench --url URL``: latency, throughput, cold start and memory of a model
(or latency and throughput of a model behind an Open Inference Protocol server), against an SLA."""
from __future__ import annotations

import sys

from .. import bench, bench_http, progress
from ..errors import CuvilError
from .flags import (THREADS_HELP, add_progress_flag, add_quiet_flag, add_shape_flags, opt_level,
                    threads)
from .shape_flags import parse_fixed, parse_input_shapes, parse_profiles


def register(sub) -> None:
    sp = sub.add_parser("bench", help="latency, throughput, cold start and memory of a model, against an SLA",
                        description="Benchmark a model (an .onnx, compiled first; or a compiled .so): p50/p90/p99/max "
                                    "latency, throughput, error rate, cold start, peak RSS, artifact size; optionally "
                                    "beside onnxruntime; or, with --url, load a model served over the Open "
                                    "Inference Protocol (cuvil serve, Triton, KServe) from concurrent closed-loop "
                                    "clients. Exit 0 if the SLA held (or none was given), 1 if not, "
                                    "2 for usage errors. Flags override the config.")
    sp.add_argument("model", metavar="MODEL", nargs="?",
                    help="MODEL.onnx (compiled through the artifact cache) or LIB.so; none with --url")
    sp.add_argument("--url", metavar="URL",
                    help="load a served model instead: http://HOST:PORT/v2/models/NAME (Open Inference Protocol, "
                         "as `cuvil serve` prints it); --concurrency workers each send a request, then the next "
                         "when the answer came; inputs random, symbols at the server's opt unless --fix/--input-shape")
    sp.add_argument("--json-tensors", action="store_true",
                    help="with --url: send and ask for JSON tensors instead of the binary-data extension")
    sp.add_argument("--timeout", type=float, metavar="SECONDS", default=bench_http.DEFAULT_TIMEOUT_S,
                    help=f"with --url: seconds to wait for one answer (default {bench_http.DEFAULT_TIMEOUT_S:g}); "
                         "a later one counts as an error")
    sp.add_argument("--config", help="YAML file: concurrency, duration or runs, warmup, threads, opt_level, vs, slas")
    sp.add_argument("--vs", choices=["onnxruntime"], help="also run onnxruntime, alternating run by run; print ratios")
    sp.add_argument("--onnx", help="the ONNX model onnxruntime runs when MODEL is a .so")
    sp.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP + "; both engines")
    sp.add_argument("--runs", type=int, help="timed runs per engine, over all workers (default 100)")
    sp.add_argument("--duration", help="time instead of a run count: seconds, or 10s, 500ms, 2m")
    sp.add_argument("--warmup", type=int, help="untimed runs per engine and worker first (default 5)")
    sp.add_argument("--concurrency", type=int, help="parallel workers, each with its own session (default 1)")
    sp.add_argument("-O", "--opt-level", metavar="LEVEL", help="for an .onnx: O0, O1, O2 or O3, or 0-3 (default O3)")
    add_shape_flags(sp, "an input's shape to time (x=1x3x640x640), or for an .onnx three shapes "
                        "(x=1x3x32x32:1x3x640x640:1x3x1280x1280): compile for that range, time its opt shape "
                        "(repeatable)")
    sp.add_argument("--shape", action="append", metavar="NAME=DIM|INPUT=DIMS",
                    help="an older spelling: NAME=DIM is --fix NAME=DIM, INPUT=1x3x224x224 is --input-shape (repeatable)")
    sp.add_argument("--sla", action="append", metavar="NAME=LIMIT", help="an SLA, e.g. p99_latency_ms=50 (repeatable)")
    sp.add_argument("--cold-runs", type=int,
                    help=f"fresh processes per engine for cold start and peak RSS (default {bench.DEFAULT_COLD_RUNS}; "
                         f"0 = skip; none with --url)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    sp.add_argument("--pause-ms", type=float, default=0.0,
                    help="untimed sleep after each timed run, so spinning worker threads go idle first (default 0; with "
                         "--vs onnxruntime and several threads use ~150: its workers spin 50-100 ms after a run)")
    sp.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    sp.add_argument("--plot", metavar="OUT.png", help="latency histogram and CDF (needs matplotlib)")
    add_quiet_flag(sp)
    add_progress_flag(sp)
    sp.set_defaults(fn=cmd_bench, parser=sp)


def cmd_bench(args) -> int:
    """Latency percentiles, throughput, error rate, cold start and peak RSS; optionally beside onnxruntime;
    exit 0 when the SLA held (or none was given), 1 when not."""
    cfg = bench.load_config(args.config) if args.config else {}
    if args.runs is not None and args.duration is not None:
        raise CuvilError("give --runs or --duration, not both", hint=f"drop one: --runs {args.runs} or --duration {args.duration}")
    slas = dict(cfg.get("slas", {}))
    for item in args.sla or ():
        name, _, val = item.partition("=")
        try:
            slas[name] = float(val)
        except ValueError:
            raise CuvilError(f"--sla takes NAME=NUMBER, got {item!r}", hint="e.g. --sla p99_latency_ms=50") from None
    if args.runs is not None or args.duration is not None:
        runs = args.runs
        try:
            duration = bench.parse_duration(args.duration) if args.duration is not None else None
        except ValueError as e:
            raise CuvilError(f"--duration: {e}", hint="e.g. --duration 10s, 500ms or 2m") from None
    else:
        runs, duration = cfg.get("runs"), cfg.get("duration")
    pick = lambda flag, key, default: flag if flag is not None else cfg.get(key, default)
    vs = pick(args.vs, "vs", None)
    if args.url is not None:
        _url_conflicts(args, vs, slas)
    elif args.model is None:   # argparse's own wording, as when MODEL was a required positional
        args.parser.error("the following arguments are required: MODEL (or --url URL)")
    cold_runs = args.cold_runs if args.cold_runs is not None else (0 if args.url else bench.DEFAULT_COLD_RUNS)
    bench.sla_requirements(slas, vs, cold_runs)
    if args.plot:
        bench.require_matplotlib()
    if args.runs is not None and args.runs < 1:
        raise CuvilError(f"--runs must be >= 1, got {args.runs}", hint="--runs 100 (the default)")
    for flag, val, lo in (("--warmup", args.warmup, 0), ("--threads", args.threads, 0),
                          ("--concurrency", args.concurrency, 1), ("--cold-runs", cold_runs, 0),
                          ("--pause-ms", args.pause_ms, 0)):
        if val is not None and val < lo:
            raise CuvilError(f"{flag} must be >= {lo}, got {val}", hint=f"{flag} {lo}" + (" (all cores)" if flag == "--threads" else ""))
    fixed, input_shapes, spelled = _bench_shapes(args)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"cuvil bench: {msg}", file=sys.stderr, flush=True))
    if args.url is not None:
        if not args.timeout > 0:
            raise CuvilError(f"--timeout must be > 0, got {args.timeout}", hint="--timeout 60 (the default)")
        opts = bench_http.HttpBenchOptions(
            args.url, binary=not args.json_tensors, timeout_s=args.timeout, runs=runs, duration=duration,
            warmup=pick(args.warmup, "warmup", bench.DEFAULT_WARMUP), concurrency=pick(args.concurrency, "concurrency", 1),
            shapes={**fixed, **input_shapes}, spelled=spelled, seed=args.seed, pause_ms=args.pause_ms,
            progress=progress.wanted(args.quiet, args.progress), log=log)
        with progress.enabled(bool(opts.progress)):
            res = bench_http.run_http_benchmark(opts)
        return _report(args, res, slas)
    opts = bench.BenchOptions(
        args.model, onnx=args.onnx, vs=vs, threads=threads(pick(args.threads, "threads", 0)), runs=runs,
        duration=duration, warmup=pick(args.warmup, "warmup", bench.DEFAULT_WARMUP),
        concurrency=pick(args.concurrency, "concurrency", 1), opt_level=opt_level(pick(args.opt_level, "opt_level", "O3")),
        shapes={**fixed, **input_shapes}, shape_profiles=parse_profiles(args.shape_profile), spelled=spelled,
        seed=args.seed, cold_runs=cold_runs, pause_ms=args.pause_ms,
        progress=progress.wanted(args.quiet, args.progress), log=log)
    return _report(args, bench.run_benchmark(opts), slas)


def _report(args, res, slas) -> int:
    """Prints the report (and writes --json, --plot); 0 if the SLA held, else 1."""
    checks = bench.check_slas(res, slas)
    res["slas"], res["sla_held"] = checks, all(c["held"] for c in checks)
    print(bench.format_report(res, checks))
    if args.json:
        bench.write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(res, args.plot)
        print(f"wrote {args.plot}")
    return 0 if res["sla_held"] else 1


def _url_conflicts(args, vs, slas) -> None:
    """Usage errors for what --url cannot do: a local model, or settings of the server's side."""
    if args.model is not None:
        raise CuvilError(f"give MODEL ({args.model}) or --url, not both",
                         hint=f"cuvil bench --url {args.url} (the server runs the model), or drop --url")
    server_side = [("--vs", vs), ("--onnx", args.onnx), ("--threads", args.threads), ("--opt-level", args.opt_level),
                   ("--shape-profile", args.shape_profile)]
    if args.cold_runs:
        server_side.append(("--cold-runs", args.cold_runs))
    for flag, val in server_side:
        if val:
            raise CuvilError(f"{flag} does not apply with --url: the server compiled and runs the model",
                             hint=f"drop {flag} (set it where the server starts: cuvil serve ...), or bench the "
                                  f"library in-process without --url")
    for name in slas:
        if name in bench.SLA_KEYS and bench.SLA_KEYS[name][0][0] != "cuvil" or name in ("cold_start_ms", "peak_rss_mb"):
            raise CuvilError(f"the SLA {name} cannot be measured with --url (no cold start, no comparison)",
                             hint="keep the latency, throughput and error-rate SLAs; drop " + name)


def _bench_shapes(args):
    """``(fixed, input_shapes, spelled)`` from --fix, --input-shape and their older spelling --shape (NAME=DIM is
    --fix, INPUT=AxB is --input-shape); ``spelled``: the flag that gave each name, so errors show the user's."""
    fixed, input_shapes, spelled = {}, {}, {}
    old = bench.parse_shapes(args.shape)
    for name, spec in old.items():
        (fixed if isinstance(spec, int) else input_shapes)[name] = spec
        spelled[name] = "--shape"
    for name, val in parse_fixed(args.fix).items():
        if name in old:
            raise CuvilError(f"symbol {name!r} is given by both --shape and --fix", hint=f"give one: --fix {name}={val}")
        fixed[name], spelled[name] = val, "--fix"
    for name, spec in parse_input_shapes(args.input_shape).items():
        if name in old:
            raise CuvilError(f"input {name!r} is given by both --shape and --input-shape",
                             hint=f"give one: --input-shape {name}=" + "x".join(map(str, old[name])))
        input_shapes[name] = spec
    return fixed, input_shapes, spelled
