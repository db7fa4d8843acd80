"""`multipy serve` over HTTP (the Open Inference Protocol, checked with tritonclient.http):
health, metadata, inference of every datatype in JSON and binary data, inputs by name or
position, requested outputs, compression, and BYTES (text) both ways; on the shared server
``served`` (conftest.py), and in the session's interpreters for what crosses into them.
"""
from __future__ import annotations

import gzip
import json
import threading

import pytest

from conftest import until

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("ml_dtypes")  # tritonclient's BF16 arrays
from tritonclient.utils import InferenceServerException  # noqa: E402
from serving import (DATATYPES, TEXT, _as_bytes, _eager, _infer_json, _input, _metrics,  # noqa: E402
                     _request, _values)


def test_a_websocket_upgrade_is_answered_over_http(served):
    """multipy serve speaks no WebSocket (the host and the front ends do not import
    it): a request asking to upgrade is answered as any other, and the log says so."""
    status, _, body = _request(served, "GET", "/v2/health/live", headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert status == 200 and body == b""
    until(lambda: "speaks no WebSocket" in served.output())


def test_health_and_server_metadata(served):
    client = served.client()
    assert client.is_server_live() and client.is_server_ready()
    for model in ("python_heavy", "cast", "pair", "fails", "slow"):
        assert client.is_model_ready(model)
        assert client.is_model_ready(model, "1")
    assert not client.is_model_ready("nope")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "multipy" and "binary_tensor_data" in metadata["extensions"]
    status, _, body = _request(served, "GET", "/v2/models/nope/ready")
    assert status == 404 and "nope" in json.loads(body)["error"]
    assert _request(served, "GET", "/v2/health/live")[:3:2] == (200, b"")


def test_requests_are_checked_against_declared_inputs(served):
    """python_heavy declares x, FP32, [-1, -1, 16] (its config.json): an input of another
    name, datatype or shape, or none, is a 400 saying which and what was expected, before
    the model runs; a model that declares nothing (cast) takes any input as before."""
    def infer(model: str, inputs: list[dict]) -> tuple[int, dict]:
        return _infer_json(served, model, {"inputs": inputs})

    x = {"name": "x", "datatype": "FP32", "shape": [1, 1, 16], "data": list(range(16))}
    status, answer = infer("python_heavy", [x])
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 16], answer
    cases = [
        ([{**x, "shape": [16]}],
         "model 'python_heavy': input 'x' has shape [16], not [-1, -1, 16] (-1: any size)"),
        ([{**x, "shape": [1, 2, 8]}],
         "model 'python_heavy': input 'x' has shape [1, 2, 8], not [-1, -1, 16] (-1: any size)"),
        ([{**x, "datatype": "FP64"}], "model 'python_heavy': input 'x' is FP64, not FP32"),
        ([{**x, "name": "y"}], "model 'python_heavy' has no input 'y'; its inputs are 'x'"),
    ]
    before = _metrics(served)[("multipy_model_calls_total", (("model", "python_heavy"),))]
    for inputs, message in cases:
        assert infer("python_heavy", inputs) == (400, {"error": message}), inputs
    after = _metrics(served)[("multipy_model_calls_total", (("model", "python_heavy"),))]
    assert after == before  # none reached the model
    status, answer = infer("cast", [{**x, "name": "anything", "shape": [16]}])
    assert status == 200 and answer["outputs"][0]["shape"] == [16]


