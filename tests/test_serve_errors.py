"""`multipy serve`'s answers to requests that are wrong: the protocol's errors, each a 400
(or 404, 405, 500 for the model's own fault) that says what is wrong, and fuzzed requests
over HTTP and gRPC; on the shared server ``served`` (conftest.py).
"""
from __future__ import annotations

import json
import os

import pytest

np = pytest.importorskip("numpy")
from serving import (DATATYPES, _grpc, _grpc_input, _grpc_port, _infer_json, _metrics,  # noqa: E402
                     _request, _unary)


def test_bad_requests_get_the_protocols_errors_and_the_server_keeps_serving(served):
    good = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    failed = ("multipy_inference_failures_total", (("model", "fails"), ("status", "500")))
    received = ("multipy_inference_requests_total", (("model", "fails"),))
    before = _metrics(served)

    def infer(model: str, request, headers=None, raw: bytes | None = None):
        body = raw if raw is not None else json.dumps(request).encode()
        status, _, answer = _request(served, "POST", f"/v2/models/{model}/infer", body, headers)
        error = json.loads(answer)
        assert set(error) == {"error"} and error["error"], error
        return status, error["error"]

    assert infer("cast", None, raw=b'{"inputs": [')[0] == 400
    assert infer("nope", good) == (404, infer("nope", good)[1]) and "nope" in infer("nope", good)[1]
    tensor = good["inputs"][0]
    for change, words in [({"datatype": "FP99"}, "FP99"), ({"datatype": "BYTES"}, "BYTES"),
                          ({"data": ["a", "b"]}, "numbers"), ({"data": [1, 2, 3]}, "elements"),
                          ({"shape": [2, 2]}, "elements"), ({"shape": [-2]}, "shape"),
                          ({"datatype": "INT8", "data": [1, 300]}, "range"),
                          ({"datatype": "BOOL", "data": [1, 0]}, "true or false"),
                          ({"data": [[1], [2, 3]]}, "data"),
                          ({"datatype": "INT32", "data": [1, None]}, "integers")]:
        status, message = infer("cast", {"inputs": [{**tensor, **change}]})
        assert status == 400 and words in message, (change, message)
    assert infer("cast", {"inputs": []})[0] == 400
    assert infer("cast", None, raw=b'{"inputs": ' + b"[" * 100000)[0] == 400  # too deep
    huge = (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": ['
            + b"9" * 5000 + b"]}]}")  # past Python's digit limit for int()
    assert infer("cast", None, raw=huge)[0] == 400
    # "outputs": [] asks for every output, as Triton answers
    status, answer = _infer_json(served, "cast", {**good, "outputs": []})
    assert status == 200 and {o["name"] for o in answer["outputs"]} == {"same", "as_fp64"}
    assert infer("cast", {"nothing": 1})[0] == 400
    # binary data that does not match the shape, or is missing
    header = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    assert infer("cast", None, {"Inference-Header-Content-Length": str(len(header))},
                 header + b"\0" * 4)[0] == 400
    header = header.replace(b'"binary_data_size": 4', b'"binary_data_size": 8')
    assert infer("cast", None, {"Inference-Header-Content-Length": str(len(header))},
                 header + b"\0" * 4)[0] == 400
    assert infer("cast", None, {"Inference-Header-Content-Length": "100000"}, header)[0] == 400
    # the model raises: the model's fault
    negative = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [-1]}]}
    status, message = infer("fails", negative)
    assert status == 500 and "negative input" in message and "ValueError" in message
    assert 'raise ValueError("negative input")' in served.output()  # the model's traceback
    # an unknown route
    status, _, body = _request(served, "GET", "/v2/nothing/here")
    assert status == 404 and "error" in json.loads(body)
    # a method the route does not take: 405, with the Allow header that HTTP requires
    status, headers, body = _request(served, "GET", "/v2/models/cast/infer")
    assert status == 405 and headers.get("allow") == "POST" and "error" in json.loads(body)
    # and the server still answers, every model
    for model in ("cast", "fails"):
        status, answer = _infer_json(served, model, good)
        assert status == 200 and answer["outputs"][0]["data"] in ([1.0, 2.0], [1, 2]), answer
    after = _metrics(served)  # (other modules' tests may have asked fails before)
    assert after[failed] == before.get(failed, 0) + 1
    assert after[received] == before.get(received, 0) + 2


