"""`multipy serve FILE.py:CLASS` where CLASS subclasses `litserve.LitAPI`: the class, as
LitServe's README writes one, serves unchanged on LitServe's routes (POST to its path,
/health, /info), answering as LitServe's server does (HTTPException's status and
detail, 500 for the rest), batching under --max-batch-size with its batch and unbatch,
and on the Open Inference Protocol's routes too.  (A plain `torch.nn.Module` class:
tests/test_model_class.py.)
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port

litserve = pytest.importorskip("litserve")
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from serving import (Server, _infer_json, _metrics, _request,  # noqa: E402
                     _start, _stop)

pytestmark = pytest.mark.timeout(300)

MODELS = '''
import os

import litserve as ls
import torch
from fastapi import HTTPException
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

SETUPS = []  # (device) of each setup() in this interpreter


class SimpleLitAPI(ls.LitAPI):
    """LitServe's README's first example."""

    def setup(self, device):
        self.model = lambda x: x**2

    def decode_request(self, request):
        return request["input"]

    def predict(self, x):
        return self.model(x)

    def encode_response(self, output):
        return {"output": output}


class InferencePipeline(ls.LitAPI):
    """An "inference engine" of several models and steps, on a path of its own, with
    the requests' context (as LitServe gives it to hooks that take one)."""

    def __init__(self):
        super().__init__(api_path="/pipeline")

    def setup(self, device):
        SETUPS.append(device)
        self.embed = lambda text: [len(word) for word in text.split()]
        self.score = lambda lengths: sum(lengths) / len(lengths)

    def decode_request(self, request, context):
        context["words"] = len(request["text"].split())
        return request["text"].lower()

    def predict(self, text, context):
        lengths = self.embed(text)
        return {"lengths": lengths, "score": self.score(lengths), "words": context["words"]}

    def encode_response(self, output):
        return {**output, "setups": SETUPS, "device": self.device}


class Strict(ls.LitAPI):
    """Refuses what it cannot take, with FastAPI's and Starlette's HTTPException, and
    fails on a value it cannot handle."""

    def decode_request(self, request):
        if "crash" in request:
            raise RuntimeError("decoding crashed")
        if not isinstance(request.get("x"), (int, float)):
            raise HTTPException(status_code=400, detail="x must be a number")
        return request["x"]

    def predict(self, x):
        if x < 0:
            raise StarletteHTTPException(status_code=422, detail=f"{x} is negative")
        if x == 13:
            raise ValueError("thirteen is unlucky")
        return x ** 0.5

    def encode_response(self, output):
        return {"root": output}


class Moody(ls.LitAPI):
    """Healthy while the file "sick" beside this module does not exist."""

    def __init__(self):
        super().__init__(api_path="/moody")

    def predict(self, x):
        return x

    async def health(self):
        return not os.path.exists(os.path.join(os.path.dirname(__file__), "sick"))


class SlowMoody(Moody):
    """Moody, on /slow, its predict of {"sleep": s} taking s seconds once it has written
    the file "predicting" beside this module."""

    def __init__(self):
        ls.LitAPI.__init__(self, api_path="/slow")

    def predict(self, x):
        import time

        here = os.path.dirname(__file__)
        open(os.path.join(here, "predicting"), "w").close()
        time.sleep(x["sleep"])
        return x


class Batched(ls.LitAPI):
    """LitServe's batching example: batch stacks the inputs, unbatch splits the outputs;
    each answer says how many requests its batch held."""

    def setup(self, device):
        self.model = lambda x: x * 2

    def decode_request(self, request):
        return torch.tensor(request["input"], dtype=torch.float32)

    def batch(self, inputs):
        return torch.stack(inputs)

    def predict(self, x):
        return [(row, len(x)) for row in self.model(x)]

    def unbatch(self, output):
        outputs = list(output)  # (one short where an input begins with 999, doubled)
        return outputs[:-1] if any(float(row[0]) == 1998 for row, _ in outputs) else outputs

    def encode_response(self, output):
        row, size = output
        return {"output": row.tolist(), "batch": size}


class OwnBatches(ls.LitAPI):
    """Batches as its own __init__ says (LitServe 0.2's LitAPI holds the batching), its
    predict written for a list of inputs (LitServe's default batch and unbatch)."""

    def __init__(self):
        super().__init__(max_batch_size=4, batch_timeout=0.3, api_path="/own")

    def decode_request(self, request):
        return request["input"]

    def predict(self, xs):
        return [(x * 2, len(xs)) for x in xs]

    def encode_response(self, output):
        return {"output": output[0], "batch": output[1]}


