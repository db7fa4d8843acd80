"""Calls that run too long, end the wrong way, or lose their client: --timeout (calls
cancelled, interpreters stuck in C named, counted and passed by, their clients moved),
SystemExit from a model, a client that leaves and a gRPC deadline (499), a front end's
call worker driven by hand, and a crash's report; on the shared servers ``served``
(--timeout 5) and ``per_loop`` (conftest.py).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import threading
import time
from typing import Iterator

import pytest

from conftest import until, write_one

np = pytest.importorskip("numpy")
from serving import (Server, _client_error, _grpc_alone, _grpc_input, _infer_json,  # noqa: E402
                     _input, _metrics, _request, _send_slow, _start, _stop)
from tritonclient.utils import InferenceServerException  # noqa: E402


def _busy(server: Server, model: str) -> float:
    return _metrics(server)[("multipy_busy_interpreters", (("model", model),))]


def test_interpreters_stuck_past_the_timeout_are_named_counted_and_passed_by(served, tmp_path):
    """Calls blocked in C run on past --timeout (5 s) in both interpreters: their
    requests get a 500 naming their model; then the server is not ready and says why,
    counts 2 stuck interpreters, answers liveness at once, and answers another model's
    request with a 503 naming the model that holds them; once the calls end, it serves
    again."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    answers: list = []

    def blocked(fifo: str) -> None:
        path = np.frombuffer(fifo.encode(), np.uint8)
        try:
            served.client().infer("blocks", [_input("path", path, "UINT8", True)])
            answers.append(None)
        except InferenceServerException as error:
            answers.append(error)

    threads = []
    for k, fifo in enumerate(fifos):  # one on each interpreter: the second goes to the free one
        threads.append(threading.Thread(target=blocked, args=(fifo,)))
        threads[-1].start()
        until(lambda: _busy(served, "blocks") == k + 1)
    try:
        for thread in threads:
            thread.join(timeout=60)
        assert [a.status() for a in answers] == ["500", "500"], answers
        assert all("'blocks' did not answer" in a.message() for a in answers)
        status, _, body = _request(served, "GET", "/v2/health/ready")
        reason = json.loads(body)["error"]
        assert status == 400 and "no interpreter can take a call" in reason and "'blocks'" in reason
        status, _, body = _request(served, "GET", "/v2/models/cast/ready")
        assert status == 400 and "'blocks'" in json.loads(body)["error"]
        assert _request(served, "GET", "/v2/health/live")[0] == 200
        assert _metrics(served)[("multipy_stuck_interpreters", ())] == 2
        status, answer = _infer_json(served, "cast", {"inputs": [
            {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert status == 503 and "'blocks'" in answer["error"], answer
    finally:
        for fifo in fifos:
            until(lambda: write_one(fifo))
    # (each interpreter is free again once its own call has ended: one may be first)
    until(lambda: _metrics(served)[("multipy_stuck_interpreters", ())] == 0)
    assert _request(served, "GET", "/v2/health/ready")[0] == 200
    status, answer = _infer_json(served, "cast", {"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
    assert status == 200 and answer["outputs"][0]["data"] == [1.0]


def test_a_request_past_the_timeout_is_answered_and_cancelled(served):
    seconds = np.array([30.0], np.float32)  # --timeout is 5
    client = served.client()
    with pytest.raises(InferenceServerException) as timed_out:
        client.infer("slow", [_input("seconds", seconds, "FP32", True)])
    assert timed_out.value.status() == "500" and "did not answer" in timed_out.value.message()
    # Cancelled inside, the call stops long before its 30 s: then two calls at once each
    # run alone in an interpreter.  (While the call runs on, the load balancer sends both
    # to the other interpreter, where they run together.)
    quick = np.array([0.3], np.float32)
    deadline = time.monotonic() + 15
    while True:
        answers = []
        pair = [threading.Thread(target=lambda: answers.append(served.client().infer(
            "slow", [_input("seconds", quick, "FP32", True)]))) for _ in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join(timeout=30)
        assert [a.as_numpy("doubled")[0] for a in answers] == [np.float32(0.6)] * 2
        if [a.as_numpy("together")[0] for a in answers] == [1, 1]:
            break
        assert time.monotonic() < deadline, "the timed-out call was not cancelled"


def _exits(connection: http.client.HTTPConnection, x: float) -> tuple[int, dict]:
    """Model exits's answer to x on connection: (status, its JSON)."""
    connection.request("POST", "/v2/models/exits/infer", body=json.dumps({"inputs": [
        {"name": "x", "shape": [1], "datatype": "FP32", "data": [x]}]}).encode())
    response = connection.getresponse()
    return response.status, json.loads(response.read())


@contextlib.contextmanager
def _by_interpreter(server: Server, enough) -> Iterator[dict[int, list]]:
    """Keep-alive connections to server, opened one at a time (at most 8) until
    enough(found) holds, found mapping each interpreter (the thread that runs model exits
    there) to its connections, in order; closed at the end.  (Connections open at once
    go to different interpreters.)"""
    found: dict[int, list[http.client.HTTPConnection]] = {}
    connections: list[http.client.HTTPConnection] = []
    try:
        while not enough(found):
            assert len(connections) < 8, found
            connections.append(http.client.HTTPConnection("127.0.0.1", server.port, timeout=60))
            status, answer = _exits(connections[-1], 1)
            assert status == 200, answer
            found.setdefault(answer["outputs"][0]["data"][0], []).append(connections[-1])
        yield found
    finally:
        for connection in connections:
            connection.close()


def _system_exit_is_the_models_error(server: Server) -> None:
    """On a connection to each interpreter (told apart by the thread that runs the model),
    a model that raises SystemExit gets a 500 naming it; then each interpreter answers
    the next requests, on the same thread, and none is left busy or stuck."""
    with _by_interpreter(server, lambda found: len(found) == 2) as found:
        by_thread = {thread: connections[0] for thread, connections in found.items()}
        for connection in by_thread.values():
            status, answer = _exits(connection, -1)
            assert (status, answer) == (500, {"error": "model 'exits' raised SystemExit: asked to"})
        for thread, connection in by_thread.items():
            for _ in range(3):
                status, answer = _exits(connection, 1)
                assert status == 200 and answer["outputs"][0]["data"] == [thread], answer
    assert _busy(server, "exits") == 0
    assert _metrics(server)[("multipy_stuck_interpreters", ())] == 0


def test_a_model_that_raises_system_exit_under_the_timeout_is_answered(served):
    _system_exit_is_the_models_error(served)


def test_a_model_that_raises_system_exit_on_the_loop_is_answered(per_loop):
    _system_exit_is_the_models_error(per_loop)


def _slow_answer(connection: http.client.HTTPConnection) -> dict[str, list]:
    """The slow model's answer to what _send_slow sent on connection: each output's data."""
    response = connection.getresponse()
    answer = json.loads(response.read())
    assert response.status == 200, answer
    return {output["name"]: output["data"] for output in answer["outputs"]}


def _gone(server: Server) -> float:
    """How many of the slow model's requests were answered 499: their client went away."""
    return _metrics(server).get(("multipy_inference_failures_total",
                                 (("model", "slow"), ("status", "499"))), 0)


def test_a_call_whose_client_leaves_is_cancelled_and_counted(served):
    """A client closes its connection while its call runs (4.5 s in Python, within
    --timeout): the call is cancelled and its request counted as 499, and the next
    request on that interpreter is answered, the abandoned call never having run to
    its end."""
    with _by_interpreter(served, lambda found: any(len(c) == 2 for c in found.values())) \
            as found:
        leaving, staying = next(c for c in found.values() if len(c) == 2)
        ended = _slow_answer(_send_slow(served, 0, staying))["ended"][0]
        gone = _gone(served)
        _send_slow(served, 4.5, leaving)
        until(lambda: _busy(served, "slow") == 1)
        leaving.close()
        until(lambda: _busy(served, "slow") == 0)
        answer = _slow_answer(_send_slow(served, 0.5, staying))
        assert answer["doubled"] == [1.0] and answer["ended"] == [ended + 1], answer
    until(lambda: _gone(served) == gone + 1)


def _grpc_thread(client) -> int:
    """The thread that runs model exits for client: its connection's interpreter's."""
    answer = client.infer("exits", [_grpc_input("x", np.ones(1, np.float32), "FP32")])
    return int(answer.as_numpy("output0")[0])


def test_a_grpc_call_past_its_deadline_is_cancelled_and_counted(served):
    """A gRPC call whose deadline (0.5 s) passes while its call runs (4.5 s in Python):
    the call is cancelled and its request counted as 499, and the channel's next call,
    on the same interpreter, is answered, the abandoned call never having run to its
    end."""
    client = _grpc_alone(served)

    def slow(seconds: float, **options):
        return client.infer("slow", [_grpc_input("seconds", np.array([seconds], np.float32),
                                                 "FP32")], **options)

    try:
        ended = slow(0).as_numpy("ended")[0]
        gone = _gone(served)
        status, _ = _client_error(lambda: slow(4.5, client_timeout=0.5))
        assert status == "StatusCode.DEADLINE_EXCEEDED"
        until(lambda: _busy(served, "slow") == 0)
        answer = slow(0.5)
        assert answer.as_numpy("doubled")[0] == 1.0
        assert answer.as_numpy("ended")[0] == ended + 1
    finally:
        client.close()
    until(lambda: _gone(served) == gone + 1)


@pytest.mark.parametrize("over", ["http", "grpc"])
def test_a_stuck_interpreters_clients_move_to_a_free_one(served, tmp_path, over):
    """A call blocked in C (its request sent over HTTP, or gRPC) passes --timeout (5 s)
    on one interpreter, stuck until the call ends: the answer to its request closes its
    connection (HTTP: Connection: close; gRPC: that interpreter's gRPC server stops, a
    GOAWAY, before it answers), and so does the 503 that another client's keep-alive
    connection to that interpreter gets next; each client's next request, on a new
    connection, reaches the other interpreter and is answered.  Once the call has
    ended, that interpreter serves gRPC again."""
    fifo = str(tmp_path / "gate")
    os.mkfifo(fifo)
    x = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [2]}]}

    def cast(connection: http.client.HTTPConnection) -> tuple[int, str | None, dict]:
        connection.request("POST", "/v2/models/cast/infer", body=json.dumps(x).encode())
        response = connection.getresponse()
        return response.status, response.getheader("connection"), json.loads(response.read())

    with _by_interpreter(served, lambda found: any(len(c) == 2 for c in found.values())) \
            as found:
        stuck, (blocked, pinned) = next((thread, c) for thread, c in found.items()
                                        if len(c) == 2)
        channels = [_grpc_alone(served)]
        while _grpc_thread(channels[-1]) != stuck:  # (the kernel picks their interpreters)
            assert len(channels) < 40
            channels.append(_grpc_alone(served))
        answers: list = []

        def block() -> None:
            path = np.frombuffer(fifo.encode(), np.uint8)
            if over == "grpc":
                answers.append(_client_error(lambda: channels[-1].infer(
                    "blocks", [_grpc_input("path", path, "UINT8")])))
                return
            blocked.request("POST", "/v2/models/blocks/infer", body=json.dumps({"inputs": [
                {"name": "path", "shape": [len(path)], "datatype": "UINT8",
                 "data": path.tolist()}]}).encode())
            response = blocked.getresponse()
            answers.append((response.status, response.getheader("connection"),
                            json.loads(response.read())["error"]))

        calling = threading.Thread(target=block)
        calling.start()
        try:
            calling.join(3)  # then pinned's keep-alive (5 s) outlasts the call
            pinned.request("GET", "/v2/health/live")
            assert pinned.getresponse().read() == b""
            calling.join(60)
            if over == "grpc":
                status, error = answers[0]
                assert status == "StatusCode.INTERNAL", error
            else:
                status, close, error = answers[0]
                assert (status, close) == (500, "close"), error
                status, _, answer = cast(blocked)
                assert status == 200 and answer["outputs"][0]["data"] == [2.0], answer
            assert "'blocks' did not answer" in error
            try:
                moved = _grpc_thread(channels[-1])
            except InferenceServerException as reset:
                # its connection again, queued on the stopped server's listening socket as
                # that closed, was reset, as docs/operate/processes.md says: gRPC's
                # UNAVAILABLE, which a client retries
                assert "UNAVAILABLE" in str(reset), reset
                channels.append(_grpc_alone(served))
                moved = _grpc_thread(channels[-1])
            assert moved != stuck
            status, close, answer = cast(pinned)
            assert (status, close) == (503, "close") and "'blocks'" in answer["error"], answer
            status, _, answer = cast(pinned)
            assert status == 200 and answer["outputs"][0]["data"] == [2.0], answer
        finally:
            until(lambda: write_one(fifo))
            calling.join(60)
            for channel in channels:
                channel.close()
    until(lambda: _metrics(served)[("multipy_stuck_interpreters", ())] == 0)

    def reaches_it() -> bool:
        client = _grpc_alone(served)
        try:
            return _grpc_thread(client) == stuck
        finally:
            client.close()

    until(reaches_it)  # (each a new connection, which the kernel gives either interpreter)


#: Run inside an interpreter: a front end's call worker, driven by hand.
WORKER = '''
import asyncio, functools, threading

import _multipy_bootstrap
from multipy._inside import front_end


class Started:
    """Counts the calls begun and ended, as the metrics do."""

    def __init__(self):
        self.entered = self.exited = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc_info):
        self.exited += 1

    def pin(self, running):  # (no digest: a server of one process)
        pass


class Series:
    def abandoned(self, stuck):
        pass


async def _cancelled_as_it_ends():
    worker = front_end._Worker(lambda: None)
    started = Started()
    run = lambda call: asyncio.wait_for(worker.run(call, started, Series(), "m"), 30)
    try:
        thread = await run(threading.get_ident)
        serial = next(front_end.serials) + 1  # the next job's
        cancelled = await run(functools.partial(_multipy_bootstrap.cancel, thread, serial))
        return cancelled, await run(lambda: "next"), started.entered, started.exited
    finally:
        worker.stop()


def cancelled_as_it_ends():
    """A job whose call, in C, cancels itself: the cancel lands as the call ends."""
    return asyncio.run(_cancelled_as_it_ends())


def cancelled_before_it_starts():
    """Whether the cancel found a call, and whether the call ran."""
    serial, ran = next(front_end.serials), []
    found = _multipy_bootstrap.cancel(threading.get_ident(), serial)
    try:
        _multipy_bootstrap.call(serial, lambda: ran.append(serial))
    except _multipy_bootstrap.CallCancelled:
        return found, ran
    raise AssertionError("not cancelled")


class _Protocol:
    def __init__(self, sock):
        self.received, self.pipeline = 10, []
        self.transport = type("Transport", (), {"get_extra_info": lambda _, key: sock})()


def waiting_with_a_closed_connection():
    """FrontEnd._waiting over three connections: one closed meanwhile (its socket's
    fileno is -1), one with 5 bytes unread, one with none: the bytes each will have read."""
    import socket, time, types
    closed, (unread, peer), (idle, idle_peer) = socket.socket(), socket.socketpair(), \
        socket.socketpair()
    closed.close()
    peer.sendall(b"12345")
    time.sleep(0.1)
    protocols = [_Protocol(closed), _Protocol(unread), _Protocol(idle)]
    front = types.SimpleNamespace(_server=types.SimpleNamespace(
        server_state=types.SimpleNamespace(connections=set(protocols))))
    try:
        return [front_end.FrontEnd._waiting(front).get(p) for p in protocols]
    finally:
        for each in (unread, peer, idle, idle_peer):
            each.close()
'''


def test_a_timeout_as_the_call_ends_leaves_the_worker_serving(manager):
    """A front end's call worker: a cancel that lands as its call ends (no bytecode runs
    between the two) is cleared there; the job is answered, its Started left, and the
    worker's next job runs.  A cancel that comes before its call means it never runs."""
    manager.register_module_source("serve_worker", WORKER)
    interpreter = manager.all_instances()[0]
    answered = interpreter.global_("serve_worker", "cancelled_as_it_ends")().deref()
    assert answered == (True, "next", 3, 3)
    assert interpreter.global_("serve_worker", "cancelled_before_it_starts")().deref() == (
        False, [])


def test_a_model_change_is_told_past_a_connection_closed_meanwhile(manager):
    """What a front end waits for before a model leaves (its connections' unread and
    pipelined requests) passes over a connection closed meanwhile: its socket's fileno
    is -1, which made the front end fail to be told of the change, and serve the model
    on as if it were loaded."""
    manager.register_module_source("serve_worker", WORKER)
    interpreter = manager.all_instances()[0]
    waiting = interpreter.global_("serve_worker", "waiting_with_a_closed_connection")().deref()
    assert waiting == [None, 15, None]


def test_a_crash_report_names_the_model_and_the_request(packages, tmp_path):
    """A model that crashes its interpreter ends the process (one address space); the
    report on stderr names the interpreter, the model and the request."""
    server = _start(tmp_path, [packages["crashes"]], "--interpreters", "1")
    try:
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _infer_json(server, "crashes", {"id": "req-42", "inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
        assert server.process.wait(timeout=60) != 0
        output = server.output()
        assert "fatal signal 11 in interpreter #0" in output, output
        assert "inference of model 'crashes', request 'req-42'" in output, output
    finally:
        _stop(server)
