"""`cuvil serve` on Ray Serve, end to end on loopback (issue 26): one Ray instance for the module (2 CPUs, no
dashboard, stopped at the end) serving the demo CNN (symbolic batch N, batched) and a static library (no batch
symbol, one request per call); Triton's own client (tritonclient.http, unchanged) drives it with JSON and binary
tensors, and the results are checked against the same libraries in this process; raw HTTP checks the 400s.
The model deployment's own code (metadata, errors, a failing model) and the health deployment's readiness on a
handle that never answers are also checked in this process, outside Ray."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import TensorProto, helper

ray = pytest.importorskip("ray", reason="needs Ray Serve: pip install 'cuvil[serve]'")
pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'cuvil[serve]'")
th = pytest.importorskip("tritonclient.http", reason="needs tritonclient: pip install 'tritonclient[http]'")

import cuvil  # noqa: E402
from cuvil.cli import main as cli_main  # noqa: E402
from cuvil.cli.demo import demo_model_path  # noqa: E402
from cuvil.serve import app as serve_app  # noqa: E402
from cuvil.serve.app import ServeOptions  # noqa: E402

MAX_BODY = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static_model(path: str) -> str:
    """z = x + float(k): x float[2, 3], k int64[2, 3] (no symbol: no batching)."""
    g = helper.make_graph([helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
                           helper.make_node("Add", ["x", "kf"], ["z"])], "fixed",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("k", TensorProto.INT64, [2, 3])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return cuvil.Pipeline.from_onnx(m).compile().save(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    demo = cuvil.Pipeline.from_onnx(demo_model_path()).optimize().compile(shape_profiles={"N": (1, 2, 8)}) \
        .save(str(d / "libdemo.so"))
    fixed = static_model(str(d / "libfixed.so"))
    port = free_port()
    opts = ServeOptions(port=port, threads=1, max_batch_size=8, batch_wait_s=0.02, max_body_bytes=MAX_BODY, quiet=True)
    url = serve_app.start([demo, fixed], opts, num_cpus=2)
    libs = {"demo": cuvil.load(demo, num_threads=1), "fixed": cuvil.load(fixed, num_threads=1)}
    try:
        yield {"url": url, "port": port, "libs": libs, "paths": {"demo": demo, "fixed": fixed}}
    finally:
        serve_app.stop()


def client(server):
    return th.InferenceServerClient(f"127.0.0.1:{server['port']}")


def request(server, path: str, body=None, headers=None, method=None):
    """(status, parsed JSON body, raw body) of one HTTP request."""
    req = urllib.request.Request(server["url"] + path, data=body, headers=headers or {},
                                 method=method or ("POST" if body is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    return status, json.loads(raw), raw


def image(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


def test_health_and_model_metadata_through_tritonclient(server):
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("demo") and c.is_model_ready("fixed")
    meta = c.get_model_metadata("demo")
    assert meta["platform"] == "cuvil_x86"
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 16, 16],
                               "parameters": {"dims": ["N", 3, 16, 16]}}]
    assert meta["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": [-1, 10],
                                "parameters": {"dims": ["N", 10]}}]
    assert meta["parameters"]["batch_symbol"] == "N" and meta["parameters"]["max_batch_rows"] == 8
    assert meta["parameters"]["symbols"] == {"N": {"min": 1, "opt": 2, "max": 8, "multiple": 1}}
    fixed = c.get_model_metadata("fixed")
    assert [(t["name"], t["datatype"], t["shape"]) for t in fixed["inputs"]] == [("x", "FP32", [2, 3]),
                                                                                 ("k", "INT64", [2, 3])]
    assert fixed["parameters"]["batch_symbol"] == ""
    assert c.get_server_metadata()["extensions"] == ["binary_tensor_data"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_the_library_in_process(server, binary):
    x = image(3, seed=1)
    inp = th.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    r = client(server).infer("demo", [inp], outputs=[th.InferRequestedOutput("probs", binary_data=binary)],
                             request_id="abc")
    want = server["libs"]["demo"].run({"image": x})["probs"]
    got = r.as_numpy("probs")
    assert got.dtype == np.float32 and got.shape == (3, 10)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert r.get_response()["id"] == "abc"
    status, answer, _ = request(server, "/v2/models/demo/infer", json.dumps(
        {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 3, 16, 16], "data": x[:1].ravel().tolist()}]}
    ).encode())
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 10]


def test_concurrent_requests_are_joined_and_split_back(server):
    from ray import serve
    stats = serve.get_deployment_handle("model-demo", app_name=serve_app.model_app_name("demo")).stats
    before = stats.remote().result()
    sizes = [1, 2, 1, 3, 1, 2, 1, 1, 2, 1, 3, 1]

    def one(k):
        x = image(sizes[k], seed=100 + k)
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        return x, client(server).infer("demo", [inp]).as_numpy("probs")
    with ThreadPoolExecutor(len(sizes)) as pool:
        results = list(pool.map(one, range(len(sizes))))
    lib = server["libs"]["demo"]
    for x, got in results:
        np.testing.assert_allclose(got, lib.run({"image": x})["probs"], rtol=1e-5, atol=1e-6)
    after = stats.remote().result()
    assert after["requests"] - before["requests"] == len(sizes)
    assert 1 <= after["calls"] - before["calls"] <= len(sizes)


def test_a_gpu_bundle_without_a_gpu_runs_its_x86_fallback_in_the_replica(server, tmp_path):
    """The model deployment's own code, outside Ray (this machine has no GPU): a bundle with a fallback loads the
    x86 library, says so in its metadata, and answers as that library does."""
    from cuvil.serve.deployment import ModelServer
    bundle = cuvil.Pipeline.from_onnx(demo_model_path()).optimize() \
        .compile("nvptx64-nvidia-cuda", shape_profiles={"N": (1, 2, 8)}).save(str(tmp_path / "gpudemo.cuvil"))
    replica = ModelServer(bundle, "gpudemo", threads=1, fallback=server["paths"]["demo"])
    meta = replica.describe()
    assert meta["name"] == "gpudemo" and meta["platform"] == "cuvil_x86" and "fallback" in meta["parameters"]
    assert meta["inputs"][0]["shape"] == [-1, 3, 16, 16]
    xs = [{"image": image(2, seed=5)}, {"image": image(1, seed=6)}]
    for x, got in zip(xs, replica.runner.run_batch(xs)):
        np.testing.assert_allclose(got["probs"], server["libs"]["demo"].run(x)["probs"], rtol=1e-6, atol=1e-7)
    with pytest.raises(cuvil.CuvilError, match="no CUDA driver|GPU"):
        ModelServer(bundle, "gpudemo")          # no fallback: the replica fails to start, Ray reports it


def test_a_library_without_a_batch_symbol_serves_each_request(server):
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    k = np.array([[1, -2, 3], [4, 5, -6]], np.int64)
    inputs = [th.InferInput("x", [2, 3], "FP32"), th.InferInput("k", [2, 3], "INT64")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(k, binary_data=False)
    got = client(server).infer("fixed", inputs).as_numpy("z")
    np.testing.assert_array_equal(got, server["libs"]["fixed"].run({"x": x, "k": k})["z"])
    np.testing.assert_array_equal(got, x + k)


def _infer_body(name="image", datatype="FP32", shape=(1, 3, 16, 16), **extra):
    n = int(np.prod(shape))
    return json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": list(shape),
                                   "data": [0] * n}], **extra}).encode()


@pytest.mark.parametrize("path,body,words", [
    ("/v2/models/nope/infer", _infer_body(), "unknown model 'nope'; this server serves 'demo', 'fixed'"),
    ("/v2/models/nope", None, "unknown model 'nope'"),
    ("/v2/models/demo/infer", b"{\"inputs\": [", "malformed JSON"),
    ("/v2/models/demo/infer", _infer_body(name="img"), "unknown input 'img'; the model's inputs are 'image'"),
    ("/v2/models/demo/infer", _infer_body(datatype="FP64"), "dtype is 11 (double), expected 1 (float)"),
    ("/v2/models/demo/infer", _infer_body(shape=(1, 3, 16)), "ndim is 3, expected 4"),
    ("/v2/models/demo/infer", _infer_body(shape=(1, 3, 16, 17)), "dim 3 is 17, expected 16"),
    ("/v2/models/demo/infer", _infer_body(shape=(9, 3, 16, 16)), "N = 9, outside the profile N in [1, 8]"),
    ("/v2/models/fixed/infer", _infer_body(name="x", shape=(2, 3)), "missing input(s) 'k'"),
    ("/v2/models/demo/infer", _infer_body(outputs=[{"name": "logits"}]), "unknown output(s) 'logits'"),
    ("/v2/models/demo/infer", b" " * (MAX_BODY + 1), f"over the limit of {MAX_BODY} bytes"),
])
def test_bad_requests_are_400s_with_a_message(server, path, body, words):
    status, answer, raw = request(server, path, body)
    assert status == 400, raw
    assert set(answer) == {"error"} and words in answer["error"], answer
    assert b"Traceback" not in raw


def test_unknown_routes_and_methods_answer_in_json_and_the_server_stays_ready(server):
    status, answer, _ = request(server, "/v1/models/demo:predict")
    assert status == 404 and "no such route" in answer["error"]
    status, answer, _ = request(server, "/v2/models/demo/infer", method="GET")
    assert status == 405 and "GET is not allowed" in answer["error"]
    assert request(server, "/v2/health/ready")[:2] == (200, {"ready": True})
    assert request(server, "/v2/models/demo/ready")[:2] == (200, {"name": "demo", "ready": True})


# -- the deployments' own code, in this process -----------------------------------------------------------------

class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class SilentHandle:
    """A deployment handle whose replica never answers (not up yet, or being restarted by Ray)."""
    ready = _Method(lambda: asyncio.Event().wait())


def _call(deployment, method, path, body=b"", headers=()):
    """(status, JSON body, headers) of ``deployment``'s answer to one request, as Serve would hand it over."""
    from cuvil.serve.deployment import Request      # starlette's, as Ray Serve hands it to a deployment
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": body, "more_body": False}
    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "root_path": "",
             "headers": [(b"content-length", str(len(body)).encode()), *headers], "scheme": "http",
             "server": ("127.0.0.1", 80)}
    resp = asyncio.run(deployment(Request(scope, receive)))
    return resp.status_code, json.loads(resp.body), resp.headers


