"""`multipy serve FILE.py:CLASS` where CLASS subclasses `kserve.Model`: the class, as
KServe's users write it for the v2 protocol, serves unchanged (load, preprocess,
predict and postprocess, sync and async, InferRequest / InferResponse and dicts), over
HTTP and gRPC, asked by KServe's own clients; its answers are those of the model run
as KServe runs it; its errors are KServe's statuses.

Runs where kserve is installed: `make test-kserve` makes an environment of its own
(KServe 0.21 pins protobuf < 7, which the test environment's packages refuse).
"""
from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys

import pytest

kserve = pytest.importorskip("kserve")
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

import grpc  # noqa: E402
import httpx  # noqa: E402
from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig  # noqa: E402
from kserve.protocol.infer_type import InferInput, InferRequest  # noqa: E402
from serving import _grpc_port, _infer_json, _infer_together, _request, _start, _stop  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODELS = '''
import asyncio
import os

import kserve
import numpy as np
import torch
from kserve import InferOutput, InferRequest, InferResponse
from kserve.errors import InvalidInput


class Linear(kserve.Model):
    """A torch model as KServe's examples write one: load() reads its weights from beside
    this file; predict takes an InferRequest and answers an InferResponse."""

    def __init__(self, name: str):
        super().__init__(name)
        self.net = None

    def load(self) -> bool:
        self.net = torch.nn.Linear(4, 3)
        folder = os.path.dirname(os.path.abspath(__file__))
        self.net.load_state_dict(torch.load(os.path.join(folder, "linear.pt")))
        self.net.eval()
        self.ready = True
        return self.ready

    def get_input_types(self):
        return [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]

    def get_output_types(self):
        return [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]

    def predict(self, payload: InferRequest, headers=None, response_headers=None):
        x = payload.inputs[0].as_numpy()
        if not np.isfinite(x).all():
            raise InvalidInput("x must be finite")
        with torch.no_grad():
            y = self.net(torch.from_numpy(x)).numpy()
        output = InferOutput("y", list(y.shape), "FP32")
        output.set_data_from_numpy(y, binary_data=False)
        return InferResponse(payload.id, self.name, [output])


class Words(kserve.Model):
    """Async load, preprocess and predict, a sync postprocess; predict answers a dict,
    with the request's id and its parameter "mark"."""

    def __init__(self, name: str):
        super().__init__(name)

    async def load(self):
        await asyncio.sleep(0)
        self.mark = "!"
        self.ready = True

    async def preprocess(self, payload: InferRequest, headers=None):
        n = payload.get_input_by_name("n")
        n.set_data_from_numpy(n.as_numpy() * 2, binary_data=False)
        return payload

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        text = payload.get_input_by_name("text").as_numpy()
        n = payload.get_input_by_name("n").as_numpy()
        mark = (payload.parameters or {}).get("mark", self.mark)
        # (KServe gives BYTES as str from JSON, as bytes from binary data)
        loud = [(each if isinstance(each, str) else each.decode()).upper() + mark
                for each in text.reshape(-1)]
        return {"model_name": self.name, "outputs": [
            {"name": "loud", "datatype": "BYTES", "shape": list(text.shape), "data": loud},
            {"name": "n", "datatype": "INT64", "shape": list(n.shape), "data": n.tolist()},
            {"name": "id", "datatype": "BYTES", "shape": [1], "data": [payload.id or ""]}]}

    def postprocess(self, result, headers=None, response_headers=None):
        count = len(result["outputs"][0]["data"])
        result["outputs"].append({"name": "count", "datatype": "INT32", "shape": [1],
                                  "data": [count]})
        return result


class Rows(kserve.Model):
    """Its input back, with the rows of the call and the request's id."""

    def __init__(self, name: str):
        super().__init__(name)
        self.ready = True

    async def predict(self, payload, headers=None, response_headers=None):
        v = payload.inputs[0].as_numpy()
        return {"outputs": [
            {"name": "v", "datatype": "INT64", "shape": list(v.shape), "data": v.tolist()},
            {"name": "rows", "datatype": "INT64", "shape": [len(v)], "data": [len(v)] * len(v)},
            {"name": "id", "datatype": "BYTES", "shape": [len(v)],
             "data": [payload.id or ""] * len(v)}]}


class Fails(kserve.Model):
    def __init__(self, name: str):
        super().__init__(name)
        self.ready = True

    def predict(self, payload, headers=None, response_headers=None):
        raise KeyError("no such thing")


class Flaky(kserve.Model):
    """Healthy (its own async healthy(), as KServe's model readiness asks it) while the
    file "sick" beside this module does not exist."""

    def __init__(self, name: str):
        super().__init__(name)
        self.ready = True

    async def healthy(self) -> bool:
        sick = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sick")
        return self.ready and not os.path.exists(sick)

    def predict(self, payload, headers=None, response_headers=None):
        return payload


class SlowFlaky(Flaky):
    """Flaky, its predict taking 6 s once it has written the file "predicting" beside
    this module."""

    def predict(self, payload, headers=None, response_headers=None):
        import time

        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "predicting"),
             "w").close()
        time.sleep(6)
        return payload


class NotReady(kserve.Model):
    def __init__(self, name: str):
        super().__init__(name)

    def load(self):
        return False

    def predict(self, payload, headers=None, response_headers=None):
        return payload
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The folder of kmodels.py (MODELS) and its weights, linear.pt."""
    folder = tmp_path_factory.mktemp("kserve_models")
    (folder / "kmodels.py").write_text(MODELS)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(4, 3).state_dict(), folder / "linear.pt")
    return folder


@pytest.fixture(scope="module")
def direct(models):
    """The module kmodels, imported here: its models run as KServe runs them."""
    spec = importlib.util.spec_from_file_location("kmodels", models / "kmodels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    server = _start(tmp_path_factory.mktemp("kserve_served"),
                    [f"{models}/kmodels.py:Linear", f"{models}/kmodels.py:Words",
                     f"{models}/kmodels.py:Fails", f"{models}/kmodels.py:Flaky"],
                    "--interpreters", "2", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


def _as_kserve(direct, name: str, request: InferRequest) -> dict:
    """Output name -> array of the model called name, made, loaded and called here as
    KServe's data plane calls it (``await model(request, headers)``)."""
    model = getattr(direct, name)(name.lower())

    async def run():
        loaded = model.load()
        if asyncio.iscoroutine(loaded):
            await loaded
        response, _ = await model(request, headers={})
        return response

    response = asyncio.run(run())
    outputs = response.outputs if hasattr(response, "outputs") else [
        InferInput(o["name"], o["shape"], o["datatype"], o["data"]) for o in response["outputs"]]
    return {output.name: output.as_numpy() for output in outputs}


def _x_request(x: np.ndarray, binary: bool) -> InferRequest:
    tensor = InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return InferRequest("linear", [tensor], request_id="r1")


def _words_request() -> InferRequest:
    text = InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([b"hi", "w\u00f6rld".encode()], dtype=object),
                             binary_data=False)
    n = InferInput("n", [2], "INT64")
    n.set_data_from_numpy(np.array([3, 4], dtype=np.int64), binary_data=False)
    return InferRequest("words", [text, n], request_id="w1", parameters={"mark": "?"})


def _outputs(response) -> dict:
    return {output.name: output.as_numpy() for output in response.outputs}


def _rest(served, request: InferRequest, model: str):
    async def call():
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        return await client.infer(f"http://127.0.0.1:{served.port}", request, model_name=model)

    return asyncio.run(call())


def _grpc(served, request: InferRequest):
    async def call():
        client = InferenceGRPCClient(f"127.0.0.1:{_grpc_port(served)}", timeout=60)
        try:
            return await client.infer(request)
        finally:
            await client.close()

    return asyncio.run(call())


@pytest.mark.parametrize("binary", [False, True])
def test_a_kserve_model_answers_kserve_s_rest_client_as_kserve_runs_it(served, direct, models,
                                                                       binary):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    expected = _as_kserve(direct, "Linear", _x_request(x, False))
    for _ in range(4):  # new connections: both interpreters
        answer = _rest(served, _x_request(x, binary), "linear")
        assert answer.model_name == "linear"
        np.testing.assert_allclose(_outputs(answer)["y"], expected["y"], rtol=1e-6)
    net = torch.nn.Linear(4, 3)  # and the weights are those that load() read
    net.load_state_dict(torch.load(models / "linear.pt"))
    with torch.no_grad():
        np.testing.assert_allclose(expected["y"], net(torch.from_numpy(x)).numpy(), rtol=1e-6)


def test_a_kserve_model_over_grpc(served, direct):
    x = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    answer = _grpc(served, _x_request(x, True))
    np.testing.assert_allclose(_outputs(answer)["y"],
                               _as_kserve(direct, "Linear", _x_request(x, False))["y"],
                               rtol=1e-6)
    words = _outputs(_grpc(served, _words_request()))
    assert words["loud"].tolist() == [b"HI?", "W\u00d6RLD?".encode()]
    assert words["n"].tolist() == [6, 8] and words["count"].tolist() == [2]
    assert words["id"].tolist() == [b"w1"]


def test_async_hooks_and_a_dict_answer(served, direct):
    """Words: async load, preprocess (doubles n) and predict (a dict, with the request's
    id and parameter), sync postprocess (adds count), BYTES in and out."""
    expected = _as_kserve(direct, "Words", _words_request())
    got = _outputs(_rest(served, _words_request(), "words"))
    assert set(got) == {"loud", "n", "count", "id"}
    assert got["loud"].tolist() == ["HI?", "W\u00d6RLD?"] == expected["loud"].tolist()
    assert got["n"].tolist() == expected["n"].tolist() == [6, 8]
    assert got["count"].dtype == np.int32 and got["count"].tolist() == [2]
    assert got["id"].tolist() == expected["id"].tolist() == ["w1"]


def test_metadata_is_the_model_s_input_and_output_types(served):
    import json

    status, _, body = _request(served, "GET", "/v2/models/linear")
    assert status == 200 and json.loads(body) == {
        "name": "linear", "versions": ["1"], "platform": "python",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]}
    status, _, body = _request(served, "GET", "/v2/models/words")
    assert status == 200 and json.loads(body)["inputs"] == []


def test_kserve_s_invalid_input_is_a_400_and_other_errors_a_500(served):
    x = np.array([[1, np.nan, 3, 4]], dtype=np.float32)
    with pytest.raises(httpx.HTTPStatusError) as raised:
        _rest(served, _x_request(x, True), "linear")
    assert raised.value.response.status_code == 400
    assert raised.value.response.json() == {"error": "x must be finite"}
    with pytest.raises(grpc.RpcError) as raised:
        _grpc(served, _x_request(x, True))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "x must be finite"
    status, answer = _infer_json(served, "fails", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    assert status == 500 and "KeyError" in answer["error"] and "no such thing" in answer["error"]


def test_a_kserve_model_is_ready_while_its_healthy_says_so(served, models):
    """Over HTTP and gRPC, as KServe's model readiness is its healthy(); the server stays
    ready (KServe's server readiness does not ask the models)."""

    def grpc_ready() -> bool:
        async def call():
            client = InferenceGRPCClient(f"127.0.0.1:{_grpc_port(served)}", timeout=60)
            try:
                return await client.is_model_ready("flaky")
            finally:
                await client.close()

        return asyncio.run(call())

    assert _request(served, "GET", "/v2/models/flaky/ready")[0] == 200 and grpc_ready()
    sick = models / "sick"
    sick.write_text("")
    try:
        for _ in range(4):  # new connections: both interpreters
            assert _request(served, "GET", "/v2/models/flaky/ready")[0] == 400
        assert not grpc_ready()
        assert _request(served, "GET", "/v2/models/linear/ready")[0] == 200
        assert _request(served, "GET", "/v2/health/ready")[0] == 200
    finally:
        sick.unlink()
    assert _request(served, "GET", "/v2/models/flaky/ready")[0] == 200 and grpc_ready()


def test_while_the_host_answers_readiness_is_the_last_healthy(models, tmp_path):
    """With its one interpreter in a long predict, the host answers a probe on a new
    connection: what the model's healthy() last said there, not ready if it said so."""
    import threading
    import time

    server = _start(tmp_path, [f"{models}/kmodels.py:SlowFlaky"], "--interpreters", "1")
    sick, predicting = models / "sick", models / "predicting"
    request = {"inputs": [{"name": "v", "shape": [1], "datatype": "INT64", "data": [1]}]}

    def ready_during_a_long_predict() -> int:
        predicting.unlink(missing_ok=True)
        call = threading.Thread(target=_infer_json, args=(server, "slowflaky", request))
        call.start()
        try:
            while not predicting.exists():
                assert call.is_alive()
                time.sleep(0.05)
            return _request(server, "GET", "/v2/models/slowflaky/ready")[0]
        finally:
            call.join(60)

    try:
        sick.write_text("")
        assert _request(server, "GET", "/v2/models/slowflaky/ready")[0] == 400  # (its own)
        assert ready_during_a_long_predict() == 400
        sick.unlink()
        assert _request(server, "GET", "/v2/models/slowflaky/ready")[0] == 200
        assert ready_during_a_long_predict() == 200
    finally:
        sick.unlink(missing_ok=True)
        _stop(server)


def test_requests_to_a_kserve_model_are_batched(models, tmp_path):
    """With --max-batch-size, requests that arrive together reach predict as one
    InferRequest (without an id: it holds several requests), each answered its rows."""
    server = _start(tmp_path, [f"{models}/kmodels.py:Rows"], "--interpreters", "1",
                    "--max-batch-size", "8", "--batch-timeout-ms", "500")
    try:
        answers = _infer_together(server, "rows", [{"id": f"r{k}", "inputs": [
            {"name": "v", "shape": [2], "datatype": "INT64", "data": [k, k]}]} for k in range(3)])
        for k, (status, answer) in enumerate(answers):
            assert status == 200, answer
            outputs = {o["name"]: o["data"] for o in answer["outputs"]}
            assert outputs["v"] == [k, k] and answer["id"] == f"r{k}"
            assert outputs["rows"] == [6, 6]  # predict got the three requests' rows at once
            assert outputs["id"] == ["", ""]
    finally:
        _stop(server)


def test_a_kserve_model_that_load_leaves_not_ready_stops_the_start(models):
    done = subprocess.run(
        [sys.executable, "-m", "multipy", "serve", f"{models}/kmodels.py:NotReady",
         "--interpreters", "1", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # the class's own fault, before listening
    assert "kmodels.NotReady.load() left the model not ready" in done.stderr
    assert "listening on" not in done.stderr
