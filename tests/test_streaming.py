"""Streamed answers: a model class whose predict is a generator (or an async one) answers
in pieces, over Triton's generate extension (``/generate_stream``: Server-Sent Events,
each written as it is made) and gRPC's ModelStreamInfer; several streams at once; a
client that goes away ends its model's stream (its ``finally`` runs); --timeout bounds
a stream; ``/generate`` and ``/infer`` answer a model's one piece; the generate request's
own decoding.
"""
from __future__ import annotations

import json
import os
import queue
import threading

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("starlette")
grpcclient = pytest.importorskip("tritonclient.grpc")

from conftest import until, write_one  # noqa: E402
from serving import _Events, _grpc_port, _metrics, _request, _start, _stop  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODELS = '''
import asyncio
import os

import numpy as np


def _text(inputs, name):
    value = inputs.get(name)
    return None if value is None else value.reshape(-1)[0].decode()


def _noted(path, made):
    if path is not None:
        with open(path, "w") as f:
            f.write(str(made))


class Counter:
    """n pieces {"token": "t<i>", "index": i}; before piece i after the first, a byte
    from the FIFO gate<i>, if gate is given; in its finally, how many pieces it made,
    into note."""

    def predict(self, inputs):
        n, gate, note = int(inputs["n"].reshape(-1)[0]), _text(inputs, "gate"), _text(inputs, "note")
        made = 0
        try:
            for i in range(n):
                if gate is not None and i:  # (a FIFO of its own for each step)
                    with open(f"{gate}{i}", "rb") as f:
                        f.read(1)
                made += 1
                yield {"token": f"t{i}", "index": np.array([i], dtype=np.int64)}
        finally:
            _noted(note, made)


class Ticker:
    """Counter's pieces from an async generator: before each piece after the first, it
    waits (awaiting, the loop free) until the file go exists, if given."""

    async def predict(self, inputs):
        n, go, note = int(inputs["n"].reshape(-1)[0]), _text(inputs, "go"), _text(inputs, "note")
        made = 0
        try:
            for i in range(n):
                while go is not None and i and not os.path.exists(go):
                    await asyncio.sleep(0.01)
                made += 1
                yield {"token": f"t{i}", "index": np.array([i], dtype=np.int64)}
        finally:
            _noted(note, made)


class Breaks:
    """One piece, then an error."""

    def predict(self, inputs):
        yield {"token": "first"}
        raise ValueError("broke after the first piece")


class Threads:
    """Two pieces, each the name of the thread that made it."""

    def predict(self, inputs):
        import threading

        for _ in range(2):
            yield {"thread": threading.current_thread().name}


class Doubles:
    """Returns (does not stream): x doubled."""

    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streaming")
    (folder / "streams.py").write_text(MODELS)
    return folder


def _paths(models) -> list[str]:
    return [f"{models}/streams.py:{name}"
            for name in ("Counter", "Ticker", "Breaks", "Threads", "Doubles")]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """The four models on two interpreters, with gRPC."""
    served = _start(tmp_path_factory.mktemp("stream_server"), _paths(models),
                    "--interpreters", "2", "--grpc-port", "0")
    yield served
    _stop(served)


@pytest.fixture(scope="module")
def timed(models, tmp_path_factory):
    """The same with --timeout 3: each step on the interpreter's call thread."""
    served = _start(tmp_path_factory.mktemp("stream_timed"), _paths(models),
                    "--interpreters", "2", "--timeout", "3")
    yield served
    _stop(served)


def _tokens(events: list[dict]) -> list[str]:
    return [event["token"] for event in events]


def test_pieces_arrive_as_the_model_makes_them(server, tmp_path):
    """Each event is written before the model makes the next piece: the model waits on
    a FIFO for each, and the test reads each event before it lets the model go on."""
    gate = tmp_path / "gate"
    for i in (1, 2):
        os.mkfifo(f"{gate}{i}")
    events = _Events(server, "counter", {"n": 3, "gate": str(gate), "id": "s1"})
    try:
        assert events.status == 200
        assert events.headers["content-type"].startswith("text/event-stream")
        for i in range(3):
            event = events.next()
            assert event == {"model_name": "counter", "model_version": "1", "id": "s1",
                             "token": f"t{i}", "index": i}
            if i < 2:
                until(lambda: write_one(f"{gate}{i + 1}"))
        assert events.next() is None
    finally:
        events.close()


def test_four_streams_at_once_share_two_interpreters(server, tmp_path):
    """Four streams of an async generator, each waiting between pieces: the first
    piece of every one arrives while all four are open (on two interpreters), then each
    gets all of its own pieces, in order."""
    go = tmp_path / "go"
    streams = [_Events(server, "ticker", {"n": 4, "go": str(go), "id": f"r{k}"})
               for k in range(4)]
    try:
        firsts = [stream.next() for stream in streams]
        assert [(event["id"], event["token"]) for event in firsts] == \
            [(f"r{k}", "t0") for k in range(4)]
        go.write_text("")
        for k, stream in enumerate(streams):
            rest = stream.rest()
            assert _tokens(rest) == ["t1", "t2", "t3"] and {e["id"] for e in rest} == {f"r{k}"}
    finally:
        for stream in streams:
            stream.close()


def test_sync_streams_from_many_threads_each_get_their_own(server):
    answers: dict[int, list[dict]] = {}

    def run(k: int) -> None:
        events = _Events(server, "counter", {"n": 5 + k, "id": f"c{k}"})
        try:
            answers[k] = events.rest()
        finally:
            events.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for k in range(4):
        assert _tokens(answers[k]) == [f"t{i}" for i in range(5 + k)]
        assert [event["index"] for event in answers[k]] == list(range(5 + k))


@pytest.mark.parametrize("model", ["counter", "ticker"])
def test_a_client_that_goes_ends_its_model_s_stream(server, tmp_path, model):
    """The client reads one piece and goes: the model's stream ends at its next step
    (ticker: awaiting between steps, with one piece of ten made; counter: blocked in C
    in a step, let go on once the client has gone), its finally runs, the request counts
    as 499, and the interpreters answer on."""
    note, gate = tmp_path / "note", tmp_path / "gate"
    request = {"n": 10, "note": str(note)}
    if model == "counter":
        for i in range(1, 10):
            os.mkfifo(f"{gate}{i}")
        request["gate"] = str(gate)
    else:
        request["go"] = str(tmp_path / "never")
    key = ("multipy_inference_failures_total", (("model", model), ("status", "499")))
    before = _metrics(server).get(key, 0)
    events = _Events(server, model, request)
    assert events.next()["token"] == "t0"
    events.close()
    if model == "counter":  # (blocked in C, its step stops at its next bytecode: it is
        # let go on until it has, at most a few pieces later)
        until(lambda: note.exists() or any(write_one(f"{gate}{i}") for i in range(1, 10))
              and False)
        until(lambda: note.read_text() != "")
        assert 1 <= int(note.read_text()) < 10
    else:
        until(lambda: note.exists() and note.read_text() == "1")
    until(lambda: _metrics(server).get(key, 0) == before + 1)
    _assert_idle(server, model)
    status, _, body = _request(server, "POST", f"/v2/models/{model}/generate",
                               json.dumps({"n": 1}).encode())
    assert status == 200 and json.loads(body)["token"] == "t0"


def _assert_idle(server, model: str) -> None:
    """No interpreter is busy with model, and none of its requests waits."""
    until(lambda: _metrics(server)[("multipy_busy_interpreters", (("model", model),))] == 0)
    assert _metrics(server)[("multipy_inference_queue_length", (("model", model),))] == 0


def test_an_error_mid_stream_is_an_error_event_and_before_it_an_error_answer(server):
    events = _Events(server, "breaks", {"x": 1})
    try:
        assert events.next()["token"] == "first"
        error = events.next()
        assert "broke after the first piece" in error["error"] and events.next() is None
    finally:
        events.close()
    status, _, body = _request(server, "POST", "/v2/models/nothing/generate_stream",
                               json.dumps({"n": 1}).encode())
    assert status == 404 and "unknown model 'nothing'" in json.loads(body)["error"]
    status, _, body = _request(server, "POST", "/v2/models/counter/generate_stream", b"[1]")
    assert status == 400 and "JSON object" in json.loads(body)["error"]


def test_generate_and_infer_answer_one_piece_and_a_model_that_returns(server):
    def post(path: str, request: dict) -> tuple[int, dict]:
        status, _, body = _request(server, "POST", path, json.dumps(request).encode())
        return status, json.loads(body)

    assert post("/v2/models/doubles/generate", {"x": [1.5, 2.0], "id": "d"}) == \
        (200, {"model_name": "doubles", "model_version": "1", "id": "d", "y": [3.0, 4.0]})
    events = _Events(server, "doubles", {"x": 3})
    try:
        assert events.rest() == [{"model_name": "doubles", "model_version": "1", "y": 6}]
    finally:
        events.close()
    assert post("/v2/models/counter/generate", {"n": 1}) == \
        (200, {"model_name": "counter", "model_version": "1", "token": "t0", "index": 0})
    status, answer = post("/v2/models/counter/generate", {"n": 2})
    assert status == 400 and "generate_stream" in answer["error"]
    status, answer = post("/v2/models/counter/infer", {"inputs": [
        {"name": "n", "datatype": "INT64", "shape": [1], "data": [1]}]})
    assert status == 200 and {o["name"]: o["data"] for o in answer["outputs"]} == \
        {"token": ["t0"], "index": [0]}


def test_metrics_count_the_pieces_sent_and_a_stream_as_one_request_and_call(server):
    keys = [(name, (("model", "counter"),)) for name in (
        "multipy_streamed_pieces_total", "multipy_inference_requests_total",
        "multipy_model_calls_total")]
    before = _metrics(server)
    events = _Events(server, "counter", {"n": 7})
    try:
        assert len(events.rest()) == 7
    finally:
        events.close()
    until(lambda: [_metrics(server)[key] - before[key] for key in keys] == [7, 1, 1])
    _assert_idle(server, "counter")


def test_grpc_streams_pieces_with_the_final_flag_and_errors_per_request(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        n = grpcclient.InferInput("n", [1], "INT64")
        n.set_data_from_numpy(np.array([3], dtype=np.int64))
        client.async_stream_infer("counter", [n], request_id="g1",
                                  enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            assert response.id == "g1"
            if response.parameters["triton_final_response"].bool_param:
                assert not response.outputs
                break
            pieces.append((result.as_numpy("token").reshape(-1)[0],
                           int(result.as_numpy("index")[0])))
        assert pieces == [(b"t0", 0), (b"t1", 1), (b"t2", 2)]
        client.async_stream_infer("counter", [n], request_id="g2")
        got = [answers.get(timeout=60) for _ in range(3)]
        assert [result.get_response().id for result, _ in got] == ["g2"] * 3
        assert all("triton_final_response" not in r.get_response().parameters for r, _ in got)
        client.async_stream_infer("breaks", [n], request_id="g3")
        result, error = answers.get(timeout=60)
        assert error is None and result.as_numpy("token").reshape(-1)[0] == b"first"
        result, error = answers.get(timeout=60)
        assert result is None and "broke after the first piece" in str(error)
    finally:
        client.stop_stream()
        client.close()


def test_a_cancelled_grpc_stream_ends_its_model_s_stream(server, tmp_path):
    note = tmp_path / "note"
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = []
    for name, value, datatype in (("n", np.array([10], dtype=np.int64), "INT64"),
                                  ("go", np.array([str(tmp_path / "never").encode()],
                                                  dtype=object), "BYTES"),
                                  ("note", np.array([str(note).encode()], dtype=object),
                                   "BYTES")):
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    try:
        client.async_stream_infer("ticker", inputs, request_id="c1")
        result, error = answers.get(timeout=60)
        assert error is None and result.as_numpy("token").reshape(-1)[0] == b"t0"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    until(lambda: note.exists() and note.read_text() == "1")
    until(lambda: _metrics(server).get(("multipy_inference_failures_total", (
        ("model", "ticker"), ("status", "499"))), 0) >= 1)
    _assert_idle(server, "ticker")
    status, _, body = _request(server, "POST", "/v2/models/ticker/generate",
                               json.dumps({"n": 1}).encode())
    assert status == 200 and json.loads(body)["token"] == "t0"


def test_timeout_bounds_a_stream_and_steps_run_on_the_call_thread(server, timed, tmp_path):
    events = _Events(timed, "counter", {"n": 4})
    try:
        assert _tokens(events.rest()) == ["t0", "t1", "t2", "t3"]
    finally:
        events.close()
    threads = {}
    for name, served in (("timed", timed), ("plain", server)):
        events = _Events(served, "threads", {"x": 1})
        try:
            threads[name] = [event["thread"] for event in events.rest()]
        finally:
            events.close()
    # (with --timeout, the interpreter's call thread; else the thread of its loop, a host
    # thread that entered it)
    assert threads["timed"] == ["multipy-serve-call"] * 2
    assert len(set(threads["plain"])) == 1 and threads["plain"][0] != "multipy-serve-call"
    note = tmp_path / "note"
    events = _Events(timed, "ticker", {"n": 3, "go": str(tmp_path / "never"),
                                       "note": str(note)})
    try:
        assert events.next()["token"] == "t0"
        error = events.next()
        assert "did not answer within 3.0 s (--timeout)" in error["error"]
        assert events.next() is None
    finally:
        events.close()
    until(lambda: note.exists() and note.read_text() == "1")


@pytest.mark.parametrize("body, described, found", [
    ({"text": "hello", "k": 3, "p": 0.5, "flag": True},
     None, [("text", "BYTES", [1], [b"hello"]), ("k", "INT64", [1], [3]),
            ("p", "FP32", [1], [0.5]), ("flag", "BOOL", [1], [True])]),
    ({"x": [[1, 2], [3, 4]], "id": "q", "parameters": {"max_tokens": 4}},
     None, [("x", "INT64", [2, 2], [1, 2, 3, 4])]),
    ({"x": [1, 2, 3]}, [{"name": "x", "datatype": "FP16", "shape": [-1, 3]}],
     [("x", "FP16", [1, 3], [1, 2, 3])]),
    ({"x": [1.5, 1e300]}, None, [("x", "FP64", [2], [1.5, 1e300])]),
])
def test_a_generate_request_s_inputs(body, described, found):
    from multipy.serve.request.generate import generate_request

    request = generate_request(json.dumps(body).encode(), described)
    assert [(t.name, t.datatype, list(t.array.shape), t.array.reshape(-1).tolist())
            for t in request.inputs] == found
    assert request.id == body.get("id") and request.parameters == body.get("parameters", {})


@pytest.mark.parametrize("body, says", [
    ({"id": "only"}, "names no input"),
    ({"x": [[1, 2], [3]]}, "of one length"),
    ({"x": [1, "a"]}, "mixes values"),
    ({"x": 1, "id": 5}, '"id" must be a string'),
    ({"x": {"a": 1}}, "mixes values"),
])
def test_a_generate_request_that_is_not_one_says_why(body, says):
    from multipy.serve.request.generate import generate_request
    from multipy.serve.request.messages import ProtocolError

    with pytest.raises(ProtocolError, match=says):
        generate_request(json.dumps(body).encode(), None)