def _requests_to_fuzz():
    """Inference requests, well formed and not: any JSON the protocol's request object
    could be confused with, and valid requests with one field changed."""
    from hypothesis import strategies as st

    leaf = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats(), st.booleans(),
                     st.text(max_size=4), st.none())
    data = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=16)
    datatype = st.one_of(st.sampled_from(DATATYPES + ["BYTES", "FP8", "", "fp32"]), data)
    shape = st.one_of(st.lists(st.integers(-2, 2 ** 64), max_size=4),
                      st.lists(st.integers(0, 3), max_size=3), data)
    tensor = st.fixed_dictionaries(
        {"name": st.sampled_from(["x", "y", ""]), "datatype": datatype, "shape": shape,
         "data": data}, optional={"parameters": st.dictionaries(st.text(max_size=12), data,
                                                                 max_size=2)})
    request = st.fixed_dictionaries(
        {"inputs": st.one_of(st.lists(tensor, max_size=3), data)},
        optional={"id": data, "parameters": st.dictionaries(st.text(max_size=12), data, max_size=2),
                  "outputs": st.one_of(st.lists(st.fixed_dictionaries(
                      {"name": st.sampled_from(["same", "as_fp64", "other"])},
                      optional={"parameters": data}), max_size=3), data)})

    @st.composite
    def changed(draw):
        rows = draw(st.integers(0, 3))
        kind = draw(st.sampled_from(DATATYPES))
        good = {"name": "x", "datatype": kind, "shape": [rows],
                "data": [1] * rows if kind != "BOOL" else [True] * rows}
        field = draw(st.sampled_from(["name", "datatype", "shape", "data", None]))
        if field is not None:
            good[field] = draw({"name": st.text(max_size=3), "datatype": datatype,
                                "shape": shape, "data": data}[field])
        return {"inputs": [good]}

    return st.one_of(request, changed(), data)


def _as_grpc(body):
    """The ModelInferRequest of model cast that says what it can of body (a generated
    HTTP request's JSON), and whether it says all of it: then it must be answered as
    body is.  Typed contents say a flat list of values that fit its datatype's field
    (JSON's numbers, true and false, and strings, as UTF-8); the messages' strings,
    integers and parameters say the rest."""
    from multipy.serve.rpc import inference_pb2 as messages
    from multipy.serve.rpc.server import _CONTENTS

    request = messages.ModelInferRequest(model_name="cast")
    said = [isinstance(body, dict)]  # False for each part of body that is not said
    body = body if isinstance(body, dict) else {}

    def put(set_to, value, fits: bool) -> None:
        """set_to(value), if value fits and the message can hold it."""
        try:
            if fits:
                set_to(value)
                return
        except (TypeError, ValueError, OverflowError):  # out of range, or not UTF-8
            pass
        said.append(False)

    def parameters(into, given) -> None:
        said.append(isinstance(given, (dict, type(None))))
        for key, value in (given if isinstance(given, dict) else {}).items():
            choice = {bool: "bool_param", int: "int64_param", str: "string_param",
                      float: "double_param"}.get(type(value))
            put(lambda v, key=key, choice=choice: setattr(into[key], choice, v), value,
                choice is not None)

    def values(value, kinds: tuple) -> bool:
        return type(value) in kinds or (
            "int64" in kinds and type(value) is int and -2 ** 63 <= value < 2 ** 63)

    parameters(request.parameters, body.get("parameters"))
    if body.get("id") is not None:
        put(lambda v: setattr(request, "id", v), body["id"], isinstance(body["id"], str))
    outputs = body.get("outputs") or []
    said.append(isinstance(outputs, list))
    for output in outputs if isinstance(outputs, list) else []:
        named = isinstance(output, dict) and isinstance(output.get("name"), str)
        said.append(named)
        if named:
            parameters(request.outputs.add(name=output["name"]).parameters,
                       output.get("parameters"))
    inputs = body.get("inputs")
    said.append(isinstance(inputs, list))
    for spec in inputs if isinstance(inputs, list) else []:
        said.append(isinstance(spec, dict) and "data" in spec)
        spec = spec if isinstance(spec, dict) else {}
        tensor = request.inputs.add()
        for key in ("name", "datatype"):
            put(lambda v, key=key: setattr(tensor, key, v), spec.get(key),
                isinstance(spec.get(key), str))
        shape = spec.get("shape")
        put(tensor.shape.extend, shape,
            isinstance(shape, list) and all(type(size) is int for size in shape))
        parameters(tensor.parameters, spec.get("parameters"))
        data = spec.get("data") if isinstance(spec.get("data"), list) else [spec.get("data")]
        field = _CONTENTS.get(tensor.datatype)
        kinds = {"bool_contents": (bool,), "fp32_contents": (float, "int64"),
                 "fp64_contents": (float, "int64"), "bytes_contents": (str,)}.get(field, (int,))
        if field is not None and data:
            put(lambda data: getattr(tensor.contents, field).extend(
                [v.encode() if isinstance(v, str) else v for v in data]), data,
                all(values(v, kinds) for v in data))
    return request, all(said)


