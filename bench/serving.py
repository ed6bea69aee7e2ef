"""Serving on Ray Serve, measured on loopback (issue 26): `cuvil serve`'s deployment against the same library
in-process, against onnxruntime behind the same deployment code (and Triton through PyTriton, when it runs),
a soak, a replica killed under load, and malformed requests. One process runs every part, side by side.

    python3 bench/serving.py                        # every part; the soak lasts 10 minutes
    python3 bench/serving.py --quick                # every part, short (about two minutes after the compile)
    python3 bench/serving.py --parts ab --rounds 3 --round-s 10 --json /tmp/serving.json
    python3 bench/serving.py --pytriton-python /path/to/venv/bin/python   # (b) with Triton (see below)

The model: SqueezeNet 1.0 (onnx's light model, seeded random weights) with a symbolic batch N in [1, 8], batch
1 per request, compiled at O3 for this CPU. The server: a private local Ray instance (4 logical CPUs on this
2-core machine), a Serve app per model as `cuvil serve` deploys them (`cuvil.serve.app.model_app`: Serve's HTTP
proxy calls the model deployment, one hop): `squeezenet` (the library, `ModelServer`) and `squeezenet_ort` (the
same `ModelServer` code, its model object swapped for onnxruntime behind the library's own interface and
checks: `OrtModel` below), each on two one-thread replicas, dynamic batching up to 8 rows within 2 ms. The
clients: `cuvil bench --url`'s (`cuvil.bench_http`), closed loop. (a) and (b) also give the CPU time each
process (client, proxy, replicas, Ray's control processes) spent per request.

(a) concurrency 8: the library in-process (`cuvil bench`'s timed loop: 8 threads, a one-thread session each)
    vs the library on Ray Serve; rounds alternate the engines so machine noise hits all alike. Goal:
    throughput >= 0.8x in-process, p99 within +5 ms.
(b) the same rounds: onnxruntime behind the same deployment; Triton (PyTriton serving the same onnxruntime
    session, its HTTP endpoint driven by the same client) when `--pytriton-python` names an interpreter that
    has `nvidia-pytriton` (it pins numpy < 2: install it in a venv of its own). Goal: Cuvil's p99 and
    throughput better.
(c) soak: `--soak-s` (600) at concurrency 16 on the library: errors, and the resident memory (VmRSS) of its
    replicas, the health replica and the HTTP proxy after the warm-up (the first tenth, at least 30 s) and at the end. Goal: 0
    errors, growth <= 5 %.
(d) a model replica SIGKILLed under load (concurrency 8): how long until Serve replaced it, the errors (goal:
    only the requests in flight on it, at most the concurrency), /v2/health/ready meanwhile.
(e) `--malformed` (1,000) random malformed requests, every kind of `cuvil.testing.serving.MALFORMED_KINDS`:
    each must be a 400 with a message; the server must be ready and answer a valid request after.

Prints a markdown report (bench/SERVING.md carries one, with the CPU and the date). Figures on a shared 2-core
machine are noisy and the load generator shares the cores with the server: read ratios over several rounds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from cuvil import Pipeline
from cuvil.bench import BenchOptions, run_benchmark, write_json
from cuvil.bench_http import Client, HttpBenchOptions, fetch_metadata, run_http_benchmark
from cuvil.targets.x86.cpu import cpu_label
from cuvil.testing import light_model
from cuvil.testing.serving import (MALFORMED_KINDS, cpu_seconds, kill_replica, malformed_requests, process_tree,
                                   replicas, rss_kb, serve_processes)

PROFILE = (1, 1, 8)
SHAPE = (1, 3, 224, 224)
MAX_BODY = 8 << 20


# -- the model, onnxruntime behind the deployment, the server --------------------------------------------------

def squeezenet(tmp: str) -> tuple[str, str]:
    """(library, onnx path) of SqueezeNet with a symbolic batch N (profile ``PROFILE``)."""
    m = light_model("squeezenet", seed=0)
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "N"
    onnx_path = os.path.join(tmp, "squeezenet.onnx")
    import onnx
    onnx.save(m, onnx_path)
    art = Pipeline.from_onnx(m).optimize().compile(opt_level=3, shape_profiles={"N": PROFILE})
    return art.path, onnx_path


class OrtModel:
    """onnxruntime behind a Cuvil library's interface: the library's inputs, outputs, symbols and checks
    (``signature``; so both engines refuse the same requests alike), onnxruntime's session to run."""

    def __init__(self, lib_model, onnx_path: str, threads: int):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, threads)
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
        self.lib = lib_model
        self.inputs, self.outputs, self.symbols = lib_model.inputs, lib_model.outputs, lib_model.symbols
        self.signature, self.path = lib_model.signature, onnx_path
        self._in = [i.name for i in self.sess.get_inputs()]
        self._out = [o.name for o in self.sess.get_outputs()]

    def run(self, inputs: dict) -> dict:
        ys = self.sess.run(None, {n: inputs[s.name] for n, s in zip(self._in, self.inputs)})
        return {s.name: y for s, y in zip(self.outputs, ys)}

    def close(self) -> None:
        self.lib.close()