def test_model_metadata_names_inputs_after_forward(served):
    client = served.client()
    heavy = client.get_model_metadata("python_heavy")
    assert heavy["name"] == "python_heavy" and heavy["versions"] == ["1"]
    assert heavy["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 16]}]
    assert heavy["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 16]}]
    pair = client.get_model_metadata("pair", "1")
    assert [(i["name"], i["datatype"], i["shape"]) for i in pair["inputs"]] == \
        [("a", "FP32", [-1, 3]), ("b", "FP32", [-1, 3])]
    cast = client.get_model_metadata("cast")  # no example in the archive
    assert cast["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("nope")
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException) as version:
        client.get_model_metadata("pair", "7")
    assert version.value.status() == "404"


def test_concurrent_inferences_match_eager(served, packages):
    model = _eager(packages["python_heavy"])
    errors, checked = [], []

    def client_thread(index: int) -> None:
        try:
            client = served.client()
            generator = np.random.default_rng(index)
            for request in range(4):
                x = generator.standard_normal((1 + (index + request) % 3, 48, 16), np.float32)
                binary = (index + request) % 2 == 0
                result = client.infer("python_heavy", [_input("x", x, "FP32", binary)],
                                      outputs=[httpclient.InferRequestedOutput("output0",
                                                                               binary_data=binary)])
                with torch.no_grad():
                    expected = model(torch.from_numpy(x)).numpy()
                actual = result.as_numpy("output0")
                assert actual.shape == expected.shape and actual.dtype == np.float32
                np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
                checked.append(binary)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors, errors[0]
    assert sorted(checked) == [False] * 12 + [True] * 12


@pytest.mark.parametrize("datatype", DATATYPES)
def test_every_datatype_in_json_and_binary(served, datatype):
    x = _values(datatype)
    client = served.client()
    for binary in (True, False):
        if datatype == "BF16" and not binary:
            continue  # tritonclient sends BF16 as binary only: JSON is checked below
        result = client.infer("cast", [_input("x", x, datatype, binary)], outputs=[
            httpclient.InferRequestedOutput("same", binary_data=binary),
            httpclient.InferRequestedOutput("as_fp64", binary_data=binary)])
        outputs = {o["name"]: o for o in result.get_response()["outputs"]}
        assert outputs["same"]["datatype"] == datatype and outputs["same"]["shape"] == [2, 3]
        assert outputs["as_fp64"]["datatype"] == "FP64"
        same = result.as_numpy("same")
        assert same.dtype == x.dtype and np.array_equal(same, x), (binary, same)
        np.testing.assert_array_equal(result.as_numpy("as_fp64"), x.astype(np.float64))
    if datatype == "BF16":  # JSON numbers, rounded to BF16 on the way in
        request = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "BF16",
                               "data": [[1.5, -2.25, 0.0], [3.0, 256.0, -0.1251]]}]}
        status, answer = _infer_json(served, "cast", request)
        assert status == 200, answer
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert outputs["same"]["datatype"] == "BF16"
        assert outputs["same"]["data"] == [1.5, -2.25, 0.0, 3.0, 256.0, -0.125]
        assert outputs["as_fp64"]["data"] == [1.5, -2.25, 0.0, 3.0, 256.0, -0.125]


def test_inputs_map_by_name_else_by_position(served):
    client = served.client()
    a = np.full((2, 3), 10, np.float32)
    b = np.ones((2, 3), np.float32)
    by_name = client.infer("pair", [_input("b", b, "FP32", True), _input("a", a, "FP32", True)])
    np.testing.assert_array_equal(by_name.as_numpy("output0"), a - b)
    by_position = client.infer("pair", [_input("first", b, "FP32", False),
                                        _input("second", a, "FP32", False)])
    np.testing.assert_array_equal(by_position.as_numpy("output0"), b - a)


