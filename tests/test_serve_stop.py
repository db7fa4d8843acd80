"""SIGTERM while requests run: every request in flight is answered, then the server exits 0.
These tests stop the shared servers ``served`` and ``per_loop`` (conftest.py): marked
``stops_shared_servers``, they run after every other test that uses either server.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
from typing import Callable

import pytest

from conftest import until, write_one

np = pytest.importorskip("numpy")
from serving import (Server, _every_interpreter_in_a_call, _grpc,  # noqa: E402
                     _grpc_input, _input, _metrics, _request, _send_slow, _until_accepted)

pytestmark = pytest.mark.stops_shared_servers


def _requests_on_threads(server: Server, requests: list[tuple[str, str, np.ndarray, str]],
                         received: Callable[[int], bool]):
    """Each of requests, (model, input name, array, "http" or "grpc"), sent by a client
    of its own on a thread of its own, the next one once received(k) is true of request
    k: (the threads, the answers by request, the errors), filled as they end."""
    answers: list = [None] * len(requests)
    errors: list = []

    def send(k: int, client, tensor) -> None:
        try:
            answers[k] = client.infer(requests[k][0], [tensor]).as_numpy(_OUTPUT[requests[k][0]])
        except BaseException as error:  # reported by _sigterm_answers_all
            errors.append(error)

    threads = []
    for k, (model, name, array, over) in enumerate(requests):
        datatype = "UINT8" if array.dtype == np.uint8 else "FP32"
        client, tensor = ((_grpc(server), _grpc_input(name, array, datatype)) if over == "grpc"
                          else (server.client(), _input(name, array, datatype, True)))
        threads.append(threading.Thread(target=send, args=(k, client, tensor)))
    for k, thread in enumerate(threads):
        thread.start()
        until(lambda: received(k))
    return threads, answers, errors


_OUTPUT = {"slow": "doubled", "blocks": "output0"}


def _sigterm_answers_all(server: Server, requests, expected: list, release=()) -> None:
    """SIGTERM to server, then each fifo of release written to: every request in flight
    is answered with its expected output, it stops accepting, and it exits 0."""
    threads, answers, errors = requests
    server.process.send_signal(signal.SIGTERM)
    for fifo in release:
        until(lambda: write_one(fifo))
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, (errors[0], server.output())
    assert [a.tolist() for a in answers] == [e.tolist() for e in expected]
    assert server.process.wait(timeout=60) == 0, server.output()
    with pytest.raises(OSError):
        _request(server, "GET", "/v2/health/live")  # it stopped accepting
    assert "Shutting down" in server.output()


def test_sigterm_with_a_loop_per_interpreter_answers_requests_in_flight(per_loop, tmp_path):
    """Each loop is in a call (that blocks until released) when two new connections
    come, so that they reach their loops only once the server is stopping: the one that
    sent a request is answered, the idle one is closed, and the server exits 0."""
    with _every_interpreter_in_a_call(per_loop, tmp_path):
        late = _send_slow(per_loop, 0.5)
        idle = socket.create_connection(("127.0.0.1", per_loop.port), timeout=60)
        _until_accepted(per_loop.port)  # a stop closes the listening socket
        per_loop.process.send_signal(signal.SIGTERM)
    # (the calls ended once the server was stopping, and were answered)
    try:
        response = late.getresponse()
        assert response.status == 200, per_loop.output()
        assert json.loads(response.read())["outputs"][0]["data"] == [1.0]
        assert idle.recv(1) == b""  # closed by the server
        assert per_loop.process.wait(timeout=60) == 0, per_loop.output()
    finally:
        late.close()
        idle.close()
    assert per_loop.output().count("Started server process") == 1  # one server's lines


def test_sigterm_answers_requests_in_flight_and_exits_0(served, tmp_path):
    """A call that blocks until released runs in each interpreter (a new HTTP connection
    goes to a free one) and two slow requests, over HTTP and gRPC, wait behind them when
    SIGTERM comes; then the calls are released, and all four are answered."""
    fifos = [str(tmp_path / f"gate{k}") for k in range(2)]
    for fifo in fifos:
        os.mkfifo(fifo)
    paths = [np.frombuffer(fifo.encode(), np.uint8) for fifo in fifos]
    seconds = np.array([0.2], np.float32)

    def received(k: int) -> bool:
        metrics = _metrics(served)
        return (metrics[("multipy_busy_interpreters", (("model", "blocks"),))] == min(k + 1, 2)
                and metrics[("multipy_inference_queue_length", (("model", "slow"),))]
                == max(k - 1, 0))

    requests = _requests_on_threads(served, [
        ("blocks", "path", paths[0], "http"), ("blocks", "path", paths[1], "http"),
        ("slow", "seconds", seconds, "http"), ("slow", "seconds", seconds, "grpc")], received)
    _sigterm_answers_all(served, requests, [*paths, 2 * seconds, 2 * seconds], release=fifos)
    with open(served.report) as f:
        imported = json.load(f)
    # (numpy: the host decoded the requests it served while every interpreter was stuck)
    assert not any(imported[name] for name in imported if name != "numpy"), imported