def _server_classes():
    from cuvil.serve.batching import BatchRunner
    from cuvil.serve.deployment import ModelServer

    class OrtModelServer(ModelServer):
        """`cuvil serve`'s model deployment, its model object onnxruntime (:class:`OrtModel`)."""

        def __init__(self, *args):   # ModelServer's (path, name, threads, ...), then the ONNX model's path
            *args, onnx_path = args
            super().__init__(*args)
            self.model = OrtModel(self.model, onnx_path, threads=args[2])
            self.runner = BatchRunner(self.model, max_rows=self.runner.max_rows)
            self.platform = "onnxruntime"
            self._meta = self.describe()

    return ModelServer, OrtModelServer


def start_server(lib: str, onnx_path: str, port: int, replicas_: int = 2) -> str:
    """Two Serve apps as `cuvil serve` deploys them (:func:`cuvil.serve.app.model_app`, one hop: Serve's proxy
    calls the model deployment): ``squeezenet`` (the library) and ``squeezenet_ort`` (the same ``ModelServer``
    code, its model onnxruntime), and the server-wide health app. The front end is `cuvil serve`'s default
    (:func:`cuvil.serve.app.apply_front`: HAProxy when a ``haproxy`` binary is on PATH, else Serve's proxy; set
    ``RAY_SERVE_ENABLE_HA_PROXY=0`` to measure Serve's proxy)."""
    from cuvil.serve.app import apply_front, health_app, model_app, run_apps
    apply_front("auto")       # before Ray is imported: Serve reads its settings then
    print(f"front end: {front_name()}", file=sys.stderr, flush=True)

    ModelServer, OrtModelServer = _server_classes()
    opts = start_serve(port, replicas_)
    apps = [model_app(ModelServer, lib, "squeezenet", opts), model_app(OrtModelServer, lib, "squeezenet_ort", opts, 0,
                                                                       onnx_path)]
    run_apps(apps + [health_app([a[0] for a in apps], ["squeezenet", "squeezenet_ort"])])
    base = f"http://127.0.0.1:{port}"
    _wait_ready(base)
    return base


