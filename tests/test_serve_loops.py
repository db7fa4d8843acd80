"""`multipy serve`'s event loops: a loop per interpreter, each connection on one, at most
one call per interpreter whatever the loop, health, metrics and new connections answered
while every interpreter is in a call, turns shared by loops, and an accept loop that goes
on after an error; on the shared server ``per_loop`` (conftest.py: 2 interpreters, no
--timeout, no batching).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest


np = pytest.importorskip("numpy")
from serving import (Server, _every_interpreter_in_a_call, _input, _metrics,  # noqa: E402
                     _request, _send_blocks, _until_opened)


def test_each_connection_gets_a_loop_of_its_own_that_runs_its_calls(per_loop):
    """Two clients' connections go to the two event loops, and a loop that serves one
    connection runs its calls on its own thread (the same thread for every request); a
    third connection shares a loop, whose calls then go to worker threads: every answer
    is still right."""
    x = np.zeros((1, 2), np.float32)
    threads_seen: list[list[int]] = [[], [], []]
    errors = []

    def client(k: int, requests: int, started: threading.Barrier) -> None:
        try:
            connection = per_loop.client()
            started.wait(timeout=30)  # every connection open before any request
            for _ in range(requests):
                answer = connection.infer("thread", [_input("x", x, "FP32", True)])
                threads_seen[k].append(int(answer.as_numpy("output0")[0]))
            connection.close()
        except BaseException as error:  # reported below
            errors.append(error)

    for clients in (2, 3):
        started = threading.Barrier(clients)
        workers = [threading.Thread(target=client, args=(k, 8, started)) for k in range(clients)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not errors, (errors[0], per_loop.output())
        if clients == 2:
            assert [len(set(seen)) for seen in threads_seen[:2]] == [1, 1], threads_seen
            assert threads_seen[0][0] != threads_seen[1][0], threads_seen
        assert all(len(seen) == 8 for seen in threads_seen[:clients]), threads_seen
        threads_seen = [[], [], []]


def test_at_most_one_call_per_interpreter_whatever_the_loop(per_loop):
    """Four connections on two loops (two each, so their calls go to worker threads)
    with two interpreters: two calls run at once, each alone in its interpreter, and
    two wait; every one is answered."""
    array = np.array([0.5], np.float32)
    answers, errors = [], []
    started = threading.Barrier(4)

    def client() -> None:
        try:
            connection = per_loop.client()
            connection.is_server_live()  # the connection is open, on its loop
            started.wait(timeout=30)
            answers.append(connection.infer("slow", [_input("seconds", array, "FP32", True)]))
            connection.close()
        except BaseException as error:  # reported below
            errors.append(error)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=60)
    assert not errors, (errors[0], per_loop.output())
    assert [a.as_numpy("doubled")[0] for a in answers] == [np.float32(1.0)] * 4
    assert [a.as_numpy("together")[0] for a in answers] == [1] * 4


def test_turns_are_shared_by_event_loops_and_taken_in_arrival_order():
    """Turns(1): calls waiting on two loops on two threads get the turn in the order
    they asked for it; one whose wait is cancelled takes none; a turn given back goes
    to a waiting call, not back to the free ones."""
    from multipy.serve.host.models import Turns

    turns = Turns(1)
    order: list[str] = []
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever) for loop in loops]
    for thread in threads:
        thread.start()
    asyncio.run_coroutine_threadsafe(turns.__aenter__(), loops[0]).result(timeout=10)
    assert turns._free == 0

    async def call(name: str) -> None:
        async with turns:
            order.append(name)

    def waiting() -> int:
        with turns._lock:
            return len(turns._waiting)

    def until(count: int) -> None:
        deadline = time.monotonic() + 10
        while waiting() != count:
            assert time.monotonic() < deadline, waiting()
            time.sleep(0.001)

    try:
        first = asyncio.run_coroutine_threadsafe(call("first"), loops[1])
        until(1)
        cancelled = asyncio.run_coroutine_threadsafe(call("cancelled"), loops[0])
        until(2)
        second = asyncio.run_coroutine_threadsafe(call("second"), loops[0])
        until(3)
        cancelled.cancel()
        until(2)
        turns.give()
        first.result(timeout=10)
        second.result(timeout=10)
        assert order == ["first", "second"]
        assert turns._free == 1  # given back by second
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)
        for thread in threads:
            thread.join(timeout=10)
        for loop in loops:
            loop.close()


def _readable(sock: socket.socket) -> bool:
    """Whether sock has something to read now (or is closed)."""
    return bool(select.select([sock], [], [], 0)[0])


def _accepted(server: Server) -> dict[str, float]:
    """By whom the server's connections were accepted, as /metrics says (on a new one)."""
    samples = _metrics(server)
    return {by: samples[("multipy_connections_accepted_total", (("by", by),))]
            for by in ("interpreter", "host")}


