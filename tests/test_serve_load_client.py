"""``cuvil bench --url``'s client (:mod:`cuvil.bench_http`) without a server: URLs, the sizes it picks from a
model's metadata, its binary-data requests and answers checked against tritonclient's own encoder and decoder,
and the usage errors of the command. The load against a live server is in tests/test_serve_load.py."""
import json

import numpy as np
import pytest

from cuvil.bench_http import HEADER_LENGTH, decode_response, encode_request, input_shapes, split_url
from cuvil.cli import main as cli_main
from cuvil.errors import CuvilError

META = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3, -1],
                                 "parameters": {"dims": ["N", 3, "W"]}},
                                {"name": "ids", "datatype": "INT64", "shape": [-1, 5], "parameters": {"dims": ["N", 5]}}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}],
        "parameters": {"symbols": {"N": {"min": 1, "opt": 4, "max": 16}, "W": {"min": 8, "opt": 32, "max": 64}}}}


@pytest.mark.parametrize("url,want", [
    ("http://127.0.0.1:8000/v2/models/demo", ("http://127.0.0.1:8000", "/v2/models/demo")),
    ("http://h:1/v2/models/demo/infer", ("http://h:1", "/v2/models/demo")),
    ("http://h:1/v2/models/demo/versions/2/infer", ("http://h:1", "/v2/models/demo/versions/2")),
    ("https://h/v2/models/a/", ("https://h", "/v2/models/a")),
])
def test_split_url(url, want):
    assert split_url(url) == want


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v2/models/x", "http://h:1/v1/models/x", "http://h:1/v2/models",
                                 "ftp://h/v2/models/x"])
def test_a_url_that_is_not_a_model_is_refused_with_the_form_to_give(url):
    with pytest.raises(CuvilError) as e:
        split_url(url)
    assert "http://HOST:PORT/v2/models/NAME" in e.value.hint


def test_sizes_come_from_the_profile_opt_then_the_flags():
    assert input_shapes(META, {}, {}) == [(4, 3, 32), (4, 5)]
    assert input_shapes(META, {"N": 2}, {}) == [(2, 3, 32), (2, 5)]
    assert input_shapes(META, {"N": 2}, {"x": (2, 3, 9)}) == [(2, 3, 9), (2, 5)]
    with pytest.raises(CuvilError, match=r"does not fit the model's input x") as e:
        input_shapes(META, {}, {"x": (2, 4, 9)})
    assert e.value.hint == "--input-shape x=2x3x9"
    with pytest.raises(CuvilError, match="no input 'z'"):
        input_shapes(META, {}, {"z": (1,)})
    with pytest.raises(CuvilError, match="no symbol 'Q'"):
        input_shapes(META, {"Q": 1}, {})


def test_a_dynamic_dim_without_a_published_size_asks_for_the_shape():
    bare = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}], "outputs": []}
    with pytest.raises(CuvilError, match="dynamic dim 0") as e:
        input_shapes(bare, {}, {})
    assert e.value.hint == "--input-shape x=Dx3"
    assert input_shapes(bare, {}, {"x": (7, 3)}) == [(7, 3)]


def test_binary_request_is_what_tritonclient_sends():
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is the reference encoder")
    from tritonclient.http._utils import _get_inference_request
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ids = np.array([[1, 2, 3]], np.int64)
    body, headers = encode_request(["x", "ids"], [x, ids], ["y"], binary=True)
    tx = httpclient.InferInput("x", list(x.shape), "FP32")
    tx.set_data_from_numpy(x, binary_data=True)
    ti = httpclient.InferInput("ids", list(ids.shape), "INT64")
    ti.set_data_from_numpy(ids, binary_data=True)
    ref, ref_json_size = _get_inference_request([tx, ti], "", [httpclient.InferRequestedOutput("y", binary_data=True)],
                                                0, False, False, 0, None, None)
    n = int(headers[HEADER_LENGTH])
    assert json.loads(body[:n]) == json.loads(ref[:ref_json_size])
    assert body[n:] == ref[ref_json_size:] == x.tobytes() + ids.tobytes()
    assert headers["Content-Type"] == "application/octet-stream"


def test_json_request_carries_the_data_inline():
    body, headers = encode_request(["x"], [np.array([[1.5, 2.0]], np.float32)], ["y"], binary=False)
    assert HEADER_LENGTH not in headers
    req = json.loads(body)
    assert req["inputs"] == [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2.0]}]
    assert req["outputs"] == [{"name": "y", "parameters": {"binary_data": False}}]


def test_answers_decode_as_tritonclient_decodes_them():
    httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is the reference decoder")
    y = np.linspace(-1, 1, 20, dtype=np.float32).reshape(2, 10)
    k = np.array([3, 7], np.int64)
    head = json.dumps({"model_name": "m", "outputs": [
        {"name": "y", "datatype": "FP32", "shape": [2, 10], "parameters": {"binary_data_size": y.nbytes}},
        {"name": "k", "datatype": "INT64", "shape": [2], "data": [3, 7]}]}).encode()
    body = head + y.tobytes()
    got = decode_response(body, {HEADER_LENGTH: str(len(head))})
    ref = httpclient.InferResult.from_response_body(body, header_length=len(head))
    for name in ("y", "k"):
        np.testing.assert_array_equal(got[name], ref.as_numpy(name))
    np.testing.assert_array_equal(got["y"], y)
    assert got["k"].dtype == np.int64
    with pytest.raises(ValueError, match="do not fit"):
        decode_response(head + y.tobytes()[:-4], {HEADER_LENGTH: str(len(head))})


@pytest.mark.parametrize("argv,needle", [
    (["bench", "m.onnx", "--url", "http://127.0.0.1:9/v2/models/x"], "not both"),
    (["bench", "--url", "http://127.0.0.1:9/v2/models/x", "--vs", "onnxruntime"], "--vs does not apply with --url"),
    (["bench", "--url", "http://127.0.0.1:9/v2/models/x", "--cold-runs", "2"], "--cold-runs does not apply"),
    (["bench", "--url", "http://127.0.0.1:9/v2/models/x", "--sla", "cold_start_ms=5"], "cannot be measured with --url"),
    (["bench", "--url", "http://127.0.0.1:9/v1/x"], "not an Open Inference Protocol model URL"),
    # nothing listens on port 9 (discard) of the loopback: the error says to start the server
    (["bench", "--url", "http://127.0.0.1:9/v2/models/x", "--runs", "1"], "start the server first"),
])
def test_usage_errors_name_the_next_step(argv, needle, capsys):
    assert cli_main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert needle in err and "next: " in err and "Traceback" not in err


def test_no_model_and_no_url_is_argparse_s_missing_model(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench"])
    assert e.value.code == 2
    assert "the following arguments are required: MODEL (or --url URL)" in capsys.readouterr().err