def test_requested_outputs_select_among_the_model_outputs(served):
    client = served.client()
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    everything = client.infer("cast", [_input("x", x, "INT32", True)])
    assert sorted(o["name"] for o in everything.get_response()["outputs"]) == ["as_fp64", "same"]
    one = client.infer("cast", [_input("x", x, "INT32", True)],
                       outputs=[httpclient.InferRequestedOutput("as_fp64", binary_data=False)])
    assert [o["name"] for o in one.get_response()["outputs"]] == ["as_fp64"]
    assert one.get_response()["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(InferenceServerException) as missing:
        client.infer("cast", [_input("x", x, "INT32", True)],
                     outputs=[httpclient.InferRequestedOutput("nope")])
    assert missing.value.status() == "400" and "nope" in missing.value.message()


def test_compression_and_json_whatever_the_content_type(served):
    client = served.client()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("cast", [_input("x", x, "FP32", True)],
                              request_compression_algorithm=algorithm,
                              response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("same"), x)
    request = {"inputs": [{"name": "x", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}]}
    status, answer = _infer_json(served, "cast", request,
                                 {"Content-Type": "application/octet-stream"})
    assert status == 200 and answer["outputs"][0]["data"] == [1, 2, 3]
    status, _, body = _request(served, "POST", "/v2/models/cast/infer",
                               gzip.compress(json.dumps(request).encode()),
                               {"Content-Encoding": "gzip"})
    assert status == 200, body


def test_bytes_in_and_out_in_json_and_binary(served):
    client = served.client()
    names = ["upper", "lengths", "same", "joined"]
    for binary_in in (True, False):
        for binary_out in (True, False):
            result = client.infer("text", [_input("text", TEXT, "BYTES", binary_in)], outputs=[
                httpclient.InferRequestedOutput(name, binary_data=binary_out) for name in names])
            outputs = {o["name"]: o for o in result.get_response()["outputs"]}
            assert [(outputs[n]["datatype"], outputs[n]["shape"]) for n in names] == [
                ("BYTES", [2, 2]), ("INT64", [2, 2]), ("BYTES", [2, 2]), ("BYTES", [2])]
            assert ("data" in outputs["upper"]) is not binary_out
            assert _as_bytes(result.as_numpy("upper")) == [
                b"HELLO", "W\u00d6RLD".encode(), b"", b"A B"]
            np.testing.assert_array_equal(result.as_numpy("lengths"), [[5, 6], [0, 3]])
            assert _as_bytes(result.as_numpy("same")) == list(TEXT.reshape(-1))
            assert _as_bytes(result.as_numpy("joined")) == [b"hello w\xc3\xb6rld", b" a b"]
    metadata = client.get_model_metadata("text")  # from the archive's example of bytes
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("upper", "BYTES", [-1]), ("lengths", "INT64", [-1]), ("same", "BYTES", [-1]),
        ("joined", "BYTES", [-1])]