def test_the_front_ends_accept_new_connections_themselves(per_loop):
    """Connections made one after another while the interpreters are free are accepted
    by their front ends (a connection that waited for one past a few milliseconds, on a
    loaded machine, is the host's): every connection is counted once."""
    before = _accepted(per_loop)
    for _ in range(20):
        assert _request(per_loop, "GET", "/v2/health/live")[0] == 200
    after = _accepted(per_loop)
    took = {by: after[by] - before[by] for by in after}
    assert took["interpreter"] + took["host"] == 21  # (and /metrics's own connection)
    assert took["interpreter"] >= 11


def test_health_and_metrics_are_answered_while_every_interpreter_is_in_a_call(per_loop,
                                                                            tmp_path):
    """Both interpreters are in a call that does not end (no --timeout): liveness,
    readiness and the metrics, each on a new connection, are answered meanwhile (the
    host accepts them: no front end polls); then the calls end and are answered."""
    with _every_interpreter_in_a_call(per_loop, tmp_path) as calls:
        before = _accepted(per_loop)["host"]
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert _request(per_loop, "GET", path)[0] == 200, path
        assert _metrics(per_loop)[("multipy_busy_interpreters", (("model", "blocks"),))] == 2
        assert _accepted(per_loop)["host"] - before == 5
        assert not any(_readable(call.sock) for call in calls)  # still running


