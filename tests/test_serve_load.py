"""Load on a live `cuvil serve` (issue 26, parts 4 and 5), bounded: `cuvil bench --url` against a local Ray Serve
instance (its figures, report and SLA verdict are the in-process benchmark's), random malformed requests of every
kind (each a 400 with a message, the server healthy after), and a replica killed under load (restarted, errors
only for requests in flight). One Ray instance for the module (2 CPUs, no dashboard, stopped at the end); no
timing is asserted. The full campaigns (10-minute soak, 1,000 malformed requests) are bench/serving.py."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'cuvil[serve]'")
pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'cuvil[serve]'")
urllib3 = pytest.importorskip("urllib3", reason="cuvil bench --url's client: pip install urllib3")

import cuvil  # noqa: E402
from cuvil.bench import SLA_KEYS  # noqa: E402
from cuvil.bench_http import Client, HttpBenchOptions, run_http_benchmark  # noqa: E402
from cuvil.cli import main as cli_main  # noqa: E402
from cuvil.cli.demo import demo_model_path  # noqa: E402
from cuvil.serve import app as serve_app  # noqa: E402
from cuvil.serve.app import ServeOptions, model_app_name  # noqa: E402
from cuvil.testing.serving import MALFORMED_KINDS, kill_replica, malformed_requests, replicas  # noqa: E402

MAX_BODY = 256 << 10
PROFILE_MAX = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo CNN (batch symbol N in [1, 8], opt 2) on two replicas of one thread each."""
    d = tmp_path_factory.mktemp("load")
    lib = cuvil.Pipeline.from_onnx(demo_model_path()).optimize() \
        .compile(shape_profiles={"N": (1, 2, PROFILE_MAX)}).save(str(d / "libdemo.so"))
    port = free_port()
    base = serve_app.start([lib], ServeOptions(port=port, replicas=2, threads=1, max_batch_size=4,
                                               batch_wait_s=0.002, max_body_bytes=MAX_BODY, quiet=True), num_cpus=2)
    try:
        yield {"base": base, "url": f"{base}/v2/models/demo", "lib": lib, "pool": urllib3.PoolManager(retries=False)}
    finally:
        serve_app.stop()


def get(server, path):
    r = server["pool"].request("GET", server["base"] + path, timeout=30)
    return r.status, json.loads(r.data)


