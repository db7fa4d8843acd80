"""`multipy serve --processes 2`: one server of two processes behind one port, started and
watched by a supervisor (multipy.serve.processes.supervisor).  A crash costs one process, which is
replaced (with the model repository's state); SIGTERM answers every accepted request;
metrics, statistics and the repository are one server's; 20 interpreters serve.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import threading

import pytest

from conftest import export, until

pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

from serving import (_all_closed, _evil, _grpc_alone, _infer_json, _metrics, _request,  # noqa: E402
                     _start, _stop)

pytestmark = pytest.mark.timeout(600)

ONE = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}


def _all_ready(server, processes: int = 2) -> None:
    """Waits until every process of server is ready (the supervisor's ready line)."""
    until(lambda: f"ready: {processes} server processes" in server.output()
          or server.process.poll() is not None, 300)
    assert server.process.poll() is None, server.output()


def _where(server) -> tuple[int, int]:
    """(process id, interpreter) of the interpreter that answers a new connection."""
    status, answer = _infer_json(server, "where", ONE)
    assert status == 200, answer
    pid, interpreter = answer["outputs"][0]["data"]
    return pid, interpreter


def _processes_answering(server, tries: int = 40) -> set[int]:
    """The processes that answer new connections, one after another, until two have (the
    kernel wakes the free front ends of both: either may take the next), or tries."""
    pids: set[int] = set()
    for _ in range(tries):
        pids.add(_where(server)[0])
        if len(pids) == 2:
            break
    return pids


def _slow(server, seconds: float, answers: list) -> threading.Thread:
    """A thread that asks model slow for a call of seconds, and appends its answer."""
    request = {"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                           "data": [seconds]}]}
    thread = threading.Thread(target=lambda: answers.append(
        _infer_json(server, "slow", request)))
    thread.start()
    return thread


def _twenty(server) -> list[tuple[int, int]]:
    """(process id, interpreter) of each of 20 connections opened at once, each then
    asking model where once."""
    connections = [socket.create_connection(("127.0.0.1", server.port), timeout=60)
                   for _ in range(20)]
    # each is handed to an interpreter as its process receives it, to a free one first: a
    # request sent before every one is received could make a front end busy, and the
    # connections received after it go to the others
    until(lambda: _held_by_server_processes(server) == 20)
    body = json.dumps(ONE).encode()
    head = (f"POST /v2/models/where/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    for connection in connections:
        connection.sendall(head + body)
    where = []
    for connection in connections:
        with connection, connection.makefile("rb") as answer:
            assert answer.readline().startswith(b"HTTP/1.1 200"), "not answered"
            length = 0
            while (line := answer.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            where.append(tuple(json.loads(answer.read(length))["outputs"][0]["data"]))
    return where


def _held_by_server_processes(server) -> int:
    """How many of the connections established to server the supervisor's children hold
    (a server process holds one once it has received it, and hands it on at once)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    established = {f"socket:[{row[9]}]" for row in rows
                   if row[3] == "01" and int(row[1].split(":")[1], 16) == server.port}
    pid = server.process.pid
    children = [child for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    held = set()
    for child in children:
        with contextlib.suppress(OSError):  # it ended meanwhile
            for fd in os.listdir(f"/proc/{child}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{child}/fd/{fd}"))
    return len(established & held)


def _readies(server, k: int) -> int:
    return len(re.findall(rf"server process {k} \(pid \d+\) ready", server.output()))


def test_a_crash_ends_one_process_which_is_replaced_with_the_repository_state(
        packages, tmp_path):
    """A model that segfaults ends its process: a call running in the other process is
    answered, requests go on being answered, the death is logged with its signal, and a
    replacement serves what the others serve (a model unloaded before is unloaded there
    too)."""
    server = _start(tmp_path, [packages[n] for n in ("crashes", "slow", "where", "pair")],
                    "--processes", "2", "--interpreters", "1", "--model-control", "explicit")
    try:
        _all_ready(server)
        pids = _processes_answering(server)
        assert len(pids) == 2, pids  # both processes answer
        status, _, body = _request(server, "POST", "/v2/repository/models/pair/unload")
        assert status == 200, body
        # without --model-repository, a load may only reload what the server started with
        evil = _evil(tmp_path, str(tmp_path / "ran"))
        status, _, body = _request(server, "POST", "/v2/repository/models/evil/load",
                                   json.dumps({"parameters": {"path": evil}}).encode())
        assert status == 400 and b"--model-repository" in body, body
        assert not (tmp_path / "ran").exists()
        answers: list = []
        slow = _slow(server, 5.0, answers)

        def slow_running() -> bool:
            try:
                return _metrics(server, timeout=1)[("multipy_busy_interpreters",
                                                    (("model", "slow"),))] == 1
            except TimeoutError:  # taken by the slow call's front end just before the
                return False  # call: it answers once the call ends; the next goes on

        until(slow_running)
        with pytest.raises((ConnectionError, OSError)):
            _infer_json(server, "crashes", {"id": "req-7", **ONE})
        slow.join(60)
        assert answers and answers[0][0] == 200, answers
        assert answers[0][1]["outputs"][0]["data"] == [10.0]
        death = re.compile(r"server process (\d) \(pid (\d+)\) was killed by signal 11 "
                           r"\(SIGSEGV\)")
        until(lambda: death.search(server.output()))
        output = server.output()
        crashed = death.search(output)
        assert "inference of model 'crashes', request 'req-7'" in output, output
        k, dead = int(crashed.group(1)), int(crashed.group(2))
        for _ in range(4):  # answered meanwhile, by the other process
            assert _where(server)[0] != dead
        until(lambda: _readies(server, k) == 2, 300)
        pids = _processes_answering(server)
        assert len(pids) == 2 and dead not in pids, pids
        for _ in range(4):  # pair is unloaded in both processes, the replacement included
            status, answer = _infer_json(server, "pair", {"inputs": [
                {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},
                {"name": "b", "shape": [1], "datatype": "FP32", "data": [1]}]})
            assert status == 503 and "unloaded" in answer["error"], answer
        status, _, body = _request(server, "POST", "/v2/repository/models/pair/load")
        assert status == 200, body
        for _ in range(4):
            status, answer = _infer_json(server, "pair", {"inputs": [
                {"name": "a", "shape": [1], "datatype": "FP32", "data": [3]},
                {"name": "b", "shape": [1], "datatype": "FP32", "data": [1]}]})
            assert status == 200 and answer["outputs"][0]["data"] == [2.0], answer
        assert server.process.poll() is None
    finally:
        _stop(server)


def test_counts_and_statistics_are_every_process(packages, tmp_path):
    """Twenty interpreters serve (two processes of ten); /metrics and the statistics count
    every process's requests, whichever process answers; gRPC reaches both processes on
    one port; SIGTERM answers every request accepted, and the server exits 0."""
    server = _start(tmp_path, [packages["where"], packages["slow"]],
                    "--processes", "2", "--interpreters", "10", "--grpc-port", "0")
    try:
        _all_ready(server)
        # 20 connections open at once: the front ends of both processes accept them (the
        # kernel wakes the free ones of either), and within a process each leaves a
        # connection to one that serves fewer: a process's interpreters take one each
        # before any takes two (a front end counts a connection closed once its loop has
        # closed it: the readiness checks' are, first; on a loaded machine a front end
        # may still count one of the round before as its own: the round is tried again)
        sent = 0
        for _ in range(8):
            until(lambda: _all_closed(server.port))
            where = _twenty(server)
            sent += 20
            spread = {pid: (len([w for w in where if w[0] == pid]),
                            len({w for w in where if w[0] == pid})) for pid, _ in where}
            if all(distinct == min(taken, 10) for taken, distinct in spread.values()):
                break
        assert all(distinct == min(taken, 10) for taken, distinct in spread.values()), spread
        metrics = _metrics(server)
        assert metrics[("multipy_interpreters", ())] == 20
        # (the front ends accept on the supervisor's socket themselves: those of both)
        assert metrics[("multipy_connections_accepted_total", (("by", "interpreter"),))] >= 20
        assert metrics[("multipy_inference_requests_total", (("model", "where"),))] == sent
        x = grpcclient.InferInput("x", [1], "FP32")
        x.set_data_from_numpy(np.ones(1, np.float32))
        over_grpc = set()
        for _ in range(64):  # new connections: the kernel spreads them over both processes
            with _grpc_alone(server) as client:
                over_grpc.add(int(client.infer("where", [x]).as_numpy("output0")[0]))
            sent += 1
            if len(over_grpc) == 2:
                break
        assert len(over_grpc) == 2 and {pid for pid, _ in where} <= over_grpc
        for _ in range(6):  # on new connections, so both processes answer the scrape
            status, _, stats = _request(server, "GET", "/v2/models/where/stats")
            assert status == 200
            success = json.loads(stats)["model_stats"][0]["inference_stats"]["success"]
            assert success["count"] == sent, stats
        answers: list = []
        slow = [_slow(server, 2.0, answers) for _ in range(4)]
        until(lambda: _metrics(server)[("multipy_busy_interpreters",
                                        (("model", "slow"),))] == 4)
        server.process.send_signal(signal.SIGTERM)
        for thread in slow:
            thread.join(60)
        assert [status for status, _ in answers] == [200] * 4, answers
        assert server.process.wait(timeout=120) == 0, server.output()
    finally:
        _stop(server)


ARMED = '''
import ctypes
import os

import torch
from torch import nn


class Armed(nn.Module):
    """Segfaults on a negative input, and as it loads once its marker file exists."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def __setstate__(self, state):
        if os.path.exists(state["marker"]):
            ctypes.memset(16, 0, 1)
        super().__setstate__(state)

    def forward(self, x):
        if bool((x < 0).any()):
            ctypes.memset(16, 0, 1)
        return x
'''


def test_replacements_that_keep_dying_stop_the_server(tmp_path):
    """A process dies; its replacements die as they load, each retried after a longer
    pause (1, 2, 4, 8 s), never in a loop; after 5 in a row the server stops with exit
    status 1 and says why, the other process answering until then."""
    marker = tmp_path / "armed"
    path = export(tmp_path, "armed_model", ARMED, lambda module: module.Armed(str(marker)),
                  "armed.pt")
    server = _start(tmp_path, [path], "--processes", "2", "--interpreters", "1")
    try:
        _all_ready(server)
        marker.write_text("armed")
        with pytest.raises((ConnectionError, OSError)):
            _infer_json(server, "armed", {"inputs": [
                {"name": "x", "shape": [1], "datatype": "FP32", "data": [-1]}]})
        until(lambda: "a replacement starts now" in server.output())
        status, answer = _infer_json(server, "armed", ONE)  # the other process answers
        assert status == 200 and answer["outputs"][0]["data"] == [1.0], answer
        assert server.process.wait(timeout=180) == 1, server.output()
        output = server.output()
        for pause in (1, 2, 4, 8):
            assert f"while starting; a replacement starts in {pause} s" in output, output
        assert "5 processes in a row died while starting: stopping the server" in output
    finally:
        _stop(server)
