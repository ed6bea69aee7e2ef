"""A Serve setting read by each replica, A/B in one Ray instance (issue 26): the library in-process, and two Serve
apps of it (`cuvil serve`'s default front end, 2 one-thread replicas, batching up to 8 within 2 ms) alike but for
environment variables given to B's replicas only (Ray's runtime_env env_vars: a replica reads RAY_SERVE_* when it
starts); rounds alternate the three engines at concurrency 8, CPU per request per process from /proc, as
bench/serving.py does.

    python3 bench/serving_env_ab.py LIB OUT.json '{"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}' 3 8

LIB: bench/serving.py's squeezenet() library; then the JSON of B's env, rounds, seconds per round.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving as S  # noqa: E402  (bench/serving.py: the client, the CPU accounting)
from cuvil.serve.app import (apply_front, health_app, model_app,  # noqa: E402
                             model_deployment_options, run_apps)


def main():
    lib, out_path = sys.argv[1], sys.argv[2]
    env_b = json.loads(sys.argv[3])
    rounds, rs = int(sys.argv[4]), float(sys.argv[5])
    apply_front("auto")
    import ray
    from ray import serve
    from cuvil.bench import BenchOptions, run_benchmark
    from cuvil.serve.deployment import ModelServer
    port = S.free_port()
    opts = S.start_serve(port, 2, num_cpus=6)
    a = model_app(ModelServer, lib, "squeezenet", opts)
    d = serve.deployment(ModelServer, **model_deployment_options(lib, "squeezenet_b", opts))
    d = d.options(ray_actor_options={"num_cpus": 1.0, "runtime_env": {"env_vars": env_b}})
    b = ("cuvil-squeezenet_b", "/v2/models/squeezenet_b",
         d.bind(os.path.abspath(lib), "squeezenet_b", 1, 8, 0.002, None, S.MAX_BODY))
    run_apps([a, b, health_app([a[0], b[0]], ["squeezenet", "squeezenet_b"])])
    base = f"http://127.0.0.1:{port}"
    S._wait_ready(base)
    eng = {"inproc": lambda: run_benchmark(BenchOptions(lib, threads=1, concurrency=8, duration=rs, warmup=5,
                                                        cold_runs=0, shapes={"N": 1})),
           "A": lambda: S._http(f"{base}/v2/models/squeezenet", 8, rs),
           "B": lambda: S._http(f"{base}/v2/models/squeezenet_b", 8, rs)}
    runs = {e: [] for e in eng}; cpu = {e: {} for e in eng}; loads = []
    order = list(eng)
    for r in range(rounds):
        for e in order[r % 3:] + order[:r % 3]:
            bf = S._cpu_snapshot(None); res = eng[e](); af = S._cpu_snapshot(None)
            for h in af:
                cpu[e][h] = cpu[e].get(h, 0.0) + af[h] - bf.get(h, af[h])
            res["n"] = res["cuvil"]["runs"] + res["cuvil"]["errors"] + 40
            runs[e].append(res)
            loads.append(os.getloadavg()[0])
            print(r, e, round(res["cuvil"]["throughput_ips"], 1), flush=True)
    out = {e: S._pooled(v) for e, v in runs.items()}
    for e, v in runs.items():
        n = sum(x["n"] for x in v)
        out[e]["cpu_ms"] = {h: round(1e3 * s / n, 2) for h, s in sorted(cpu[e].items())}
    out["env_b"], out["cpu"], out["load1"] = env_b, S.cpu_label(), loads
    json.dump(out, open(out_path, "w"), indent=1, default=str)
    for e in eng:
        o = out[e]
        print(e, f"{o['throughput_ips']:.1f}/s rounds {[round(x) for x in o['throughput_rounds']]} "
              f"p50 {o['p50_ms']:.1f} p99 {o['p99_ms']:.1f} err {o['errors']}",
              {k: v for k, v in o["cpu_ms"].items() if v >= 0.05})
    print("ratio A", out["A"]["throughput_ips"] / out["inproc"]["throughput_ips"],
          "B", out["B"]["throughput_ips"] / out["inproc"]["throughput_ips"],
          "B/A", out["B"]["throughput_ips"] / out["A"]["throughput_ips"], "load", loads)
    serve.shutdown(); ray.shutdown()

if __name__ == "__main__":
    main()