#: The gRPC code of each HTTP status that a fuzzed request may be answered with.
_FUZZ_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 500: "INTERNAL"}


def test_fuzzed_requests_get_an_answer_that_says_what_is_wrong(served):
    """Generated requests (hypothesis: 300, the same each run; with FUZZ_EXAMPLES, that
    many, new each run), over HTTP and, as far as its messages can say them, gRPC: each
    is answered 200 (OK), or 400 (INVALID_ARGUMENT) with a message, or 500 (INTERNAL)
    only where the model itself raised; never a server error, never no answer; over
    gRPC, as over HTTP where the message says all the request does; and a normal
    request is served after."""
    import grpc
    from hypothesis import HealthCheck, given, settings

    from multipy.serve.rpc import inference_pb2 as messages

    examples = int(os.environ.get("FUZZ_EXAMPLES", "300"))
    seen: dict[int, int] = {}
    codes: dict[str, int] = {}
    channel = grpc.insecure_channel(f"127.0.0.1:{_grpc_port(served)}")
    infer = _unary(channel, "ModelInfer", messages.ModelInferResponse)

    @settings(max_examples=examples, deadline=None, database=None,
              derandomize="FUZZ_EXAMPLES" not in os.environ,
              suppress_health_check=list(HealthCheck))
    @given(_requests_to_fuzz())
    def answered(body):
        status, headers, answer = _request(served, "POST", "/v2/models/cast/infer",
                                           json.dumps(body).encode())
        seen[status] = seen.get(status, 0) + 1
        reply = json.loads(answer)
        if status == 200:
            assert reply["model_name"] == "cast" and "outputs" in reply
        else:
            assert status in (400, 500), (status, body, reply)
            assert isinstance(reply["error"], str) and reply["error"], (body, reply)
            if status == 500:
                assert reply["error"].startswith("model 'cast' raised"), (body, reply)
        request, exact = _as_grpc(body)
        try:
            code, message = "OK", infer(request, timeout=60).model_name
        except grpc.RpcError as error:
            code, message = error.code().name, error.details()
        codes[code] = codes.get(code, 0) + 1
        assert code in _FUZZ_CODES.values() and message, (code, message, request)
        if code == "INTERNAL":
            assert message.startswith("model 'cast' raised"), (message, request)
        if exact:
            codes["as HTTP"] = codes.get("as HTTP", 0) + 1
            assert code == _FUZZ_CODES[status], (status, reply, code, message, body, request)

    try:
        answered()
    finally:
        channel.close()
    print(f"fuzzed requests by status: {dict(sorted(seen.items()))}; over gRPC, by code: "
          f"{codes}")  # (pytest -s)
    assert sum(seen.values()) >= examples and seen.get(400), seen
    assert codes.get("OK") and codes.get("as HTTP", 0) >= examples // 10, codes
    status, answer = _infer_json(served, "cast", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [2]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [2.0]
    assert _grpc(served).infer("cast", [_grpc_input("x", np.ones(1, np.float32), "FP32")]) \
        .as_numpy("same").tolist() == [1.0]
