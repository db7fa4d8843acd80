"""Faults on the request path of a server without --timeout, whose calls run on its
interpreter's event loop: a call whose client has gone (an HTTP connection closed, a
gRPC deadline passed) is cancelled; an unload answers the gRPC calls received before
it; every exception a model raises is the protocol's JSON error, its message bounded
in the answer and in the log; HTTP/1.0 keep-alive is answered or closed, never left
waiting.
"""
from __future__ import annotations

import json
import os
import socket

import pytest

np = pytest.importorskip("numpy")
grpcclient = pytest.importorskip("tritonclient.grpc")

from conftest import until, write_one  # noqa: E402
from serving import (_all_read, _grpc_port, _infer_json, _metrics, _request, _start,  # noqa: E402
                     _stop)

pytestmark = pytest.mark.timeout(300)

CLASSES = '''
import os
import time

import numpy as np


class Spins:
    """Runs Python for "seconds" (a day, if need be), then says how many turns it took."""

    def predict(self, inputs):
        end = time.monotonic() + float(inputs["seconds"][0])
        turns = 0
        while time.monotonic() < end:
            turns += 1
        return {"turns": np.array([turns], np.int64)}


class Sleeps:
    """Sleeps for "seconds" (holding its interpreter's loop, not its GIL)."""

    def predict(self, inputs):
        time.sleep(float(inputs["seconds"][0]))
        return {"slept": inputs["seconds"]}


class Blocks:
    """Blocked in C (reading the FIFO named by "path") until the test writes to it."""

    def predict(self, inputs):
        with open(bytes(inputs["path"].astype(np.uint8)).decode(), "rb") as fifo:
            fifo.read(1)
        return {"read": np.array([1], np.int64)}


class Who:
    """The process that answers."""

    def predict(self, inputs):
        return {"pid": np.array([os.getpid()], np.int64)}


class Raises:
    """kind 0: GeneratorExit; 1: a ValueError of a 10 MiB message; 2: KeyboardInterrupt."""

    def predict(self, inputs):
        kind = int(inputs["kind"][0])
        if kind == 0:
            raise GeneratorExit
        if kind == 1:
            raise ValueError("x" * (10 << 20))
        raise KeyboardInterrupt
'''

#: A call of Spins that no test waits for: it ends only if it is cancelled.
_FOREVER = 86400.0