def _sent_in_pieces(server: Server, line: bytes, rest: bytes) -> socket.socket:
    """A new connection to server once it has sent line a byte at a time, then rest."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for k in range(len(line)):
        sock.sendall(line[k:k + 1])
        time.sleep(0.01)
    sock.sendall(rest)
    return sock


def test_a_get_that_arrives_in_pieces_is_answered_while_every_interpreter_is_in_a_call(
        per_loop, tmp_path):
    """While both interpreters are in a call that does not end, a GET whose request line
    arrives a byte at a time is answered (the host waits for the whole line before it
    chooses), and a POST that arrives so is handed to an interpreter, which answers it
    once its call has ended."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "data": [1]}]}).encode()
    with _every_interpreter_in_a_call(per_loop, tmp_path) as calls:
        get = _sent_in_pieces(per_loop, b"GET /v2/health/live HTTP/1.1\r\n",
                              b"Host: test\r\n\r\n")
        with get:
            response = http.client.HTTPResponse(get)
            response.begin()  # (before, it waited for a call: a timeout, 20 s)
            assert response.status == 200 and response.read() == b""
        post = _sent_in_pieces(per_loop, b"POST /v2/models/thread/infer HTTP/1.1\r\n",
                               b"Host: test\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert not any(_readable(sock) for sock in [post] + [call.sock for call in calls])
    with post:
        post.settimeout(60)
        response = http.client.HTTPResponse(post)
        response.begin()
        assert response.status == 200
        assert len(json.loads(response.read())["outputs"][0]["data"]) == 1


def test_a_new_connection_goes_to_a_loop_that_is_not_in_a_call(per_loop, tmp_path):
    """While one loop is in a call (its one connection's request, which blocks until
    released), a new connection goes to the other loop, which serves another client's
    idle connection, and is answered while the call still runs."""
    calling = http.client.HTTPConnection("127.0.0.1", per_loop.port, timeout=60)
    idle = http.client.HTTPConnection("127.0.0.1", per_loop.port, timeout=60)
    fifo = str(tmp_path / "gate")
    writer = None
    try:
        for connection in (calling, idle):  # one on each loop, in this order
            connection.request("GET", "/v2/health/live")
            response = connection.getresponse()
            assert (response.status, response.read()) == (200, b"")
        _send_blocks(per_loop, fifo, calling)
        writer = _until_opened(fifo)  # the call has begun, and runs until released
        assert _request(per_loop, "GET", "/v2/health/ready")[0] == 200
        assert not _readable(calling.sock)  # the call still runs
    finally:
        if writer is not None:
            os.write(writer, b"x")
            os.close(writer)
    try:
        response = calling.getresponse()
        assert response.status == 200
        assert bytes(json.loads(response.read())["outputs"][0]["data"]).decode() == fifo
    finally:
        calling.close()
        idle.close()


class _FailsOnce(socket.socket):
    """A listening socket whose first accept fails as when the process is out of file
    descriptors."""

    failed = False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_accepting_goes_on_after_an_error(caplog):
    """The server's accept loop (in this process) hands a client's connection on
    although accepting it failed once: the error is logged and accepting tries again."""
    from multipy.serve.http.connection import accept

    listener = _FailsOnce(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]

    def hand(connection: socket.socket) -> None:
        connection.setblocking(True)
        connection.recv(1 << 16)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nanswered")
        connection.close()

    def get() -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/")
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    async def serve() -> tuple[int, bytes]:
        accepting = asyncio.create_task(accept(listener, hand))
        try:
            return await asyncio.wait_for(asyncio.to_thread(get), 60)
        finally:
            accepting.cancel()

    with caplog.at_level(logging.ERROR, logger="multipy.serve"):
        assert asyncio.run(serve()) == (200, b"answered")
    assert listener.failed and "Too many open files" in caplog.text


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_accept_loop_cancelled_at_any_turn_loses_no_connection(loop):
    """The host cancels its accept loop when the front ends take over accepting: a
    connection it had taken from the queue at that moment must still be handed on, and
    one it had not must stay queued for the next to accept.  Cancelled after each number
    of the event loop's turns since a client connected, it has lost none."""
    from multipy.serve.http.connection import accept, bind, listen

    new_loop = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" \
        else asyncio.new_event_loop

    async def cancelled_after(turns: int) -> bool:
        listener = listen(bind("127.0.0.1", 0))
        handed: list[socket.socket] = []
        accepting = asyncio.create_task(accept(listener, handed.append))
        await asyncio.sleep(0)  # (it waits for a connection)
        client = socket.create_connection(listener.getsockname()[:2], timeout=10)
        try:
            time.sleep(0.05)  # (the loop stands still while the connection is queued)
            for _ in range(turns):
                await asyncio.sleep(0)
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
            try:
                handed.append(listener.accept()[0])  # still queued, for the next one
            except BlockingIOError:
                pass
            return len(handed) == 1
        finally:
            for connection in handed:
                connection.close()
            client.close()
            listener.close()

    for turns in range(6):
        runner = new_loop()
        try:
            assert runner.run_until_complete(cancelled_after(turns)), turns
        finally:
            runner.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_overdue_watch_takes_what_no_one_takes_and_sleeps_when_nothing_comes(
        loop, monkeypatch):
    """The host's watch of the listening socket (``accept_overdue``) leaves the
    connections that the others take (the front ends: ``accepted()`` counts them) and
    accepts one that no one takes; while connections keep coming it looks by the clock,
    without being woken by each one (a watch of the socket changed twice a look); once
    nothing comes it looks no more, until a connection does."""
    from multipy.serve.http import connection as module
    from multipy.serve.http.connection import accept_overdue, bind, listen

    new_loop = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" \
        else asyncio.new_event_loop
    looks, woken = [0], [0]
    waiting, came = module.waiting, module._Overdue._came

    def counted_waiting(listener: socket.socket) -> int:
        looks[0] += 1
        return waiting(listener)

    def counted_came(watch) -> None:
        woken[0] += 1
        came(watch)

    monkeypatch.setattr(module, "waiting", counted_waiting)
    monkeypatch.setattr(module._Overdue, "_came", counted_came)

    async def watched() -> tuple[int, int, int, int, int, int]:
        listener = listen(bind("127.0.0.1", 0))
        address = listener.getsockname()[:2]
        taken, handed, clients = [0], [], []
        watching = asyncio.create_task(accept_overdue(listener, handed.append,
                                                      lambda: taken[0], 0.01))
        try:
            await asyncio.sleep(0)
            began = time.monotonic()
            while looks[0] < 20 and time.monotonic() - began < 10:  # others take each one
                clients.append(socket.create_connection(address, timeout=10))
                await asyncio.sleep(0)  # (the loop polls: the watch may wake)
                listener.setblocking(True)
                clients.append(listener.accept()[0])
                listener.setblocking(False)
                taken[0] += 1
                await asyncio.sleep(0.002)
            under_load = (len(handed), looks[0], woken[0])
            clients.append(socket.create_connection(address, timeout=10))  # no one takes it
            came = time.monotonic()
            while not handed and time.monotonic() - came < 10:
                await asyncio.sleep(0.001)
            waited = time.monotonic() - came
            await asyncio.sleep(0.1)  # (the watch's last looks)
            looked = looks[0]
            await asyncio.sleep(0.2)
            return (*under_load, len(handed), waited, looked, looks[0])
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            listener.close()
            for each in clients + handed:
                each.close()

    runner = new_loop()
    try:
        handed_under_load, looks_under_load, woken_under_load, handed, waited, looked, \
            looked_later = runner.run_until_complete(watched())
    finally:
        runner.close()
    assert handed_under_load == 0  # every one was taken by the others
    assert looks_under_load >= 10, looks_under_load
    assert woken_under_load <= looks_under_load // 2, (woken_under_load, looks_under_load)
    # accepted once overdue, not at once (half of after: libuv's timers count from the
    # time its loop last read, which may be a little behind)
    assert handed == 1 and waited >= 0.005, waited
    assert looked_later == looked  # nothing came: no look


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("failing", [1, 2])
def test_the_overdue_watch_goes_on_after_an_error(loop, failing):
    """An error while the host's watch notes the queue (its count of what the others
    took raising, at the wake-up or at a look) is the event loop's to report, and the
    watch goes on: a connection that no one takes is still accepted."""
    from multipy.serve.http.connection import accept_overdue, bind, listen

    new_loop = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" \
        else asyncio.new_event_loop
    calls = [0]

    def accepted() -> int:
        calls[0] += 1
        if calls[0] == failing:
            raise RuntimeError("the board cannot be read")
        return 0

    async def watched() -> tuple[int, list]:
        errors: list = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _, context: errors.append(context.get("exception")))
        listener = listen(bind("127.0.0.1", 0))
        handed: list[socket.socket] = []
        watching = asyncio.create_task(accept_overdue(listener, handed.append, accepted,
                                                      0.01))
        client = None
        try:
            await asyncio.sleep(0)
            client = socket.create_connection(listener.getsockname()[:2], timeout=10)
            began = time.monotonic()
            while not handed and time.monotonic() - began < 10:
                await asyncio.sleep(0.005)
            return len(handed), errors
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            listener.close()
            for each in handed + ([client] if client else []):
                each.close()

    runner = new_loop()
    try:
        handed, errors = runner.run_until_complete(watched())
    finally:
        runner.close()
    assert handed == 1
    assert [type(error) for error in errors] == [RuntimeError], errors


_STOP_ACCEPTING = """
import asyncio, socket, uvloop
from multipy.serve.http.connection import accept, accept_overdue, bind, listen, stop_accepting

async def stopped(overdue: bool, turns: int) -> None:
    listener = listen(bind("127.0.0.1", 0))
    hand = socket.socket.close
    accepting = asyncio.create_task(accept_overdue(listener, hand, lambda: 0, 0.01) if overdue
                                    else accept(listener, hand))
    for _ in range(turns):
        await asyncio.sleep(0)
    await stop_accepting(accepting, listener)
    await asyncio.sleep(0.02)  # (the loop polls again)

async def main() -> None:
    for overdue in (False, True):
        for turns in range(4):
            await stopped(overdue, turns)
    print("stopped")

uvloop.run(main())
"""


def test_a_listener_closed_once_accepting_stops_never_aborts_the_process():
    """stop_accepting closes a listener only once the task accepting on it has ended: on
    uvloop, closing it while the loop has yet to register the task's watch aborts the
    whole process (as the supervisor did once, stopping).  Stopped at each of the first
    turns of either accept loop, the process goes on."""
    done = subprocess.run([sys.executable, "-c", _STOP_ACCEPTING], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr
