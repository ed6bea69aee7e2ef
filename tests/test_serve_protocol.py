"""cuvil.serve's pure layers, without Ray (issue 26): the Open Inference Protocol's routes, request parsing (JSON
tensors and the binary-data extension) and response encoding, the model metadata, and dynamic batching (the
batch symbol; requests joined and split back on a real compiled library). Also `cuvil serve`'s refusals that
come before Ray starts."""
from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.cli import main as cli_main
from cuvil.serve import protocol
from cuvil.serve.batching import BatchRunner, Failure, batch_symbol
from cuvil.serve.protocol import OIPError, parse_infer_request, encode_infer_response
from cuvil.targets.model_api import tensor_spec


# -- routes ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,kind,model,ok", [
    ("GET", "/v2", "server_metadata", None, True),
    ("GET", "/v2/health/live", "live", None, True),
    ("GET", "/v2/health/ready/", "ready", None, True),
    ("GET", "/v2/models/demo", "model_metadata", "demo", True),
    ("GET", "/v2/models/demo/versions/1", "model_metadata", "demo", True),
    ("GET", "/v2/models/demo/ready", "model_ready", "demo", True),
    ("POST", "/v2/models/demo/infer", "infer", "demo", True),
    ("POST", "/v2/models/demo/versions/1/infer", "infer", "demo", True),
    ("GET", "/v2/models/demo/infer", "infer", "demo", False),
    ("POST", "/v2/health/live", "live", None, False),
    ("GET", "/v1/models/demo:predict", None, None, True),
    ("GET", "/v2/models/demo/explain", None, None, True),
])
def test_routes(method, path, kind, model, ok):
    r = protocol.route(method, path)
    assert (r.kind, r.model) == (kind, model)
    if kind is not None:
        assert r.method_ok is ok


# -- requests --------------------------------------------------------------------------------------------------

def _req(inputs, **extra):
    return json.dumps(dict(inputs=inputs, **extra)).encode()


def test_json_tensors_flat_or_nested_with_their_datatype_and_shape():
    body = _req([{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]},
                 {"name": "ids", "datatype": "INT64", "shape": [2, 2], "data": [[1, 2], [3, -4]]},
                 {"name": "m", "datatype": "BOOL", "shape": [2], "data": [True, False]}], id="r1")
    req = parse_infer_request(body)
    assert req.id == "r1" and req.outputs is None and not req.binary_default
    np.testing.assert_array_equal(req.inputs["x"], np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    assert req.inputs["x"].dtype == np.float32
    np.testing.assert_array_equal(req.inputs["ids"], np.array([[1, 2], [3, -4]], np.int64))
    assert req.inputs["ids"].dtype == np.int64 and req.inputs["m"].dtype == np.bool_


def test_binary_data_extension_round_trip():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ids = np.array([7, 8], np.int64)
    head = _req([{"name": "x", "datatype": "FP32", "shape": [3, 4], "parameters": {"binary_data_size": x.nbytes}},
                 {"name": "ids", "datatype": "INT64", "shape": [2], "data": [7, 8]}],
                outputs=[{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}])
    req = parse_infer_request(head + x.tobytes(), str(len(head)))
    np.testing.assert_array_equal(req.inputs["x"], x)
    np.testing.assert_array_equal(req.inputs["ids"], ids)
    assert req.outputs == ("y", "z") and req.binary == {"y"}
    y, z = np.full((3, 4), 0.5, np.float32), np.array([1, 2], np.int64)
    body, headers = encode_infer_response("m", {"y": y, "z": z, "unasked": z}, req, ["y", "z", "unasked"])
    n = int(headers[protocol.HEADER_LENGTH])
    assert headers["content-type"] == "application/octet-stream"
    meta = json.loads(body[:n])
    assert [o["name"] for o in meta["outputs"]] == ["y", "z"]
    assert meta["outputs"][0] == {"name": "y", "datatype": "FP32", "shape": [3, 4],
                                  "parameters": {"binary_data_size": y.nbytes}}
    assert meta["outputs"][1]["data"] == [1, 2] and meta["outputs"][1]["datatype"] == "INT64"
    np.testing.assert_array_equal(np.frombuffer(body[n:], np.float32).reshape(3, 4), y)


def test_binary_data_output_sends_every_output_as_binary_and_json_otherwise():
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}
    outs = {"a": np.array([1.5], np.float32), "b": np.array([[2]], np.int32)}
    req = parse_infer_request(_req([x], parameters={"binary_data_output": True}, id="7"))
    body, headers = encode_infer_response("m", outs, req, ["a", "b"])
    n = int(headers[protocol.HEADER_LENGTH])
    head = json.loads(body[:n])
    assert head["id"] == "7" and all("data" not in o for o in head["outputs"]) and len(body) == n + 4 + 4
    body, headers = encode_infer_response("m", outs, parse_infer_request(_req([x])), ["a", "b"])
    assert headers == {"content-type": "application/json"}
    assert json.loads(body)["outputs"] == [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.5]},
                                           {"name": "b", "datatype": "INT32", "shape": [1, 1], "data": [2]}]


def test_an_unknown_output_is_a_400_naming_the_outputs():
    req = parse_infer_request(_req([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
                                   outputs=[{"name": "nope"}]))
    with pytest.raises(OIPError) as e:
        encode_infer_response("m", {"y": np.zeros(1, np.float32)}, req, ["y"])
    assert e.value.status == 400 and "'nope'" in e.value.message and "'y'" in e.value.message


X = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}


@pytest.mark.parametrize("body,header,words", [
    (b"{not json", None, "malformed JSON"),
    (b"[1, 2]", None, "not a JSON object"),
    (_req([]), None, "no inputs"),
    (json.dumps({"inputs": 3}).encode(), None, "'inputs' is int"),
    (_req([{"datatype": "FP32", "shape": [1], "data": [1]}]), None, "has no 'name'"),
    (_req([dict(X, datatype="FP8")]), None, "datatype 'FP8' is not supported"),
    (_req([dict(X, shape=[2, -1])]), None, "non-negative integers"),
    (_req([dict(X, data=[1, 2, 3])]), None, "has 3 values, shape [2] needs 2"),
    (_req([dict(X, data=[[1, 2], [3]])]), None, "not a rectangular list"),
    (_req([dict(X, data=["a", "b"])]), None, "holds strings"),
    (_req([dict(X, datatype="INT64", data=[1.5, 2])]), None, "holds floats, not int64"),
    (_req([dict(X, datatype="INT8", data=[1, 300])]), None, "outside the range of int8"),
    (_req([dict(X, data="12")]), None, "'data' must be a list"),
    (_req([X, X]), None, "given twice"),
    (_req([{"name": "x", "datatype": "FP32", "shape": [2]}]), None, "neither 'data' nor"),
    (_req([X], id=5), None, "'id' is int"),
    (_req([X]), "12x", "not a number"),
    (_req([X]), "100000", "does not fit a body"),
])
def test_malformed_requests_are_400s_that_say_what(body, header, words):
    with pytest.raises(OIPError) as e:
        parse_infer_request(body, header)
    assert e.value.status == 400 and words in e.value.message, e.value.message


def test_binary_sizes_that_do_not_add_up_are_400s():
    spec = {"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}
    head = _req([spec])
    for tail, words in ((b"\0" * 4, "8 bytes of binary data expected"), (b"\0" * 12, "4 bytes of binary data after")):
        with pytest.raises(OIPError, match=words):
            parse_infer_request(head + tail, str(len(head)))
    bad = _req([dict(spec, parameters={"binary_data_size": 6})])
    with pytest.raises(OIPError, match="does not match float32"):
        parse_infer_request(bad + b"\0" * 6, str(len(bad)))


def test_a_body_over_the_limit_is_a_400():
    with pytest.raises(OIPError, match="over the limit of 100 bytes") as e:
        parse_infer_request(b" " * 101, max_body=100)
    assert e.value.status == 400


# -- metadata --------------------------------------------------------------------------------------------------

def test_model_metadata_has_datatypes_and_minus_one_for_symbols():
    meta = protocol.model_metadata("m", [tensor_spec("x", TensorProto.FLOAT, ["N", 3, 224, 224]),
                                         tensor_spec("ids", TensorProto.INT64, [1, None])],
                                   [tensor_spec("y", TensorProto.FLOAT16, ["N", 1000])], "cuvil_x86")
    assert meta == {"name": "m", "versions": ["1"], "platform": "cuvil_x86",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 224, 224],
                                "parameters": {"dims": ["N", 3, 224, 224]}},
                               {"name": "ids", "datatype": "INT64", "shape": [1, -1], "parameters": {"dims": [1, None]}}],
                    "outputs": [{"name": "y", "datatype": "FP16", "shape": [-1, 1000],
                                 "parameters": {"dims": ["N", 1000]}}]}


def test_batch_symbol_is_the_leading_symbol_of_every_input_and_output():
    s = tensor_spec
    f = TensorProto.FLOAT
    assert batch_symbol([s("x", f, ["N", 3]), s("m", f, ["N", "S"])], [s("y", f, ["N", "S"])]) == "N"
    assert batch_symbol([s("x", f, [2, 3])], [s("y", f, [2, 3])]) is None                 # static
    assert batch_symbol([s("x", f, ["N", 3]), s("m", f, ["B", 3])], [s("y", f, ["N"])]) is None   # two symbols
    assert batch_symbol([s("x", f, ["N", "N"])], [s("y", f, ["N"])]) is None                # N not only leading
    assert batch_symbol([s("x", f, ["N", 3])], [s("y", f, [1, "N"])]) is None              # output not by rows
    assert batch_symbol([s("x", f, [])], [s("y", f, [])]) is None                           # scalars


# -- batching on a real library --------------------------------------------------------------------------------

def _model(tmp, name, shape, symbols=None):
    """y = relu(x) * 2 + rowsum(x) (rows mix nothing across the batch dim), x: float[shape]."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "r"], ["r2"]),
             helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
             helper.make_node("Add", ["r2", "s"], ["y"])]
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                          [helper.make_tensor("axes", TensorProto.INT64, [1], [len(shape) - 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = cuvil.Pipeline.from_onnx(m).compile(shape_profiles=symbols) if symbols else cuvil.Pipeline.from_onnx(m).compile()
    return cuvil.load(art.save(str(tmp / f"lib{name}.so")), num_threads=1)


@pytest.fixture(scope="module")
def rows_model(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("serve"), "rows", ["N", "S"], {"N": (1, 4, 16), "S": (1, 4, 16)})


def _req_x(rng, n, s, dtype=np.float32):
    return {"x": rng.standard_normal((n, s)).astype(dtype)}


def test_requests_join_along_the_batch_dim_and_split_back(rows_model):
    runner = BatchRunner(rows_model, max_rows=8)
    assert runner.symbol == "N" and runner.max_rows == 8
    rng = np.random.default_rng(0)
    reqs = [_req_x(rng, 1, 4), _req_x(rng, 3, 4), _req_x(rng, 2, 5), _req_x(rng, 1, 4),
            _req_x(rng, 1, 4, np.float64), {"x": rng.standard_normal((2, 4)).astype(np.float32), "bad": 1},
            _req_x(rng, 2, 5)]
    out = runner.run_batch(reqs)
    # S=4 (rows 1+3+1) in one call, S=5 (2+2) in another; the float64 and the unknown input are refused
    assert runner.calls == 2 and runner.requests == len(reqs)
    for k in (0, 1, 2, 3, 6):
        want = rows_model.run(reqs[k])
        assert out[k]["y"].shape == want["y"].shape
        np.testing.assert_array_equal(out[k]["y"], want["y"])
    assert isinstance(out[4], Failure) and out[4].status == 400 and "dtype" in out[4].message
    assert isinstance(out[5], Failure) and out[5].status == 400 and "unknown input 'bad'" in out[5].message


def test_a_call_holds_at_most_max_rows_and_the_profile(rows_model):
    rng = np.random.default_rng(1)
    runner = BatchRunner(rows_model, max_rows=4)
    reqs = [_req_x(rng, 3, 4), _req_x(rng, 2, 4), _req_x(rng, 2, 4)]
    out = runner.run_batch(reqs)
    assert runner.calls == 2        # 3 | 2+2
    for r, o in zip(reqs, out):
        np.testing.assert_array_equal(o["y"], rows_model.run(r)["y"])
    assert BatchRunner(rows_model, max_rows=1000).max_rows == 16       # the profile's max
    big = BatchRunner(rows_model).run_batch([_req_x(rng, 17, 4)])[0]
    assert isinstance(big, Failure) and big.status == 400 and "outside the profile" in big.message


def test_a_library_without_a_batch_symbol_runs_one_request_per_call(tmp_path):
    m = _model(tmp_path, "fixed", [2, 3])
    runner = BatchRunner(m, max_rows=8)
    assert runner.symbol is None and runner.max_rows == 1
    rng = np.random.default_rng(2)
    reqs = [_req_x(rng, 2, 3) for _ in range(3)]
    out = runner.run_batch(reqs)
    assert runner.calls == 3
    for r, o in zip(reqs, out):
        np.testing.assert_array_equal(o["y"], m.run(r)["y"])
    bad = runner.run_batch([_req_x(rng, 3, 3)])[0]
    assert bad.status == 400 and "dim 0 is 3, expected 2" in bad.message


def test_a_failing_model_is_a_500_for_the_requests_of_its_call(rows_model):
    class Broken:
        """The rows model whose library fails after its checks pass."""
        inputs, outputs, symbols, signature = (rows_model.inputs, rows_model.outputs, rows_model.symbols,
                                               rows_model.signature)

        def run(self, feeds):
            raise RuntimeError("kernel exploded")
    runner = BatchRunner(Broken(), max_rows=8)
    rng = np.random.default_rng(3)
    out = runner.run_batch([_req_x(rng, 1, 4), _req_x(rng, 1, 4), _req_x(rng, 1, 4, np.int32)])
    assert [o.status for o in out] == [500, 500, 400]
    assert "the model failed: RuntimeError: kernel exploded" in out[0].message


# -- the command line, before Ray ------------------------------------------------------------------------------

def test_serve_without_ray_says_what_to_install(rows_model, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert cli_main(["serve", rows_model.path]) == 2
    err = capsys.readouterr().err
    assert "serving needs Ray Serve" in err and "next: pip install 'cuvil[serve]'" in err


@pytest.mark.parametrize("argv,words", [
    (["--autoscale", "3"], "expected MIN:MAX"),
    (["--autoscale", "4:2"], "MIN <= MAX"),
    (["--replicas", "0"], "at least 1"),
    (["--max-batch-size", "0"], "must be positive"),
    (["--port", "70000"], "not a TCP port"),
    (["--name", "a", "--name", "b"], "2 --name for 1 artifacts"),
])
def test_serve_refuses_bad_options_before_starting_anything(rows_model, argv, words, capsys):
    assert cli_main(["serve", rows_model.path, *argv]) == 2
    assert words in capsys.readouterr().err


def test_models_are_named_after_their_artifacts():
    from cuvil.serve.app import model_names
    assert model_names(["build/libresnet.so", "out/yolo.cuvil", "x/lib.so", "a/model.so"]) == \
        ["resnet", "yolo", "lib", "model"]
    with pytest.raises(cuvil.CuvilError, match="both be served as 'm'"):
        model_names(["a/libm.so", "b/libm.so"])
    assert model_names(["a/libm.so", "b/libm.so"], ["m1", "m2"]) == ["m1", "m2"]


def test_a_gpu_bundle_gets_one_gpu_per_replica_and_one_replica_per_gpu(tmp_path):
    """(The options only: Ray is not needed to compute them.)"""
    from cuvil.serve.app import ServeOptions, model_deployment_options
    bundle, lib = str(tmp_path / "m.cuvil"), str(tmp_path / "libm.so")
    o = model_deployment_options(bundle, "m", ServeOptions(threads=2), gpus=4)
    assert o["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1} and o["num_replicas"] == 4
    assert o["name"] == "model-m"
    assert model_deployment_options(bundle, "m", ServeOptions(replicas=2), gpus=4)["num_replicas"] == 2
    o = model_deployment_options(bundle, "m", ServeOptions(), gpus=0)      # no GPU: the fallback runs on CPUs
    assert o["ray_actor_options"] == {"num_cpus": 0.0} and o["num_replicas"] == 1
    o = model_deployment_options(lib, "m", ServeOptions(autoscale=(1, 3)), gpus=4)
    assert "num_gpus" not in o["ray_actor_options"] and "num_replicas" not in o
    assert o["autoscaling_config"]["min_replicas"] == 1 and o["autoscaling_config"]["max_replicas"] == 3


def test_a_fallback_must_be_an_x86_library(rows_model, tmp_path, capsys):
    (tmp_path / "m.cuvil").mkdir()
    assert cli_main(["serve", str(tmp_path / "m.cuvil"), "--fallback", str(tmp_path / "m.cuvil")]) == 2
    assert "not an x86 library" in capsys.readouterr().err
    assert cli_main(["serve", rows_model.path, "--fallback", rows_model.path]) == 2
    assert "1 --fallback for 0 GPU bundle(s)" in capsys.readouterr().err


def test_an_address_nothing_answers_on_is_refused_at_once():
    from cuvil.serve.app import check_reachable
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # bound, not listening: the connection is refused
        with pytest.raises(cuvil.CuvilError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
            check_reachable(f"127.0.0.1:{port}")
    check_reachable("auto")                 # left to Ray


def test_the_front_end_settings_for_a_local_ray_instance(monkeypatch):
    """`cuvil serve --front`: HAProxy (Serve's HAProxy mode: RAY_SERVE_ENABLE_HA_PROXY and the binary's path) when
    asked or, for auto, when a haproxy binary is found; Serve's proxy otherwise; a clear error for haproxy without
    the binary and for an unknown front end. A cluster (--address) and a setting already in the environment are
    left as they are."""
    from cuvil.errors import CuvilError
    from cuvil.serve.app import apply_front, front_env
    found = lambda name: f"/opt/bin/{name}"        # noqa: E731
    missing = lambda name: None                     # noqa: E731
    assert front_env("auto", which=found) == {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                                              "RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/bin/haproxy",
                                              "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    assert front_env("haproxy", which=found)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert front_env("auto", which=missing) == {}
    assert front_env("proxy", which=found) == {}
    with pytest.raises(CuvilError, match="no haproxy binary") as e:
        front_env("haproxy", which=missing)
    assert "apt-get install haproxy" in e.value.hint
    with pytest.raises(CuvilError, match="unknown front end"):
        front_env("nginx", which=found)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    assert apply_front("proxy") == {} and "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
    assert apply_front("haproxy", address="10.0.0.1:6379") == {}
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    monkeypatch.setattr("shutil.which", found)
    apply_front("haproxy")
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"      # the user's own setting wins


def test_a_failed_local_ray_start_leaves_no_processes_behind():
    """`cuvil serve` retries a local Ray that did not come up in Ray's fixed 30 s; a failed attempt's half-started
    node (GCS, raylet, monitors: its children and theirs) is ended before the next, and only what the attempt
    started: a child started before it runs on."""
    import subprocess
    import time
    from cuvil.serve.app import child_pids, end_new_children
    old = subprocess.Popen(["sleep", "60"])
    try:
        before = child_pids()
        assert old.pid in before
        new = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        grandchild = int(new.stdout.readline())
        ended = end_new_children(before)
        assert new.pid in ended and grandchild in ended and old.pid not in ended
        assert not os.path.exists(f"/proc/{new.pid}")       # killed and reaped (no zombie left either)
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
            with open(f"/proc/{grandchild}/stat") as f:     # a zombie until init reaps it
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            assert not os.path.exists(f"/proc/{grandchild}")
        assert old.poll() is None
    finally:
        old.kill()
        old.wait()


def test_a_library_without_its_manifest_is_served_with_a_warning(tmp_path):
    """Only the manifest names a library's symbolic dims: without it the library loads, finds no batch symbol and
    is served one request per call; `cuvil serve` says so before starting, and is silent when the manifest is there."""
    import warnings
    from cuvil.serve.app import check_artifacts
    lib = tmp_path / "libnet.so"
    lib.write_bytes(b"\x7fELF")      # check_artifacts only looks at the path; nothing is loaded
    with pytest.warns(UserWarning, match=r"libnet.manifest.json.*one request per call.*copy the manifest"):
        check_artifacts([str(lib)])
    (tmp_path / "libnet.manifest.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_artifacts([str(lib)])