def _spin(seconds: float) -> dict:
    return {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP64",
                        "data": [seconds]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Spins, Sleeps and Raises on one interpreter, over HTTP and gRPC, without
    --timeout, which the model repository's requests may unload."""
    folder = tmp_path_factory.mktemp("request_faults")
    (folder / "models.py").write_text(CLASSES)
    started = _start(folder, [f"{folder}/models.py:{name}"
                              for name in ("Spins", "Sleeps", "Raises")],
                     "--interpreters", "1", "--grpc-port", "0", "--model-control", "explicit")
    try:
        yield started
    finally:
        _stop(started)


def _running(server, model: str) -> bool:
    """Whether a call of model runs now, as /metrics says.  (Asked on a new connection,
    which the host hands to the interpreter's front end unless it is in a call: handed
    to it just as a call begins, it is answered after the call, so it is given up after
    a second, as not yet.)"""
    try:
        metrics = _metrics(server, timeout=1)
    except TimeoutError:
        return False
    return metrics[("multipy_busy_interpreters", (("model", model),))] == 1


def _gone(server) -> float:
    return _metrics(server).get(("multipy_inference_failures_total",
                                 (("model", "spins"), ("status", "499"))), 0.0)


def test_a_call_whose_http_client_closed_its_connection_is_cancelled(server):
    """The client sends a call that would run for a day and closes its connection: the
    call is cancelled (counted as 499), and the interpreter, the only one, answers the
    next request."""
    before = _gone(server)
    body = json.dumps(_spin(_FOREVER)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(b"POST /v2/models/spins/infer HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: _running(server, "spins"))  # its call has begun
    status, answer = _infer_json(server, "spins", _spin(0.01))  # (waits for the day else)
    assert status == 200 and answer["outputs"][0]["data"][0] > 0
    assert _gone(server) == before + 1


def test_a_grpc_call_whose_deadline_passed_is_cancelled(server):
    """A gRPC call past its client's deadline is cancelled at the deadline, though it
    holds the interpreter's loop: the next call is answered."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{_grpc_port(server)}")
    tensor = grpcclient.InferInput("seconds", [1], "FP64")
    tensor.set_data_from_numpy(np.array([_FOREVER]))
    with pytest.raises(Exception) as info:
        client.infer("spins", [tensor], client_timeout=0.5)
    assert "Deadline" in str(info.value) or "DEADLINE" in str(info.value)
    tensor.set_data_from_numpy(np.array([0.01]))
    answer = client.infer("spins", [tensor], client_timeout=60)
    assert answer.as_numpy("turns")[0] > 0


def test_an_unload_answers_the_grpc_calls_received_before_it(server):
    """Four gRPC calls of 1.5 s on two channels to the one interpreter (one runs, three
    wait in the gRPC server), then the model's unload: every call is answered, and a
    call after the unload is refused."""
    port = _grpc_port(server)
    channels = [grpcclient.InferenceServerClient(f"127.0.0.1:{port}") for _ in range(2)]

    def seconds(value: float) -> list:
        tensor = grpcclient.InferInput("seconds", [1], "FP64")
        tensor.set_data_from_numpy(np.array([value]))
        return [tensor]

    answers: list[str] = []

    def answered(result, error) -> None:
        answers.append(str(error) if error is not None else str(result.as_numpy("slept")[0]))

    try:
        for k in range(4):  # each call begun here, its request sent at once
            channels[k % 2].async_infer("sleeps", seconds(1.5), answered, client_timeout=60)
        # every call's request read by the server, and the first call running
        until(lambda: _all_read(port) and _running(server, "sleeps"))
        status, _, said = _request(server, "POST", "/v2/repository/models/sleeps/unload",
                                   b"{}")
        until(lambda: len(answers) == 4, 60)
        assert status == 200, said
        assert answers == ["1.5"] * 4
        with pytest.raises(Exception, match="not loaded"):
            channels[0].infer("sleeps", seconds(0.0), client_timeout=60)
    finally:
        for channel in channels:
            channel.close()
        assert _request(server, "POST", "/v2/repository/models/sleeps/load", b"{}")[0] == 200


@pytest.mark.parametrize("kind, named", [(0, "GeneratorExit"), (2, "KeyboardInterrupt")])
def test_a_base_exception_of_a_model_is_the_protocol_s_json_500(server, kind, named):
    status, answer = _infer_json(server, "raises", {"inputs": [
        {"name": "kind", "shape": [1], "datatype": "INT64", "data": [kind]}]})
    assert status == 500 and answer == {"error": f"model 'raises' raised {named}: "}
    status, answer = _infer_json(server, "spins", _spin(0.01))  # (and it serves on)
    assert status == 200


def test_a_model_s_long_message_is_cut_in_the_answer_and_in_the_log(server):
    """A model's exception of a 10 MiB message: the answer carries its first 4,096
    characters and says how many more were cut; the log line is bounded too."""
    logged = os.path.getsize(server.log)
    status, answer = _infer_json(server, "raises", {"inputs": [
        {"name": "kind", "shape": [1], "datatype": "INT64", "data": [1]}]})
    assert status == 500
    message, said = answer["error"], "model 'raises' raised ValueError: "
    assert message == f"{said}{'x' * (4096 - len(said))}... " \
                      f"[{len(said) + (10 << 20) - 4096} more characters cut]"
    # its log record, written after the answer: the message, cut, then the model's
    # traceback, cut too, at the record's end
    until(lambda: server.output()[logged:].count("more characters cut]\n") == 2)
    assert os.path.getsize(server.log) - logged < 200_000


def test_http_1_0_keep_alive_is_answered_or_closed(server):
    """Two HTTP/1.0 requests with Connection: keep-alive on one connection, sent
    together: the first is answered, and the second is too, or the connection is closed
    after the first; it is never left waiting."""
    request = b"GET /v2/health/live HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(request * 2)
        received = b""
        while True:
            piece = connection.recv(65536)  # (socket.timeout fails the test: left waiting)
            if not piece:
                break
            received += piece
            if received.count(b"HTTP/1.1 200 ") == 2:
                break
    assert received.startswith(b"HTTP/1.1 200 ")


def test_a_grpc_channel_leaves_a_stuck_process_for_another(tmp_path):
    """Two processes of one interpreter each, --timeout 1: a call blocked in C passes
    the timeout on the process of a gRPC channel, whose interpreter is stuck until the
    call ends; the channel's next calls are answered by the other process (its server
    stops, a GOAWAY, while an interpreter of another process is free), not refused.  The
    channel retries UNAVAILABLE, as docs/operate/processes.md asks of gRPC clients: its
    reconnection may land in the stopping server's queue before the listener closes,
    and that connection is reset."""
    (tmp_path / "models.py").write_text(CLASSES)
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    server = _start(tmp_path, [f"{tmp_path}/models.py:Blocks", f"{tmp_path}/models.py:Who"],
                    "--processes", "2", "--interpreters", "1", "--timeout", "1",
                    "--grpc-port", "0")
    retry = {"methodConfig": [{"name": [{}], "retryPolicy": {
        "maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}
    channel = grpcclient.InferenceServerClient(
        f"127.0.0.1:{_grpc_port(server)}",
        channel_args=[("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(retry))])

    def who() -> int:
        tensor = grpcclient.InferInput("x", [1], "INT64")
        tensor.set_data_from_numpy(np.array([1]))
        return int(channel.infer("who", [tensor], client_timeout=60).as_numpy("pid")[0])

    try:
        for _ in range(4):  # (new connections, handed in turn: each process takes some)
            assert _request(server, "GET", "/v2/health/live")[0] == 200
        stuck = who()
        path = np.frombuffer(fifo.encode(), np.uint8)
        tensor = grpcclient.InferInput("path", [len(path)], "UINT8")
        tensor.set_data_from_numpy(path)
        with pytest.raises(Exception, match="did not answer within 1"):
            channel.infer("blocks", [tensor], client_timeout=60)
        assert stuck not in [who() for _ in range(3)]
    finally:
        until(lambda: write_one(fifo))
        channel.close()
        _stop(server)