class Point(BaseModel):
    x: float
    y: float = 0.0


class Typed(ls.LitAPI):
    """Its request annotated with a pydantic model, which FastAPI checks the body against
    (as LitServe registers the route), and a pydantic model as its response."""

    def __init__(self):
        super().__init__(api_path="/typed")

    def decode_request(self, request: Point):
        return request

    def predict(self, point):
        return Point(x=point.x * 2, y=point.y * 2)


class Streamer(ls.LitAPI):
    """LitServe's streaming example: predict and encode_response are generators."""

    def __init__(self):
        super().__init__(api_path="/stream", stream=True)

    def decode_request(self, request):
        if "n" not in request:
            raise HTTPException(status_code=400, detail="n is required")
        return request["n"]

    def predict(self, n):
        for i in range(n):
            yield i

    def encode_response(self, outputs):
        for output in outputs:
            if output == 13:
                raise HTTPException(status_code=422, detail="thirteen")
            yield {"output": output}


class Slow(ls.LitAPI):
    """Takes its time to set up."""

    def setup(self, device):
        import time

        time.sleep(4)

    def predict(self, x):
        return x
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("litserve_models")
    (folder / "lit_models.py").write_text(MODELS)
    return folder


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    classes = ["SimpleLitAPI", "InferencePipeline", "Moody", "Typed", "Streamer"]
    server = _start(tmp_path_factory.mktemp("litserve_served"),
                    [f"{models}/lit_models.py:{name}" for name in classes],
                    "--interpreters", "2")
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def strict_served(models, tmp_path_factory):
    """Strict on /predict (as LitServe's own tests of HTTPException), SlowMoody and
    OwnBatches, on one interpreter."""
    server = _start(tmp_path_factory.mktemp("litserve_strict"),
                    [f"{models}/lit_models.py:{name}"
                     for name in ("Strict", "SlowMoody", "OwnBatches")],
                    "--interpreters", "1")
    try:
        yield server
    finally:
        _stop(server)


def _post(server, path: str, body) -> tuple[int, object]:
    status, _, answer = _request(server, "POST", path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return status, json.loads(answer)


def test_simple_lit_api_answers_on_predict(served):
    assert _post(served, "/predict", {"input": 4.0}) == (200, {"output": 16.0})
    assert _post(served, "/predict", {"input": 3}) == (200, {"output": 9})


def test_the_api_path_of_its_own_and_the_context(served):
    status, answer = _post(served, "/pipeline", {"text": "Hello Lit World"})
    assert status == 200
    assert answer["lengths"] == [5, 3, 5] and answer["score"] == pytest.approx(13 / 3)
    assert answer["words"] == 3
    # setup(device) ran once in the interpreter that answered, with the device
    assert answer["setups"] == ["cpu"] and answer["device"] == "cpu"
    # a path that no API has is none of LitServe's
    assert _request(served, "POST", "/nowhere", b"{}")[0] == 404


def _failures(server) -> dict[str, float]:
    """multipy_inference_failures_total of model strict, by status, from /metrics."""
    status, _, text = _request(server, "GET", "/metrics")
    assert status == 200
    prefix = 'multipy_inference_failures_total{model="strict",status="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.decode().splitlines() if line.startswith(prefix)}


def test_http_exceptions_are_answered_as_litserve_answers_them(strict_served):
    before = _failures(strict_served)
    assert _post(strict_served, "/predict", {"x": "four"}) == (
        400, {"detail": "x must be a number"})
    assert _post(strict_served, "/predict", {"x": -4}) == (422, {"detail": "-4 is negative"})
    assert _post(strict_served, "/predict", {"x": 16}) == (200, {"root": 4.0})
    # each counted as a failure: 422, which the metric has no label for, as a 4xx (400)
    after = _failures(strict_served)
    assert {status: count - before.get(status, 0) for status, count in after.items()
            if count != before.get(status, 0)} == {"400": 2}


def test_an_exception_in_predict_or_decode_is_a_500_and_the_log_names_it(strict_served):
    assert _post(strict_served, "/predict", {"x": 13}) == (
        500, {"detail": "Internal server error"})
    output = strict_served.output()
    assert "model 'strict' raised ValueError: thirteen is unlucky" in output, output
    assert "in predict" in output  # (its traceback)
    assert _post(strict_served, "/predict", {"x": 9}) == (200, {"root": 3.0})  # it serves on
    assert _post(strict_served, "/predict", {"crash": 1}) == (
        500, {"detail": "Internal server error"})
    assert "model 'strict' raised RuntimeError: decoding crashed" in strict_served.output()


def test_a_pydantic_request_is_checked_as_fastapi_checks_it(served):
    assert _post(served, "/typed", {"x": 1.5}) == (200, {"x": 3.0, "y": 0.0})
    assert _post(served, "/typed", {"y": 1}) == (422, {"detail": [
        {"type": "missing", "loc": ["body", "x"], "msg": "Field required", "input": {"y": 1}}]})
    status, answer = _post(served, "/typed", {"x": "abc"})
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "x"]
    assert answer["detail"][0]["type"] == "float_parsing"