def test_bench_url_gives_the_in_process_figures_and_verdict(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli_main(["bench", "--url", server["url"], "--concurrency", "4", "--runs", "60", "--warmup", "2",
                   "--input-shape", "image=2x3x16x16", "--sla", "p99_latency_ms=100000", "--sla", "error_rate_pct=0",
                   "--json", str(out), "-q"])
    text = capsys.readouterr().out
    assert rc == 0, text
    for label in ("p50 latency", "p90 latency", "p99 latency", "max latency", "throughput", "error rate", "runs",
                  "SLA held", "binary-data extension", "4 closed-loop worker(s)"):
        assert label in text, label
    r = json.loads(out.read_text())
    c = r["cuvil"]
    assert c["runs"] == 60 and c["errors"] == 0 and c["error_rate_pct"] == 0
    assert 0 < c["p50_ms"] <= c["p90_ms"] <= c["p99_ms"] <= c["max_ms"] and c["throughput_ips"] > 0
    assert len(r["latencies_ms"]["cuvil"]) == 60
    assert r["inputs"] == [{"name": "image", "dtype": "float32", "shape": [2, 3, 16, 16]}]
    assert r["outputs"] == [{"name": "probs", "dtype": "float32", "shape": [2, 10]}]
    # every SLA the in-process benchmark judges from these figures is judged alike
    assert [s["name"] for s in r["slas"]] == ["p99_latency_ms", "error_rate_pct"] and r["sla_held"]
    assert SLA_KEYS["p99_latency_ms"][0] == ("cuvil", "p99_ms")
    # an SLA that cannot hold: exit 1, NOT HELD
    assert cli_main(["bench", "--url", server["url"], "--runs", "5", "--warmup", "0", "--input-shape",
                     "image=1x3x16x16", "--sla", "p50_latency_ms=0.000001", "-q"]) == 1
    assert "NOT HELD" in capsys.readouterr().out


def test_json_tensors_and_the_answers_match_the_library(server):
    x = np.random.default_rng(3).standard_normal((3, 3, 16, 16)).astype(np.float32)
    want = cuvil.load(server["lib"], num_threads=1).run({"image": x})["probs"]
    for binary in (True, False):
        got = Client(server["url"], ["image"], [x], ["probs"], binary=binary).infer(decode=True)["probs"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    res = run_http_benchmark(HttpBenchOptions(server["url"], binary=False, runs=12, warmup=1, concurrency=2,
                                              shapes={"image": (1, 3, 16, 16)}))
    assert res["cuvil"]["runs"] == 12 and res["cuvil"]["errors"] == 0
    # no shape given: the batch symbol N at the opt the server publishes (2), or --fix N=...
    res = run_http_benchmark(HttpBenchOptions(server["url"], runs=4, warmup=0))
    assert res["inputs"] == [{"name": "image", "dtype": "float32", "shape": [2, 3, 16, 16]}]
    res = run_http_benchmark(HttpBenchOptions(server["url"], runs=4, warmup=0, shapes={"N": 5}))
    assert res["inputs"][0]["shape"] == [5, 3, 16, 16] and res["cuvil"]["errors"] == 0


def test_a_failing_server_counts_errors_with_the_first_message(server):
    # a request the server refuses (outside the profile) fails every time: the error rate is 100 %, the
    # server's message is shown, and the probe request says so before any timing
    with pytest.raises(cuvil.CuvilError, match="fails the benchmark's request: HTTP 400"):
        run_http_benchmark(HttpBenchOptions(server["url"], runs=3, shapes={"image": (PROFILE_MAX + 1, 3, 16, 16)}))


def test_malformed_requests_get_400s_with_a_message_and_the_server_stays_healthy(server):
    status, meta = get(server, "/v2/models/demo")
    assert status == 200
    seen = {}
    for kind, model, body, headers in malformed_requests(meta, [2, 3, 16, 16], n=3 * len(MALFORMED_KINDS), seed=1,
                                                         max_body=MAX_BODY, symbol_max=PROFILE_MAX):
        r = server["pool"].request("POST", f"{server['base']}/v2/models/{model}/infer", body=body, headers=headers,
                                   timeout=30)
        msg = json.loads(r.data).get("error")
        assert r.status == 400 and isinstance(msg, str) and msg.strip(), (kind, r.status, r.data[:300])
        assert MALFORMED_KINDS[kind] in msg.lower() and "Traceback" not in msg, (kind, msg)
        seen.setdefault(kind, msg)
    assert set(seen) == set(MALFORMED_KINDS)
    assert get(server, "/v2/health/ready") == (200, {"ready": True})
    x = np.zeros((1, 3, 16, 16), np.float32)
    assert Client(server["url"], ["image"], [x], ["probs"]).infer(decode=True)["probs"].shape == (1, 10)


def test_a_replica_killed_under_load_is_replaced_and_only_its_requests_fail(server):
    before = replicas("model-demo", model_app_name("demo"))
    assert len(before) == 2 and all(r["pid"] for r in before)
    stop = threading.Event()
    opts = HttpBenchOptions(server["url"], duration=600, warmup=1, concurrency=4, shapes={"image": (1, 3, 16, 16)},
                            timeout_s=30, stop=stop)
    box = {}
    # the load runs until the replacement is up and has served a while; then `stop` ends it
    t = threading.Thread(target=lambda: box.update(res=run_http_benchmark(opts)), daemon=True)
    t.start()
    time.sleep(3)
    victim = before[0]
    kill_replica(victim)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = replicas("model-demo", model_app_name("demo"))
        if len(now) == 2 and victim["actor_id"] not in {r["actor_id"] for r in now}:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the killed replica was not replaced: {replicas('model-demo')}")
    time.sleep(2)                       # load on the new pair of replicas
    stop.set()                          # the workers stop after their current request
    t.join(120)
    assert not t.is_alive()
    c = box["res"]["cuvil"]
    # errors: only requests that were in flight on the killed replica; at most one per closed-loop worker
    # (each worker has one request out at a time) plus the replica's queue, bounded by the concurrency
    assert c["runs"] > 0 and c["errors"] <= opts.concurrency, c
    if c["errors"]:
        assert "did not answer" in c["first_error"] or "HTTP 500" in c["first_error"], c["first_error"]
    assert get(server, "/v2/health/ready") == (200, {"ready": True})
