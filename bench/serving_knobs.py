"""Ray Serve's knobs against the served-vs-in-process gap (issue 26, the (a) part of bench/serving.py only): one
server configuration per process, because Serve reads its ``RAY_SERVE_*`` settings once, when a process imports
it (the proxy, the controller and the replicas inherit this process's environment through the local Ray
instance it starts).

    python3 bench/serving_knobs.py LIB '{}' /tmp/base.json                       # the defaults of cuvil serve
    python3 bench/serving_knobs.py LIB '{"env": {"RAY_SERVE_PROXY_USE_GRPC": "1"}}' /tmp/grpc.json
    python3 bench/serving_knobs.py LIB '{"replicas": 1, "threads": 2}' /tmp/one2.json
    python3 bench/serving_knobs.py LIB '{"mbs": 1}' /tmp/nobatch.json
    python3 bench/serving_knobs.py LIB '{"env": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}, "direct": true}' /tmp/d.json

LIB: SqueezeNet with a symbolic batch N in [1, 8] (``bench/serving.py``'s ``squeezenet()`` writes one). The
configuration (JSON): ``env`` (set before Ray starts), ``replicas`` (2), ``threads`` per replica (1), ``cpus``
reserved per replica, ``mbs`` (max batch size, 8), ``wait`` (batch wait, s, 0.002), ``binary`` (True), ``http``
(more of Serve's ``http_options``), ``health`` (deploy the health app, True), ``direct``: the clients also load
the replicas' own direct-ingress ports (half the concurrency each) as a third engine, skipping Serve's proxy.
Rounds alternate the in-process engine (``cuvil bench``'s loop, 8 threads) and the served one (concurrency 8);
the CPU time of every process per request is taken from /proc, as bench/serving.py does. Prints one line, writes
the figures as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

cfg = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
for k, v in cfg.get("env", {}).items():
    os.environ[k] = str(v)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving as S  # noqa: E402  (bench/serving.py: the server, the client, the CPU accounting)


def _direct_ports() -> list[int]:
    """The ports the model's replicas listen on themselves (direct ingress), from the kernel's socket table."""
    from cuvil.testing.serving import serve_processes
    pids = {pid for label, pid in serve_processes().items() if label.startswith("replica cuvil-squeezenet/")}
    return sorted(p for p in listening_ports(pids) if 30000 <= p < 31000)


def listening_ports(pids: set[int]) -> set[int]:
    import subprocess
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in text.splitlines()
            if any(f"pid={p}," in line for p in pids)}


def _direct(ports: list[int], seconds: float) -> dict:
    """Concurrency 8 split over the replicas' own ports: one pooled result."""
    res: dict = {}
    per = max(1, 8 // len(ports))

    def go(p):
        res[p] = S._http(f"http://127.0.0.1:{p}/v2/models/squeezenet", per, seconds)
    ts = [threading.Thread(target=go, args=(p,)) for p in ports]
    [t.start() for t in ts]
    [t.join() for t in ts]
    import numpy as np
    rs = list(res.values())
    lat = np.concatenate([np.asarray(r["latencies_ms"]["cuvil"]) for r in rs])
    return {"cuvil": {"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                      "throughput_ips": sum(r["cuvil"]["throughput_ips"] for r in rs),
                      "errors": sum(r["cuvil"]["errors"] for r in rs), "runs": sum(r["cuvil"]["runs"] for r in rs),
                      "first_error": next((r["cuvil"]["first_error"] for r in rs if r["cuvil"]["first_error"]), None)},
            "latencies_ms": {"cuvil": lat.tolist()}}


def main() -> None:
    import ray
    from ray import serve

    from cuvil.bench import BenchOptions, run_benchmark
    from cuvil.serve.app import ServeOptions, health_app, init_local_ray, model_app, run_apps
    from cuvil.serve.deployment import ModelServer
    lib, out_path = sys.argv[1], sys.argv[3]
    port = S.free_port()
    opts = ServeOptions(port=port, replicas=cfg.get("replicas", 2), threads=cfg.get("threads", 1),
                        cpus=cfg.get("cpus"), max_batch_size=cfg.get("mbs", 8), batch_wait_s=cfg.get("wait", 0.002),
                        max_body_bytes=S.MAX_BODY, quiet=True)
    init_local_ray(5, num_cpus=4, include_dashboard=False, log_to_driver=False)   # retried, leftovers ended
    serve.start(http_options={"host": "127.0.0.1", "port": port, **cfg.get("http", {})},
                logging_config={"log_level": "WARNING"})
    app = model_app(ModelServer, lib, "squeezenet", opts)
    run_apps([app] + ([health_app([app[0]], ["squeezenet"])] if cfg.get("health", True) else []))
    base = f"http://127.0.0.1:{port}"
    if cfg.get("health", True):
        S._wait_ready(base)
    rounds, rs = cfg.get("rounds", 2), cfg.get("round_s", 6)
    eng = {"inproc": lambda: run_benchmark(BenchOptions(lib, threads=1, concurrency=8, duration=rs, warmup=5,
                                                        cold_runs=0, shapes={"N": 1})),
           "served": lambda: S._http(f"{base}/v2/models/squeezenet", 8, rs, binary=cfg.get("binary", True))}
    if cfg.get("direct"):
        ports = _direct_ports()
        eng["direct"] = lambda: _direct(ports, rs)
    runs = {e: [] for e in eng}
    cpu = {e: {} for e in eng}
    order = list(eng)
    for r in range(rounds):
        for e in order[r % len(order):] + order[:r % len(order)]:
            b = S._cpu_snapshot(None)
            res = eng[e]()
            a = S._cpu_snapshot(None)
            for h in a:
                cpu[e][h] = cpu[e].get(h, 0.0) + a[h] - b.get(h, a[h])
            res["n"] = res["cuvil"]["runs"] + res["cuvil"]["errors"] + 40
            runs[e].append(res)
    out = {e: S._pooled(v) for e, v in runs.items()}
    for e, v in runs.items():
        n = sum(r["n"] for r in v)
        out[e]["cpu_ms"] = {h: round(1e3 * s / n, 2) for h, s in sorted(cpu[e].items())}
    out["ratio"] = out["served"]["throughput_ips"] / out["inproc"]["throughput_ips"]
    out["dp99"] = out["served"]["p99_ms"] - out["inproc"]["p99_ms"]
    out["cfg"], out["cpu"] = cfg, S.cpu_label()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(json.dumps({e: (round(out[e]["throughput_ips"], 1), round(out[e]["p99_ms"], 1)) for e in eng}),
          f"ratio {out['ratio']:.2f}", flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