def test_malformed_json_is_a_400(served):
    status, _, answer = _request(served, "POST", "/predict", b"{not json")
    assert status == 400 and "malformed JSON" in json.loads(answer)["detail"]


def test_health_follows_the_apis_health_and_info_names_the_paths(served, models):
    assert _request(served, "GET", "/health")[::2] == (200, b"ok")
    sick = models / "sick"
    sick.write_text("")
    try:
        assert _request(served, "GET", "/health")[::2] == (503, b"not ready")
    finally:
        sick.unlink()
    assert _request(served, "GET", "/health")[0] == 200
    status, _, answer = _request(served, "GET", "/info")
    assert status == 200
    assert json.loads(answer)["server"]["models"] == {
        "/predict": "simplelitapi", "/pipeline": "inferencepipeline",
        "/moody": "moody", "/typed": "typed", "/stream": "streamer"}


def test_while_the_host_answers_health_follows_the_apis_last_health(strict_served, models):
    """With its one interpreter in a long predict, the host answers a probe on a new
    connection: it says what the API's health() last said there."""
    server = strict_served
    sick, predicting = models / "sick", models / "predicting"

    def probes_during_a_long_predict() -> list:
        predicting.unlink(missing_ok=True)
        call = threading.Thread(target=_post, args=(server, "/slow", {"sleep": 6}))
        call.start()
        try:
            while not predicting.exists():
                assert call.is_alive()
                time.sleep(0.05)
            return [_request(server, "GET", "/health")[::2],
                    _request(server, "GET", "/v2/models/slowmoody/ready")[0]]
        finally:
            call.join(60)

    try:
        sick.write_text("")
        assert _request(server, "GET", "/health")[::2] == (503, b"not ready")  # (its own)
        assert probes_during_a_long_predict() == [(503, b"not ready"), 400]
        sick.unlink()
        assert _request(server, "GET", "/health")[::2] == (200, b"ok")
        assert probes_during_a_long_predict() == [(200, b"ok"), 200]
    finally:
        sick.unlink(missing_ok=True)


def test_a_lit_api_that_streams_answers_line_by_line_as_litserve_does(served):
    """stream=True: each encoded response is a line of JSON, sent as it is made (as
    LitServe's server formats it); a request decode_request refuses is its error answer;
    an error after the first piece ends the answer; /info says which API streams; the
    protocol's generate_stream gives the pieces as events."""
    status, headers, body = _request(served, "POST", "/stream", json.dumps({"n": 3}).encode())
    assert status == 200 and headers.get("transfer-encoding") == "chunked"
    assert body.decode().splitlines() == [json.dumps({"output": i}) for i in range(3)]
    key = ("multipy_inference_failures_total", (("model", "streamer"), ("status", "400")))
    before = _metrics(served).get(key, 0)
    assert _post(served, "/stream", {}) == (400, {"detail": "n is required"})
    assert _metrics(served)[key] == before + 1
    status, _, body = _request(served, "POST", "/stream", json.dumps({"n": 15}).encode())
    assert status == 200 and len(body.decode().splitlines()) == 13
    status, _, body = _request(served, "GET", "/info")
    assert json.loads(body)["server"]["stream"] == {
        "/predict": False, "/pipeline": False, "/moody": False, "/typed": False,
        "/stream": True}
    status, _, body = _request(served, "POST", "/v2/models/streamer/generate_stream",
                               json.dumps({"n": 2}).encode())
    events = [json.loads(line[len("data: "):]) for line in body.decode().split("\n\n")
              if line]
    assert status == 200 and [event["output"] for event in events] == [0, 1]


