"""`multipy serve` over gRPC (checked with tritonclient.grpc and multipy's own messages):
health, metadata, every datatype, typed contents, errors as codes with the HTTP messages,
statistics counted once whatever the transport, and BYTES; on the shared server
``served`` (conftest.py), which serves gRPC too (--grpc-port 0).
"""
from __future__ import annotations

import json
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("ml_dtypes")  # tritonclient's BF16 arrays
from serving import (DATATYPES, TEXT, _as_bytes, _client_error, _grpc, _grpc_input,  # noqa: E402
                     _grpc_port, _input, _request, _unary, _values)


def test_grpc_health_and_metadata(served):
    client = _grpc(served)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("pair") and client.is_model_ready("pair", "1")
    status, message = _client_error(lambda: client.is_model_ready("nope"))
    assert status == "StatusCode.NOT_FOUND" and "unknown model 'nope'" in message
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "multipy"
    assert {"binary_tensor_data", "statistics"} <= set(metadata["extensions"])
    model = client.get_model_metadata("pair", as_json=True)
    http = served.client().get_model_metadata("pair")
    assert [i["name"] for i in model["inputs"]] == ["a", "b"]
    assert model["inputs"] == [{**i, "shape": [str(s) for s in i["shape"]]}
                               for i in http["inputs"]]  # int64 as JSON strings


@pytest.mark.parametrize("datatype", DATATYPES)
def test_grpc_every_datatype(served, datatype):
    import tritonclient.grpc as grpcclient

    x = _values(datatype)
    result = _grpc(served).infer("cast", [_grpc_input("x", x, datatype)], request_id="r-7",
                                 outputs=[grpcclient.InferRequestedOutput("same"),
                                          grpcclient.InferRequestedOutput("as_fp64")])
    response = result.get_response(as_json=True)
    assert response["id"] == "r-7" and response["model_name"] == "cast"
    assert [o["name"] for o in response["outputs"]] == ["same", "as_fp64"]
    same = result.as_numpy("same")
    assert same.dtype == x.dtype and np.array_equal(same, x)
    np.testing.assert_array_equal(result.as_numpy("as_fp64"), x.astype(np.float64))


