"""Multi-node serving (issue 26, part 6): a two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and one worker node, one CPU each), ``cuvil serve``'s app on it with two one-thread replicas (one CPU
each, so one per node), requests over HTTP from concurrent clients; the replicas are on both nodes and both
served requests (the ``Cuvil-Replica`` header of each answer). 45-115 s on a shared 2-core machine, most of it
the two nodes starting: marked ``slow`` (``pytest -m "not slow"`` leaves it out); bounded, no timing asserted."""
from __future__ import annotations

import collections
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'cuvil[serve]'")
serve = pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'cuvil[serve]'")
cluster_utils = pytest.importorskip("ray.cluster_utils", reason="needs Ray's test cluster")

import cuvil  # noqa: E402
from cuvil.bench_http import Client  # noqa: E402
from cuvil.cli.demo import demo_model_path  # noqa: E402
from cuvil.serve import app as serve_app  # noqa: E402
from cuvil.serve.app import ServeOptions, model_app_name  # noqa: E402
from cuvil.testing.serving import replicas  # noqa: E402


LOCAL_ROUTING = "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    lib = cuvil.Pipeline.from_onnx(demo_model_path()).optimize() \
        .compile(shape_profiles={"N": (1, 1, 4)}).save(str(tmp_path_factory.mktemp("cluster") / "libdemo.so"))
    # One HTTP proxy here (below), and Serve's proxy sends a request to a replica on its own node while that one
    # has room: the worker node's replica would idle. A real cluster has a proxy per node behind a load
    # balancer; here the proxy is told to spread (the variable reaches Ray's processes, started below).
    saved = os.environ.get(LOCAL_ROUTING)
    os.environ[LOCAL_ROUTING] = "0"
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        port = free_port()
        # One HTTP proxy, on the head: two nodes on one machine would both bind the port (a real cluster has a
        # proxy per node; cuvil serve's docs show that). start() joins the running cluster and leaves it up.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        base = serve_app.start([lib], ServeOptions(port=port, replicas=2, threads=1, quiet=True))
        yield {"base": base, "url": f"{base}/v2/models/demo", "lib": lib}
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop(LOCAL_ROUTING, None)
        else:
            os.environ[LOCAL_ROUTING] = saved


def test_replicas_on_both_nodes_and_both_serve(cluster):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    reps = replicas("model-demo", model_app_name("demo"))
    assert len(reps) == 2 and {r["node_id"] for r in reps} == nodes, reps
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    want = cuvil.load(cluster["lib"], num_threads=1).run({"image": x})["probs"]

    def burst(_):
        c = Client(cluster["url"], ["image"], [x], ["probs"])
        try:
            out = []
            for _ in range(25):
                y = c.infer(decode=True)["probs"]
                out.append((y, c.last_headers.get("Cuvil-Replica")))
            return out
        finally:
            c.close()

    with ThreadPoolExecutor(8) as ex:
        answers = [a for got in ex.map(burst, range(8)) for a in got]
    assert len(answers) == 200
    for y, _ in answers:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    # each answer names the replica that ran it (Cuvil-Replica: NODE_ID/PID): both nodes served
    by_node = collections.Counter(replica.partition("/")[0] for _, replica in answers)
    assert set(by_node) == nodes, (by_node, reps)
    assert {f"{r['node_id']}/{r['pid']}" for r in reps} == {replica for _, replica in answers}