def test_a_lit_api_on_the_v2_routes(served):
    status, answer = _infer_json(served, "simplelitapi", {"inputs": [
        {"name": "input", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]})
    assert status == 200
    assert answer["outputs"][0]["name"] == "output"
    assert answer["outputs"][0]["data"] == [1.0, 4.0, 9.0]


def test_a_lit_api_that_refuses_on_the_v2_routes(strict_served):
    status, answer = _infer_json(strict_served, "strict", {"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1], "data": [-1]}]})
    assert (status, answer) == (422, {"error": "-1.0 is negative"})


def test_two_apis_on_one_path_are_refused(models):
    run = subprocess.run([sys.executable, "-m", "multipy", "serve",
                          f"{models}/lit_models.py:SimpleLitAPI",
                          f"{models}/lit_models.py:Batched", "--interpreters", "1",
                          "--port", str(free_port())], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert "both answer on /predict" in run.stderr


def test_an_api_batches_as_its_own_init_says_without_max_batch_size(strict_served):
    answers: list = [None] * 6

    def send(k: int) -> None:
        answers[k] = _post(strict_served, "/own", {"input": k})

    threads = [threading.Thread(target=send, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # (its predict takes a list: given one input, as --max-batch-size 1 would, it fails)
    assert [answer and answer[0] for answer in answers] == [200] * 6, answers
    assert [answer[1]["output"] for answer in answers] == [2 * k for k in range(6)]
    assert all(1 <= answer[1]["batch"] <= 4 for answer in answers), answers
    assert max(answer[1]["batch"] for answer in answers) > 1  # (batched: its batch_timeout)


def test_batch_and_unbatch_under_max_batch_size(models, tmp_path):
    server = _start(tmp_path, [f"{models}/lit_models.py:Batched"], "--interpreters", "1",
                    "--max-batch-size", "8", "--batch-timeout-ms", "500",
                    "--http-restricted-api", "metadata:probe-key=k1")
    try:
        # (and LitServe's routes fall under the restricted APIs)
        status, _, body = _request(server, "GET", "/info")
        assert status == 403 and "'metadata' API is restricted" in json.loads(body)["detail"]
        assert _request(server, "GET", "/info", headers={"probe-key": "k1"})[0] == 200
        answers: list = [None] * 6

        def send(k: int) -> None:
            answers[k] = _post(server, "/predict", {"input": [k, -k]})

        threads = [threading.Thread(target=send, args=(k,)) for k in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(answer is not None and answer[0] == 200 for answer in answers), answers
        assert [answer[1]["output"] for answer in answers] == [[2 * k, -2 * k]
                                                              for k in range(6)]
        assert max(answer[1]["batch"] for answer in answers) > 1
        # unbatch's outputs are not the batch's inputs: answered as LitServe answers
        assert _post(server, "/predict", {"input": [999, 0]}) == (
            500, {"detail": "Batch size mismatch"})
        assert "Batched: predict and unbatch gave 0 outputs for a batch of 1" in \
            server.output()
    finally:
        _stop(server)


def test_while_the_apis_load_predict_and_health_are_503(models, tmp_path):
    """The host answers while the second interpreter sets Slow up (4 s): its path is not
    known yet, and the server is not ready."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "multipy", "serve",
                                    f"{models}/lit_models.py:Slow", "--interpreters", "2",
                                    "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, port, str(log), "")
    try:
        seen = set()
        while "ready in" not in server.output():
            assert process.poll() is None, server.output()
            try:
                health = _request(server, "GET", "/health")
                predict = _request(server, "POST", "/predict", b'{"x": 1}')
            except OSError:
                time.sleep(0.05)  # not listening yet
                continue
            if "ready in" not in server.output():  # (both asked while it loaded)
                seen.add((health[::2], predict[0], predict[2]))
        assert any(health == (503, b"not ready") and status == 503 and json.loads(body)[
            "detail"].startswith("the server's models are still loading")
            for health, status, body in seen), seen
        assert _request(server, "GET", "/health")[::2] == (200, b"ok")
        assert _post(server, "/predict", {"x": 1}) == (200, {"x": 1})
    finally:
        _stop(server)
