"""Where a `cuvil serve` replica's CPU goes under load (issue 26): SqueezeNet (N in [1, 8]) served as
bench/serving.py serves it (the default front end, 2 one-thread replicas, batching up to 8 within 2 ms), loaded at
concurrency 8 by `cuvil bench --url`'s client; meanwhile py-spy samples one replica (Python stacks by thread) and
/proc gives each replica thread's CPU time. Then, in this process, the library's own CPU per image at N = 1 and in
a batch of 8 (``BatchRunner.run_one`` vs ``run_batch``, thread CPU time, interleaved blocks, medians): what the
model thread would cost with no server around it.

    python3 bench/serving_profile.py LIB [SECONDS] [OUT_DIR]     # LIB: bench/serving.py's squeezenet() library

Prints, per request served: the CPU of each replica thread (by the name py-spy gives it), the requests per
batched call, the library's cost per image; and, of each Python thread's busy samples, the share under each
part of the request path. OUT_DIR (default /tmp/serving-profile) gets py-spy's raw stacks and the figures as JSON.
Needs py-spy (pip install py-spy) and the right to ptrace the replicas (root, or ptrace_scope 0).
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving as S  # noqa: E402  (bench/serving.py: the client, the CPU accounting)

#: Parts of the request path, by the Python frames under them (a sample counts in every part it is under): a
#: pattern matches a frame's function name containing it (``=NAME``: exactly NAME).
PARTS = {
    "cuvil ModelServer (route, body, parse, encode)": ["ModelServer._handle"],
    "  of it: reading the body (_body)": ["=_body"],
    "  of it: parse_infer_request": ["parse_infer_request"],
    "  of it: encode_infer_response": ["encode_infer_response"],
    "Serve's @serve.batch queue": ["_BatchQueue", "batch_wrapper", "enqueue_request"],
    "  of it: inspect.signature per request": ["extract_signature", "Signature.from_callable"],
    "Serve's metrics": ["Metric._record", "Histogram.observe", "Gauge.set", "_report_cached_metrics"],
    "executor hop (submit, future callbacks)": ["ThreadPoolExecutor.submit", "_chain_future", "_call_set_state"],
    "uvicorn/httptools (HTTP parse, send)": ["HttpToolsProtocol", "RequestResponseCycle"],
    "Serve's ASGI receive proxy (body chunks to the user loop)": ["ASGIDIReceiveProxy", "MessageQueue"],
    "Serve's middleware (request id, proxy headers)": ["RequestIdMiddleware", "ProxyHeadersMiddleware"],
    "the library's run (X86Model._run_arrays)": ["X86Model._run_arrays"],
}
#: Leaf frames of a thread that waits (py-spy counts a thread blocked in C as busy): the event loops' select,
#: Ray's worker loop, an idle executor thread.
IDLE = ("_run_user_code_event_loop (ray/serve/_private/replica.py", "Thread.run (threading.py",
        "Worker.main_loop (ray/_private/worker.py", "_worker (concurrent/futures/thread.py")


def _matches(name: str, pattern: str) -> bool:
    return name == pattern[1:] if pattern.startswith("=") else pattern in name


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (by thread id)."""
    out, hz = {}, os.sysconf("SC_CLK_TCK")
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(t)] = (int(fields[11]) + int(fields[12])) / hz
    return out


def read_stacks(path: str) -> tuple[dict[int, str], list[tuple[int, list[str], int]]]:
    """py-spy's raw output: thread names by id, and (thread id, frames, samples) per stack."""
    names, stacks = {}, []
    with open(path) as f:
        for line in f:
            stack, n = line.rstrip().rsplit(" ", 1)
            frames = stack.split(";")
            head = frames[0]           # thread (TID): NAME
            tid = int(head.split("(", 1)[1].split(")", 1)[0])
            names[tid] = head.split(":", 1)[1].strip() if ":" in head else "?"
            stacks.append((tid, frames[1:], int(n)))
    return names, stacks


def shares(stacks, tid: int) -> tuple[int, dict[str, float]]:
    busy, c = 0, collections.Counter()
    for t, frames, n in stacks:
        if t != tid or any(i in frames[-1] for i in IDLE):
            continue
        busy += n
        names = [f.split(" (")[0] for f in frames]
        for part, pats in PARTS.items():
            if any(_matches(nm, p) for nm in names for p in pats):
                c[part] += n
    return busy, {p: c[p] / busy for p in PARTS if busy and c[p]}