def test_bytes_in_json_are_strings_and_bytes_that_are_not_text_go_back_as_binary(served):
    def text(data, shape):
        return _infer_json(served, "text", {"inputs": [
            {"name": "text", "shape": shape, "datatype": "BYTES", "data": data}]})

    status, answer = text([["a", "\u00e9"], ["", "b c"]], [2, 2])  # nested, UTF-8 in JSON
    assert status == 200, answer
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["upper"]["data"] == ["A", "\u00c9", "", "B C"]
    assert outputs["lengths"]["data"] == [1, 2, 0, 3]
    status, answer = text(["a", "b", "c", "d"], [2, 2])  # flat, row-major
    assert status == 200 and answer["outputs"][3]["data"] == ["a b", "c d"], answer
    for data, shape, words in [([1, 2], [2], "must be strings"), (["a"], [2], "elements"),
                               ([["a"], ["b", "c"]], [3], "one shape"),
                               ([["a"], "b"], [2], "one shape")]:
        status, answer = text(data, shape)
        assert status == 400 and words in answer["error"], (data, answer)
    status, _, body = _request(served, "POST", "/v2/models/text/infer", json.dumps(
        {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["\ud800"]}]},
        ensure_ascii=True).encode())  # a lone surrogate, which no UTF-8 can encode
    assert status == 400 and "lone surrogate" in json.loads(body)["error"], body
    # bytes that are not UTF-8: JSON cannot carry them back, binary data can
    raw = np.array([b"\xff\xfe", b"ok"], dtype=object)
    client = served.client()
    with pytest.raises(InferenceServerException) as json_answer:
        client.infer("text", [_input("text", raw, "BYTES", True)],
                     outputs=[httpclient.InferRequestedOutput("same", binary_data=False)])
    assert json_answer.value.status() == "400", json_answer.value
    assert "element 0 is not UTF-8 text" in json_answer.value.message()
    assert '"binary_data": true' in json_answer.value.message()
    result = client.infer("text", [_input("text", raw, "BYTES", True)], outputs=[
        httpclient.InferRequestedOutput("same", binary_data=True),
        httpclient.InferRequestedOutput("upper", binary_data=False)])
    assert list(result.as_numpy("same")) == [b"\xff\xfe", b"ok"]
    assert list(result.as_numpy("upper")) == ["\ufffd\ufffd", "OK"]
    # binary data whose lengths do not match it: what is wrong, said
    header = json.dumps({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 13}}]}).encode()
    body = header + b"\x03\0\0\0abc" + b"\x09\0\0\0ab"  # 9 bytes said, 2 sent
    status, _, answer = _request(served, "POST", "/v2/models/text/infer", body,
                                 {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400, answer
    assert json.loads(answer)["error"] == (
        "input 'text': BYTES element 1 is cut short: its length says 9 bytes, but only 2 "
        "are left (binary_data_size 13)")
    status, answer = text(["still", "served"], [2])
    assert status == 200 and answer["outputs"][0]["data"] == ["STILL", "SERVED"], answer


def test_bytes_cross_between_host_and_interpreter(manager, packages):
    """The host's own calls (Ray Serve's replicas; connections that arrive while the
    interpreters start) send BYTES arrays into an interpreter and get them back."""
    from multipy.serve.host import archive

    path = packages["text"]
    storages = archive.records(path)
    for interpreter in manager.all_instances():
        served = interpreter.global_("multipy._inside.serving", "load")(
            path, "model", "model.pkl", storages)
        names, datatypes, upper, lengths, same, joined = served.call_value(
            "infer", (("text",), ("BYTES",), TEXT))
        assert names == ("upper", "lengths", "same", "joined")
        assert datatypes == ("BYTES", "INT64", "BYTES", "BYTES")
        assert upper.dtype == object and upper.shape == (2, 2)
        assert upper.tolist() == [[b"HELLO", "W\u00d6RLD".encode()], [b"", b"A B"]]
        np.testing.assert_array_equal(lengths, [[5, 6], [0, 3]])
        assert same.dtype == object and same.tolist() == TEXT.tolist()
        assert joined.tolist() == [b"hello w\xc3\xb6rld", b" a b"]
        metadata = served.call_value("metadata")
        assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


def test_str_and_bytes_outputs_of_every_form_are_bytes(manager):
    """What a model may return as BYTES, made outputs inside an interpreter: str and
    bytes, lists of them (one output each, even nested), numpy arrays of dtype object,
    S and U; an array of objects that are neither is the model's error."""
    interpreter = manager.all_instances()[0]
    outputs = interpreter.global_("multipy._inside.serving", "named_outputs")
    inside_torch = interpreter.global_("importlib", "import_module")("torch")

    def made(value) -> list:
        return [(name, datatype, array.tolist(), array.shape)
                for name, datatype, array in outputs(inside_torch, value, set()).deref()]

    assert made(["a", b"b\x00"]) == [("output0", "BYTES", [b"a", b"b\x00"], (2,))]
    assert made("\u00e9") == [("output0", "BYTES", "\u00e9".encode(), ())]
    assert made(b"\x00") == [("output0", "BYTES", b"\x00", ())]
    assert made({"words": ["x"], "pair": (["y", "z"], [torch.tensor([1])])}) == [
        ("words", "BYTES", [b"x"], (1,)), ("pair.0", "BYTES", [b"y", b"z"], (2,)),
        ("pair.1.0", "INT64", [1], (1,))]
    assert made(np.array([[b"a"], [b"bc"]])) == [("output0", "BYTES", [[b"a"], [b"bc"]], (2, 1))]
    assert made(np.array(["\u00e9", "f"])) == [
        ("output0", "BYTES", ["\u00e9".encode(), b"f"], (2,))]
    assert made(np.array(["a", b"b"], dtype=object)) == [("output0", "BYTES", [b"a", b"b"], (2,))]
    assert made([]) == []  # no items: no outputs, as before
    with pytest.raises(TypeError, match="array of objects that holds a int"):
        made(np.array(["a", 1], dtype=object))