def test_ready_is_false_while_a_replica_does_not_answer(monkeypatch):
    from cuvil.serve import deployment
    monkeypatch.setattr(deployment, "READY_TIMEOUT_S", 0.05)
    health = deployment.Health({"m": SilentHandle()})
    assert _call(health, "GET", "/v2/health/ready")[:2] == (503, {"ready": False})
    assert _call(health, "GET", "/v2/health/live")[:2] == (200, {"live": True})
    status, answer, _ = _call(health, "GET", "/v2/models/m/ready")     # its own app not routing: 503, says so
    assert status == 503 and "model 'm' is starting" in answer["error"]
    assert _call(health, "GET", "/v2/models/x")[:2] == (400, {"error": "unknown model 'x'; this server serves 'm'"})


def test_the_model_deployment_answers_http_itself_and_a_failing_model_is_a_500(server, monkeypatch):
    from cuvil.serve.deployment import ModelServer
    replica = ModelServer(server["paths"]["fixed"], "fixed", threads=1, max_body=1000)
    x = {"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}
    k = {"name": "k", "datatype": "INT64", "shape": [2, 3], "data": [1, 1, 1, 1, 1, 1]}
    body = json.dumps({"inputs": [x, k]}).encode()
    status, answer, headers = _call(replica, "POST", "/v2/models/fixed/infer", body)
    assert status == 200 and answer["outputs"][0]["data"] == [2, 3, 4, 5, 6, 7]
    assert headers["cuvil-replica"].endswith(f"/{os.getpid()}")
    assert _call(replica, "GET", "/v2/models/fixed")[1]["name"] == "fixed"
    assert _call(replica, "POST", "/v2/models/fixed/infer", b" " * 1001)[:2] == \
        (400, {"error": "request body of 1001 bytes is over the limit of 1000 bytes (cuvil serve --max-body-mb)"})

    def explode(*args, **kw):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(replica.model, "run", explode)
    status, answer, _ = _call(replica, "POST", "/v2/models/fixed/infer", body)
    assert (status, answer) == (500, {"error": "the model failed: RuntimeError: kernel exploded"})


# -- the command (last: it replaces the module's application, then stops Serve and Ray) ------------------------

def test_the_command_serves_until_interrupted(server, capsys, monkeypatch):
    from cuvil.cli import serve as cli_serve
    seen = {}

    class Waiting:
        """The command's wait for Ctrl-C: probe the served model, then press Ctrl-C."""

        @staticmethod
        def sleep(seconds):
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and "meta" not in seen:
                if request(server, "/v2/models/served/ready")[0] == 200:
                    seen["meta"] = request(server, "/v2/models/served")[1]
                else:
                    time.sleep(0.5)
            raise KeyboardInterrupt
    monkeypatch.setattr(cli_serve, "time", Waiting)
    rc = cli_main(["serve", server["paths"]["demo"], "--name", "served", "--port", str(server["port"]),
                   "-q"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"serving served at http://127.0.0.1:{server['port']}/v2/models/served" in out and "stopping" in out
    assert seen["meta"]["name"] == "served" and seen["meta"]["inputs"][0]["shape"] == [-1, 3, 16, 16]
    assert not ray.is_initialized()