def engine_cost(lib: str, blocks: int = 12) -> dict:
    """The library's CPU per image (thread time, ms; medians of interleaved blocks) at N = 1 (8 calls) and N = 8
    (one ``run_batch`` of 8 one-row requests), and the share of ``np.concatenate`` in the latter."""
    from cuvil.artifact import load
    from cuvil.serve.batching import BatchRunner
    runner = BatchRunner(load(lib, num_threads=1), max_rows=8)
    rng = np.random.default_rng(0)
    reqs = [{runner.names[0]: rng.standard_normal(S.SHAPE, dtype=np.float32)} for _ in range(8)]
    for _ in range(3):
        runner.run_batch(reqs)
        [runner.run_one(r) for r in reqs]
    one, eight, cat = [], [], []
    for _ in range(blocks):
        t = time.thread_time()
        [runner.run_one(r) for r in reqs]
        one.append((time.thread_time() - t) / 8)
        t = time.thread_time()
        runner.run_batch(reqs)
        eight.append((time.thread_time() - t) / 8)
        t = time.thread_time()
        np.concatenate([r[runner.names[0]] for r in reqs])
        cat.append((time.thread_time() - t) / 8)
    return {"n1_ms": 1e3 * float(np.median(one)), "n8_ms": 1e3 * float(np.median(eight)),
            "concat_ms": 1e3 * float(np.median(cat))}


def main() -> None:
    lib = sys.argv[1]
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    out_dir = sys.argv[3] if len(sys.argv) > 3 else "/tmp/serving-profile"
    os.makedirs(out_dir, exist_ok=True)
    pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    from cuvil.serve.app import apply_front, health_app, model_app, run_apps
    apply_front("auto")
    from ray import serve

    from cuvil.serve.deployment import ModelServer
    from cuvil.testing.serving import serve_processes
    port = S.free_port()
    opts = S.start_serve(port, 2)
    app = model_app(ModelServer, lib, "squeezenet", opts)
    run_apps([app, health_app([app[0]], ["squeezenet"])])
    base = f"http://127.0.0.1:{port}"
    S._wait_ready(base)
    S._http(f"{base}/v2/models/squeezenet", 8, 3)          # warm
    pids = sorted(pid for label, pid in serve_processes().items() if label.startswith("replica cuvil-squeezenet/"))
    handle = serve.get_deployment_handle("model-squeezenet", app_name="cuvil-squeezenet")
    stats0 = {s["pid"]: s for s in (handle.stats.remote().result() for _ in range(8))}
    res: dict = {}
    load = threading.Thread(target=lambda: res.update(S._http(f"{base}/v2/models/squeezenet", 8, secs)))
    before = {p: thread_cpu(p) for p in pids}
    raw = os.path.join(out_dir, "replica-pyspy-raw.txt")
    load.start()
    time.sleep(1)
    spy = subprocess.Popen([pyspy, "record", "--pid", str(pids[0]), "--duration", str(int(secs - 4)), "--rate",
                            "250", "--format", "raw", "--threads", "--nonblocking", "-o", raw],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load.join()
    after = {p: thread_cpu(p) for p in pids}
    stats1 = {s["pid"]: s for s in (handle.stats.remote().result() for _ in range(8))}
    spy.wait()
    serve.shutdown()
    import ray
    ray.shutdown()
    n = res["cuvil"]["runs"]
    names, stacks = read_stacks(raw)
    per_thread = collections.Counter()      # the sampled replica's threads, by py-spy's names (ids elsewhere)
    for tid, cpu in after[pids[0]].items():
        per_thread[names.get(tid, "other threads (Ray's C++ and idle Python)")] += cpu - before[pids[0]].get(tid, 0.0)
    total = sum(sum(after[p].values()) - sum(before[p].values()) for p in pids)
    calls = {p: (stats1[p]["calls"] - stats0.get(p, {"calls": 0})["calls"],
                 stats1[p]["requests"] - stats0.get(p, {"requests": 0})["requests"]) for p in stats1}
    eng = engine_cost(lib)
    out = {"cpu": S.cpu_label(), "load1": os.getloadavg()[0], "requests": n,
           "throughput_ips": res["cuvil"]["throughput_ips"], "errors": res["cuvil"]["errors"],
           "replicas_cpu_ms_per_request": 1e3 * total / n,
           # the sampled replica served about half the requests: its threads per request of its own
           "sampled_replica_threads_ms": {k: 1e3 * v / max(1, calls.get(pids[0], (0, n / 2))[1])
                                          for k, v in per_thread.items() if v > 0},
           "calls_requests": calls, "engine": eng,
           "busy_shares": {names.get(t, "?"): shares(stacks, t) for t in sorted(names)}}
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"{out['cpu']}; load {out['load1']:.1f}; {n} requests, {out['throughput_ips']:.1f}/s, "
          f"{out['errors']} errors; replicas {out['replicas_cpu_ms_per_request']:.2f} ms CPU per request")
    for k, v in sorted(out["sampled_replica_threads_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:45s} {v:6.2f} ms per request of its replica")
    for p, (c, r) in calls.items():
        print(f"  replica {p}: {r} requests in {c} calls ({r / max(1, c):.2f} per call)")
    print(f"  the library alone: N = 1 {eng['n1_ms']:.2f} ms per image, in a batch of 8 {eng['n8_ms']:.2f} "
          f"({eng['n8_ms'] / eng['n1_ms']:.2f}x; np.concatenate {eng['concat_ms']:.3f})")
    for t, (busy, sh) in out["busy_shares"].items():
        print(f"  {t}: {busy} busy samples")
        for part, v in sh.items():
            print(f"    {100 * v:5.1f}%  {part}")


if __name__ == "__main__":
    main()