def test_grpc_typed_contents_and_requested_outputs(served):
    """Inputs in typed contents (as KServe's client sends them) are read as raw ones are,
    and the outputs asked for are answered."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}") as channel:
        infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)
        tensor = messages.ModelInferRequest.InferInputTensor
        request = messages.ModelInferRequest(model_name="pair", inputs=[
            tensor(name="a", datatype="FP32", shape=[1, 3],
                   contents=messages.InferTensorContents(fp32_contents=[5, 6, 7])),
            tensor(name="b", datatype="FP32", shape=[1, 3],
                   contents=messages.InferTensorContents(fp32_contents=[1, 1, 2]))])
        answer = infer(request, timeout=60)
        assert [o.name for o in answer.outputs] == ["output0"]
        assert list(answer.outputs[0].shape) == [1, 3] and answer.outputs[0].datatype == "FP32"
        np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], "<f4"),
                                      [4, 5, 5])
        request.inputs[1].contents.Clear()
        request.inputs[1].contents.int64_contents.extend([1, 1, 2])
        with pytest.raises(grpc.RpcError) as wrong:
            infer(request, timeout=60)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wrong.value.details() == ("input 'b': FP32 values go in fp32_contents, not in "
                                         "int64_contents")


def test_grpc_errors_are_codes_with_the_http_messages(served):
    """The same mistakes give the same messages over both transports, as gRPC codes."""
    client, http = _grpc(served), served.client()
    x = np.ones((1, 3), np.float32)
    cases = [  # (model, inputs, HTTP status, gRPC code)
        ("nope", [("x", x, "FP32")], "404", "StatusCode.NOT_FOUND"),
        ("fails", [("x", -x, "FP32")], "500", "StatusCode.INTERNAL"),
        ("pair", [("a", x, "FP32"), ("a", x, "FP32")], "400", "StatusCode.INVALID_ARGUMENT"),
    ]
    for model, inputs, http_status, code in cases:
        over_http = _client_error(lambda: http.infer(
            model, [_input(name, array, datatype, True) for name, array, datatype in inputs]))
        over_grpc = _client_error(lambda: client.infer(
            model, [_grpc_input(name, array, datatype) for name, array, datatype in inputs]))
        assert over_http[0] == http_status and over_grpc[0] == code, (over_http, over_grpc)
        assert over_grpc[1] == over_http[1], (over_grpc, over_http)
    assert client.is_server_ready()  # and it serves on


def test_statistics_count_both_transports_in_one_place(served):
    """Triton's statistics extension, over HTTP and gRPC alike: each request, whichever
    carried it, counts once, with its nanoseconds."""
    http, client = served.client(), _grpc(served)

    def stats() -> dict:
        over_http = http.get_inference_statistics("pair")["model_stats"]
        over_grpc = client.get_inference_statistics("pair", as_json=True)["model_stats"]
        assert len(over_http) == len(over_grpc) == 1
        for part in ("success", "fail"):  # (gRPC's JSON: uint64 as strings, 0 left out)
            assert int(over_grpc[0]["inference_stats"][part].get("count", 0)) == \
                over_http[0]["inference_stats"][part]["count"]
        return over_http[0]

    before = stats()
    x = np.ones((1, 3), np.float32)
    for _ in range(3):
        http.infer("pair", [_input("a", x, "FP32", True), _input("b", x, "FP32", True)])
        client.infer("pair", [_grpc_input("a", x, "FP32"), _grpc_input("b", x, "FP32")])
    _client_error(lambda: http.infer("pair", [_input("a", x, "FP32", True)]))  # a missing input
    after = stats()
    counts = lambda s, part: s["inference_stats"][part].get("count", 0)  # noqa: E731
    nanos = lambda s, part: int(s["inference_stats"][part].get("ns", 0))  # noqa: E731
    assert after["name"] == "pair" and after["version"] == "1"
    assert counts(after, "success") == counts(before, "success") + 6
    assert counts(after, "fail") == counts(before, "fail") + 1
    for part in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert nanos(after, part) > nanos(before, part), part
    assert nanos(after, "success") - nanos(before, "success") >= sum(
        nanos(after, part) - nanos(before, part)
        for part in ("compute_input", "compute_infer", "compute_output"))
    assert after["execution_count"] >= before.get("execution_count", 0) + 6
    assert int(after["last_inference"]) > time.time() * 1000 - 60_000
    every = http.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in every} == {"python_heavy", "cast", "pair", "fails", "slow",
                                          "exits", "blocks", "text"}
    status, _, body = _request(served, "GET", "/v2/models/nope/stats")
    assert status == 404 and "unknown model 'nope'" in json.loads(body)["error"]
    assert _client_error(lambda: client.get_inference_statistics("nope"))[0] == \
        "StatusCode.NOT_FOUND"


def test_grpc_bytes_raw_and_typed(served):
    """BYTES over gRPC: tritonclient's raw (length-prefixed) contents, and bytes_contents;
    any bytes, UTF-8 or not, go both ways."""
    import grpc

    from multipy.serve.rpc import inference_pb2 as messages

    result = _grpc(served).infer("text", [_grpc_input("text", TEXT, "BYTES")])
    assert _as_bytes(result.as_numpy("upper")) == [b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
    np.testing.assert_array_equal(result.as_numpy("lengths"), [[5, 6], [0, 3]])
    assert _as_bytes(result.as_numpy("same")) == list(TEXT.reshape(-1))
    with grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}") as channel:
        infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)
        request = messages.ModelInferRequest(model_name="text", inputs=[
            messages.ModelInferRequest.InferInputTensor(
                name="text", datatype="BYTES", shape=[3],
                contents=messages.InferTensorContents(bytes_contents=[b"ab", b"\xff\x00", b""]))])
        answer = infer(request, timeout=60)
    raw = dict(zip((o.name for o in answer.outputs), answer.raw_output_contents))
    assert raw["same"] == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xff\x00\x00\x00\x00\x00"
    np.testing.assert_array_equal(np.frombuffer(raw["lengths"], "<i8"), [2, 2, 0])