def start_serve(port: int, replicas: int = 2, num_cpus: int = 4):
    """A local Ray (retried, a failed attempt's processes ended) and Serve on 127.0.0.1:``port``; returns the
    ServeOptions of this bench's deployments (one-thread replicas, batching up to the profile's max within 2 ms).
    Call :func:`cuvil.serve.app.apply_front` first. Shared by serving_knobs/serving_env_ab/serving_profile."""
    from ray import serve
    from cuvil.serve.app import ServeOptions, init_local_ray
    opts = ServeOptions(port=port, replicas=replicas, threads=1, max_batch_size=PROFILE[2], batch_wait_s=0.002,
                        max_body_bytes=MAX_BODY, quiet=True)
    init_local_ray(5, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    return opts


def front_name() -> str:
    return "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Serve's proxy"


def _wait_ready(base: str, timeout: float = 300) -> None:
    import urllib3
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib3.request("GET", base + "/v2/health/ready", timeout=5, retries=False).status == 200:
                return
        except urllib3.exceptions.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {base} was not ready after {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- PyTriton (optional, in its own interpreter) --------------------------------------------------------------

_PYTRITON_SERVER = r'''
import sys, numpy as np, onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
onnx_path, port, max_batch, instances = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def make_infer():   # one onnxruntime session (one thread) per model instance, as one per Serve replica
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1; so.log_severity_level = 3
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    iname, oname = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    @batch
    def infer(**inputs):
        return {oname: sess.run(None, {iname: inputs[iname]})[0]}
    return infer, iname, oname

funcs = [make_infer() for _ in range(instances)]
iname, oname = funcs[0][1], funcs[0][2]
with Triton(config=TritonConfig(http_port=port, grpc_port=port + 1, metrics_port=port + 2)) as t:
    t.bind(model_name="squeezenet_triton", infer_func=[f for f, _, _ in funcs],
           inputs=[Tensor(name=iname, dtype=np.float32, shape=(3, 224, 224))],
           outputs=[Tensor(name=oname, dtype=np.float32, shape=(-1, -1, -1))],
           config=ModelConfig(max_batch_size=max_batch, batcher=DynamicBatcher(max_queue_delay_microseconds=2000)))
    print("ready", flush=True)
    t.serve()
'''


def start_pytriton(python: str, onnx_path: str, port: int):
    """A PyTriton server in ``python`` (its own interpreter and venv): two model instances (one onnxruntime
    session of one thread each, as the two Serve replicas), dynamic batching up to 8 within 2 ms, as Serve's.
    (process, base URL), or (None, why not). Its Python backend stub loads the system's libpython: the venv
    must be made from the system's interpreter (a pyenv 3.11.7 venv fails in the stub: `_thread.RLock` has no
    `_recursion_count`)."""
    proc = subprocess.Popen([python, "-c", _PYTRITON_SERVER, onnx_path, str(port), str(PROFILE[2]), "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.strip() == "ready":
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()   # drain its log
            return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    return None, "PyTriton did not start: " + " | ".join(lines[-3:])


# -- the parts --------------------------------------------------------------------------------------------------

def _pooled(runs: list[dict]) -> dict:
    """One engine's figures over its rounds: percentiles of every latency, throughput the rounds' mean."""
    lat = np.concatenate([np.asarray(r["latencies_ms"]["cuvil"]) for r in runs]) if runs else np.zeros(0)
    n = len(lat)
    pct = (lambda q: float(np.percentile(lat, q))) if n else (lambda q: math.nan)
    errors = sum(r["cuvil"]["errors"] for r in runs)
    return {"p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": float(lat.max()) if n else math.nan,
            "throughput_ips": float(np.mean([r["cuvil"]["throughput_ips"] for r in runs])),
            "throughput_rounds": [r["cuvil"]["throughput_ips"] for r in runs], "runs": n, "errors": errors,
            "first_error": next((r["cuvil"]["first_error"] for r in runs if r["cuvil"]["first_error"]), None)}


def _group(label: str) -> str:
    """A process's hop: client, HTTP proxy, a model's replicas, or Ray's control processes."""
    if label.startswith("replica "):
        app = label.split()[1].split("/")[0]
        return "health replica" if app == "cuvil" else f"{app.removeprefix('cuvil-')} replicas"
    if label in ("HTTP proxy", "client (this process)", "Triton (PyTriton process tree)", "HAProxy"):
        return label
    return "Ray control (controller, GCS, raylet)"


def haproxy_pids() -> list[int]:
    """HAProxy's processes under this driver's Ray instance (Serve starts it when RAY_SERVE_ENABLE_HA_PROXY=1):
    not Ray actors, so :func:`cuvil.testing.serving.serve_processes` does not list them."""
    out = []
    for pid in process_tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "haproxy":
                    out.append(pid)
        except OSError:
            pass
    return out


def _cpu_snapshot(triton_pid: int | None) -> dict[str, float]:
    """CPU seconds used so far by each serving process, by hop (:func:`_group`; HAProxy where it runs), and by
    this process (the clients, or the in-process engine)."""
    out: dict[str, float] = {"client (this process)": sum(os.times()[:2])}
    hap = haproxy_pids()
    if hap:
        out["HAProxy"] = sum(_safe_cpu(p) for p in hap)
    for label, pid in serve_processes().items():
        try:
            g = _group(label)
            out[g] = out.get(g, 0.0) + cpu_seconds(pid)
        except (OSError, ValueError):
            pass
    if triton_pid is not None:
        out["Triton (PyTriton process tree)"] = sum(_safe_cpu(p) for p in process_tree(triton_pid))
    return out


def _safe_cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except (OSError, ValueError):
        return 0.0


def part_ab(lib: str, base: str, triton: str | None, triton_pid: int | None, rounds: int, round_s: float,
            log) -> dict:
    engines = {"in-process": lambda: run_benchmark(BenchOptions(lib, threads=1, concurrency=8, duration=round_s,
                                                                warmup=5, cold_runs=0, shapes={"N": 1})),
               "serve cuvil": lambda: _http(f"{base}/v2/models/squeezenet", 8, round_s),
               "serve onnxruntime": lambda: _http(f"{base}/v2/models/squeezenet_ort", 8, round_s)}
    if triton:
        engines["pytriton onnxruntime"] = lambda: _http(f"{triton}/v2/models/squeezenet_triton", 8, round_s)
    runs = {e: [] for e in engines}
    cpu = {e: {} for e in engines}        # engine -> hop -> CPU seconds over its rounds (warm-up included)
    order = list(engines)
    for r in range(rounds):
        for e in order[r % len(order):] + order[:r % len(order)]:     # each round starts with another engine
            before = _cpu_snapshot(triton_pid)
            res = engines[e]()
            after = _cpu_snapshot(triton_pid)
            for hop in after:
                cpu[e][hop] = cpu[e].get(hop, 0.0) + after[hop] - before.get(hop, after[hop])
            res["requests_incl_warmup"] = res["cuvil"]["runs"] + res["cuvil"]["errors"] + 8 * 5
            runs[e].append(res)
            c = res["cuvil"]
            log(f"(a/b) round {r + 1}/{rounds} {e}: p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms, "
                f"{c['throughput_ips']:.1f}/s, {c['errors']} errors")
    out = {e: _pooled(rs) for e, rs in runs.items()}
    for e, rs in runs.items():
        n = sum(r["requests_incl_warmup"] for r in rs)
        out[e]["cpu_ms_per_request"] = {hop: 1e3 * secs / n for hop, secs in sorted(cpu[e].items())}
    inproc, served = out["in-process"], out["serve cuvil"]
    out["ratios"] = {
        "serve_vs_inprocess_throughput": served["throughput_ips"] / inproc["throughput_ips"],
        "serve_minus_inprocess_p99_ms": served["p99_ms"] - inproc["p99_ms"],
        "cuvil_vs_ort_served_throughput": served["throughput_ips"] / out["serve onnxruntime"]["throughput_ips"],
        "cuvil_vs_ort_served_p99": served["p99_ms"] / out["serve onnxruntime"]["p99_ms"]}
    if triton:
        t = out["pytriton onnxruntime"]
        out["ratios"].update({"cuvil_vs_pytriton_throughput": served["throughput_ips"] / t["throughput_ips"],
                              "cuvil_vs_pytriton_p99": served["p99_ms"] / t["p99_ms"]})
    return out


def _http(url: str, concurrency: int, seconds: float, **kw) -> dict:
    return run_http_benchmark(HttpBenchOptions(url, concurrency=concurrency, duration=seconds, warmup=5,
                                               shapes={"data_0": SHAPE}, **kw))


def _replica_rss() -> dict[str, int]:
    """Resident memory of the library's replicas, the HTTP proxy and the health replica (KiB, by label)."""
    out = {}
    for label, pid in serve_processes().items():
        if label.startswith("replica cuvil-squeezenet/") or label.startswith("replica cuvil/") or label == "HTTP proxy":
            try:
                out[f"{label} (pid {pid})"] = rss_kb(pid)
            except (OSError, ValueError):
                pass
    return out


def part_c(base: str, seconds: float, log) -> dict:
    warm = max(30.0, seconds / 10)
    samples: list[tuple[float, dict]] = []
    stop = threading.Event()

    def sample():
        t0 = time.monotonic()
        while not stop.wait(5.0):
            samples.append((time.monotonic() - t0, _replica_rss()))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    log(f"(c) soak: {seconds:.0f} s at concurrency 16, RSS sampled every 5 s")
    res = _http(f"{base}/v2/models/squeezenet", 16, seconds)
    stop.set()
    th.join()
    after_warm = next((s for t, s in samples if t >= warm), samples[0][1] if samples else {})
    end = samples[-1][1] if samples else {}
    growth = {k: 100.0 * (end[k] - v) / v for k, v in after_warm.items() if k in end and v}
    c = res["cuvil"]
    return {"seconds": seconds, "warmup_s": warm, "runs": c["runs"], "errors": c["errors"],
            "error_rate_pct": c["error_rate_pct"], "first_error": c["first_error"], "p50_ms": c["p50_ms"],
            "p99_ms": c["p99_ms"], "throughput_ips": c["throughput_ips"], "rss_after_warmup_kb": after_warm,
            "rss_end_kb": end, "rss_growth_pct": growth, "max_growth_pct": max(growth.values()) if growth else math.nan,
            "rss_samples": [(round(t, 1), s) for t, s in samples]}


def part_d(base: str, log) -> dict:
    import urllib3
    from cuvil.serve.app import model_app_name
    app = model_app_name("squeezenet")
    before = replicas("model-squeezenet", app)
    stop = threading.Event()
    box = {}
    t = threading.Thread(target=lambda: box.update(res=_http(f"{base}/v2/models/squeezenet", 8, 3600, stop=stop,
                                                             timeout_s=60)), daemon=True)
    t.start()
    time.sleep(5)
    victim = before[0]
    log(f"(d) SIGKILL replica pid {victim['pid']} under load (concurrency 8)")
    t_kill = time.monotonic()
    kill_replica(victim)
    ready_seen, replaced_s = [], None
    while time.monotonic() - t_kill < 180:
        try:
            ready_seen.append(urllib3.request("GET", base + "/v2/health/ready", timeout=5, retries=False).status)
        except urllib3.exceptions.HTTPError as e:
            ready_seen.append(type(e).__name__)
        now = replicas("model-squeezenet", app)
        if len(now) == len(before) and victim["actor_id"] not in {r["actor_id"] for r in now}:
            replaced_s = time.monotonic() - t_kill
            break
        time.sleep(0.25)
    time.sleep(5)
    stop.set()
    t.join(120)
    c = box["res"]["cuvil"]
    return {"replaced_after_s": replaced_s, "errors": c["errors"], "runs": c["runs"], "concurrency": 8,
            "first_error": c["first_error"], "ready_statuses_meanwhile": sorted({str(s) for s in ready_seen}),
            "ready_after": urllib3.request("GET", base + "/v2/health/ready", timeout=10, retries=False).status}


def part_e(base: str, n: int, log) -> dict:
    import urllib3
    pool = urllib3.PoolManager(retries=False)
    meta = fetch_metadata(f"{base}/v2/models/squeezenet")
    by_kind = {k: {"sent": 0, "400": 0, "other": []} for k in MALFORMED_KINDS}
    log(f"(e) {n} malformed requests")
    t0 = time.monotonic()
    for kind, model, body, headers in malformed_requests(meta, list(SHAPE), n, seed=0, max_body=MAX_BODY,
                                                         symbol_max=PROFILE[2]):
        k = by_kind[kind]
        k["sent"] += 1
        try:
            r = pool.request("POST", f"{base}/v2/models/{model}/infer", body=body, headers=headers, timeout=60)
            try:
                msg = json.loads(r.data).get("error")
            except ValueError:
                msg = None
            if r.status == 400 and isinstance(msg, str) and MALFORMED_KINDS[kind] in msg.lower() \
                    and "Traceback" not in msg:
                k["400"] += 1
                k.setdefault("example", msg[:160])
            else:
                k["other"].append(f"{r.status}: {r.data[:120]!r}")
        except urllib3.exceptions.HTTPError as e:
            k["other"].append(f"{type(e).__name__}: {e}"[:160])
    secs = time.monotonic() - t0
    ready = pool.request("GET", base + "/v2/health/ready", timeout=10).status
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    answer = Client(f"{base}/v2/models/squeezenet", ["data_0"], [x], [meta["outputs"][0]["name"]]).infer(decode=True)
    for k in by_kind.values():
        k["other"] = k["other"][:3] + ([f"... {len(k['other']) - 3} more"] if len(k["other"]) > 3 else [])
    return {"n": n, "seconds": secs, "by_kind": by_kind, "all_400": all(k["400"] == k["sent"] for k in by_kind.values()
                                                                        if k["sent"]),
            "ready_after": ready, "valid_request_after": list(next(iter(answer.values())).shape)}


# -- report ---------------------------------------------------------------------------------------------------

def report(res: dict) -> str:
    front = res.get("front", "Serve's proxy")
    L = [f"## {res['date']} on {res['cpu']} ({res['cores']} cores, shared)", ""]
    L.append(f"`python3 bench/serving.py {' '.join(res['argv'])}`: SqueezeNet 1.0 (batch N in {list(PROFILE)}, one row "
             f"per request), two one-thread replicas per model (one hop: {front} calls them), batching up to {PROFILE[2]} rows "
             f"within 2 ms.")
    ab = res.get("ab")
    if ab:
        L += ["", f"(a), (b): {res['rounds']} rounds of {res['round_s']:g} s per engine, alternating, concurrency 8",
              "", "| engine | p50 ms | p90 ms | p99 ms | throughput /s (per round) | errors |", "|---|---|---|---|---|---|"]
        for e, f in ab.items():
            if e == "ratios":
                continue
            L.append(f"| {e} | {f['p50_ms']:.2f} | {f['p90_ms']:.2f} | {f['p99_ms']:.2f} | {f['throughput_ips']:.1f} "
                     f"({', '.join(f'{x:.0f}' for x in f['throughput_rounds'])}) | {f['errors']} |")
        hops = sorted({h for e, f in ab.items() if e != "ratios" for h in f["cpu_ms_per_request"]})
        L += ["", "CPU per request by process (ms of user + system CPU over the rounds, warm-up requests counted; "
                  "other engines' servers idle meanwhile):", "",
              "| engine | " + " | ".join(hops) + " | total |", "|---|" + "---|" * (len(hops) + 1)]
        for e, f in ab.items():
            if e == "ratios":
                continue
            c = f["cpu_ms_per_request"]
            L.append(f"| {e} | " + " | ".join(f"{c.get(h, 0.0):.2f}" for h in hops) + f" | {sum(c.values()):.2f} |")
        r = ab["ratios"]
        L += ["", f"- (a) served / in-process throughput: **{r['serve_vs_inprocess_throughput']:.2f}x** (goal >= 0.8x); "
                  f"p99 served - in-process: **{r['serve_minus_inprocess_p99_ms']:+.2f} ms** (goal <= +5 ms)",
              f"- (b) Cuvil / onnxruntime behind the same deployment: throughput **{r['cuvil_vs_ort_served_throughput']:.2f}x**, "
              f"p99 **{r['cuvil_vs_ort_served_p99']:.2f}x** (goal: > 1x and < 1x)"]
        if "cuvil_vs_pytriton_throughput" in r:
            L.append(f"- (b) Cuvil on Ray Serve / Triton (PyTriton, onnxruntime): throughput "
                     f"**{r['cuvil_vs_pytriton_throughput']:.2f}x**, p99 **{r['cuvil_vs_pytriton_p99']:.2f}x**")
    if res.get("pytriton_note"):
        L.append(f"- PyTriton: {res['pytriton_note']}")
    c = res.get("c")
    if c:
        L += ["", f"(c) soak: {c['seconds']:.0f} s at concurrency 16: {c['runs']:,} requests, **{c['errors']} errors**"
                  f" ({c['error_rate_pct']:.3g} %), p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms, "
                  f"{c['throughput_ips']:.1f}/s; RSS after the warm-up ({c['warmup_s']:.0f} s) -> end:"]
        for k, v in c["rss_after_warmup_kb"].items():
            if k in c["rss_end_kb"]:
                L.append(f"  - {k}: {v / 1024:.1f} -> {c['rss_end_kb'][k] / 1024:.1f} MiB "
                         f"(**{c['rss_growth_pct'][k]:+.2f} %**)")
        if c["first_error"]:
            L.append(f"  - first error: {c['first_error']}")
    d = res.get("d")
    if d:
        L += ["", f"(d) replica SIGKILLed under load (concurrency {d['concurrency']}): replaced after "
                  + (f"{d['replaced_after_s']:.1f} s" if d["replaced_after_s"] is not None else "NOT replaced in 180 s")
                  + f"; **{d['errors']} errors** of {d['runs'] + d['errors']:,} requests (bound: {d['concurrency']} in "
                  f"flight); /v2/health/ready meanwhile: {', '.join(d['ready_statuses_meanwhile'])}, after: "
                  f"{d['ready_after']}" + (f"; first error: {d['first_error']}" if d["first_error"] else "")]
    e = res.get("e")
    if e:
        L += ["", f"(e) {e['n']:,} malformed requests in {e['seconds']:.1f} s: "
                  + ("**all 400 with a message**" if e["all_400"] else "**NOT all 400**")
                  + f"; ready after: {e['ready_after']}; a valid request after: output {e['valid_request_after']}", "",
              "| kind | sent | 400 + its message | other | example message |", "|---|---|---|---|---|"]
        for k, v in e["by_kind"].items():
            L.append(f"| {k} | {v['sent']} | {v['400']} | {'; '.join(v['other']) or '-'} | "
                     f"{v.get('example', '-').replace('|', '/')} |")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="abcde", help="which parts to run (default abcde)")
    ap.add_argument("--quick", action="store_true", help="short: 2 rounds of 5 s, a 60 s soak, 200 malformed")
    ap.add_argument("--rounds", type=int, help="(a/b) rounds per engine (default 3)")
    ap.add_argument("--round-s", type=float, help="(a/b) seconds per round (default 10)")
    ap.add_argument("--soak-s", type=float, help="(c) seconds (default 600)")
    ap.add_argument("--malformed", type=int, help="(e) requests (default 1000)")
    ap.add_argument("--pytriton-python", help="(b) an interpreter with nvidia-pytriton and onnxruntime installed "
                                              "(/usr/bin/python3 -m venv V && V/bin/pip install nvidia-pytriton onnxruntime)")
    ap.add_argument("--json", help="write every figure as JSON")
    a = ap.parse_args(argv)
    q = a.quick
    rounds, round_s = a.rounds or (2 if q else 3), a.round_s or (5.0 if q else 10.0)
    soak_s, n_bad = a.soak_s or (60.0 if q else 600.0), a.malformed or (200 if q else 1000)
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    res = {"date": datetime.date.today().isoformat(), "cpu": cpu_label(), "cores": len(os.sched_getaffinity(0)),
           "argv": list(argv if argv is not None else sys.argv[1:]), "rounds": rounds, "round_s": round_s}
    with tempfile.TemporaryDirectory(prefix="cuvil-serving-") as tmp:
        log("compiling SqueezeNet (N in [1, 8]) at O3")
        lib, onnx_path = squeezenet(tmp)
        base = start_server(lib, onnx_path, free_port())
        res["front"] = front_name()
        log(f"serving at {base}")
        triton = tproc = None
        try:
            if "a" in a.parts or "b" in a.parts:
                if a.pytriton_python:
                    tproc, got = start_pytriton(a.pytriton_python, onnx_path, free_port())
                    if tproc is None:
                        res["pytriton_note"] = got
                    else:
                        triton = got
                else:
                    res["pytriton_note"] = ("not run: nvidia-pytriton 0.7 would downgrade this venv's numpy to "
                                            "1.26 and protobuf; give --pytriton-python with a venv of its own")
                res["ab"] = part_ab(lib, base, triton, tproc.pid if tproc is not None else None, rounds,
                                    round_s, log)
            if tproc is not None:
                tproc.terminate()
                tproc.wait(30)
            if "c" in a.parts:
                res["c"] = part_c(base, soak_s, log)
            if "d" in a.parts:
                res["d"] = part_d(base, log)
            if "e" in a.parts:
                res["e"] = part_e(base, n_bad, log)
        finally:
            if tproc is not None and tproc.poll() is None:
                tproc.kill()
            import ray
            from ray import serve
            serve.shutdown()
            ray.shutdown()
    text = report(res)
    print(text)
    if a.json:
        write_json(res, a.json)
    return res


if __name__ == "__main__":
    main()
