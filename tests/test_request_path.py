"""The serving request path in this process, without torch or interpreters: the batcher,
the connection's limits (uvicorn's protocol, guarded, on a loopback socket), the host's
choice of front end for a new connection, and the model repository's requests.  The
fast tier (`make test-fast`) runs this file with test_protocol.py and test_layers.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
from types import SimpleNamespace

import pytest

np = pytest.importorskip("numpy")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")
pytest.importorskip("prometheus_client")

from multipy.serve.request.batching import Batcher  # noqa: E402
from multipy.serve.http.connection import Limits  # noqa: E402
from multipy.serve.http.uvicorn_protocol import guarded  # noqa: E402
from multipy.serve.http.inbox import open_inbox, receive  # noqa: E402
from multipy.serve.host.front_ends import FrontEnds  # noqa: E402
from multipy.serve.request import metrics as metrics_module  # noqa: E402
from multipy.serve.request.metrics import Metrics  # noqa: E402
from multipy.serve.request.protocol import ProtocolError, Tensor  # noqa: E402
from multipy.serve.request.repository import archive, check_name  # noqa: E402
from multipy.serve.http.uvicorn_server import write_answer  # noqa: E402

pytestmark = pytest.mark.timeout(30)


# -- the batcher --

def test_requests_close_together_run_as_one_call_and_get_their_own_rows():
    calls = []

    async def run(inputs, tokens):
        calls.append((inputs[0].array.shape[0], tokens))
        return [Tensor("y", "FP32", inputs[0].array * 2)]

    async def main():
        batcher = Batcher(run, max_rows=8, delay=0.05)
        rows = [np.full((k, 2), k, np.float32) for k in (1, 2, 3)]
        answers = await asyncio.gather(*(batcher.submit([Tensor("x", "FP32", r)], token=k)
                                         for k, r in enumerate(rows)))
        return rows, answers

    rows, answers = asyncio.run(main())
    assert calls == [(6, [0, 1, 2])]  # one call of every row, the requests in order
    for sent, [answer] in zip(rows, answers):
        np.testing.assert_array_equal(answer.array, sent * 2)


def test_requests_that_cannot_batch_run_alone():
    calls = []

    async def run(inputs, tokens):
        calls.append(tuple(t.array.shape for t in inputs))
        return [Tensor("y", "FP32", inputs[0].array)]

    async def main():
        batcher = Batcher(run, max_rows=4, delay=0.05)
        await asyncio.gather(
            batcher.submit([Tensor("x", "FP32", np.zeros((4, 2), np.float32))]),  # full
            batcher.submit([Tensor("x", "FP32", np.zeros((), np.float32))]),  # a scalar
            batcher.submit([Tensor("x", "FP32", np.zeros((1, 3), np.float32))]),  # other
            batcher.submit([Tensor("x", "FP32", np.zeros((1, 2), np.float32))]))

    asyncio.run(main())
    assert sorted(calls) == sorted([((4, 2),), ((),), ((1, 3),), ((1, 2),)])


# -- the connection's limits --

async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def _serving(limits: Limits, app, made: list | None = None, **callbacks):
    """While it runs, a server of guarded uvicorn protocol (limits, and guarded's
    callbacks) serves app on a port of loopback, which it yields; made, if given, gets
    each connection's protocol."""
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
    config.load()
    state = uvicorn.server.ServerState()
    protocol = guarded(config.http_protocol_class, limits, **callbacks)

    def make():
        connection = protocol(config=config, server_state=state, app_state={})
        if made is not None:
            made.append(connection)
        return connection

    server = await asyncio.get_running_loop().create_server(make, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def _answers(limits: Limits, raw: bytes, app=_ok) -> bytes:
    """What a server of guarded uvicorn protocol (limits) answers raw, on loopback."""
    async with _serving(limits, app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(1 << 16), 10)
        writer.close()
        return answer


def test_a_head_past_the_limit_is_431():
    limits = Limits(max_header_size=200, max_headers=3)
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300 + b"\r\n\r\n"
    answer = asyncio.run(_answers(limits, big))
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--max-header-size" in answer
    many = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % k for k in range(5)) + b"\r\n"
    answer = asyncio.run(_answers(limits, many))
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--max-headers" in answer
    fine = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    assert asyncio.run(_answers(limits, fine)).startswith(b"HTTP/1.1 200 ")
    # a chunked body's trailer fields, which come after the head, count as fields too
    trailers = (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n0\r\n" + b"".join(b"T-%d: 1\r\n" % k for k in range(5)) + b"\r\n")
    answer = asyncio.run(_answers(limits, trailers))
    assert answer.startswith(b"HTTP/1.1 431 ") and b"--max-headers" in answer


@pytest.mark.parametrize("request_head", [
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    b"POST / HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"])
@pytest.mark.parametrize("status, headers, body", [
    (200, [(b"content-type", b"application/json")], b'{"a": 1}'),
    (499, [], b""),
    (200, [(b"content-type", b"application/octet-stream"), (b"x-length", b"4")],
     b"1234\r\n\r\n")])
def test_an_answer_written_at_once_is_the_one_uvicorn_writes(request_head, status, headers,
                                                             body):
    """write_answer writes, through uvicorn's cycle, what uvicorn writes for the two ASGI
    messages of the same answer (keep-alive, or a close it says), and is refused (False,
    nothing written) for a send that is not a cycle's, or once an answer has begun."""
    async def by_messages(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": [
            *headers, (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def at_once(scope, receive, send):
        await receive()
        assert write_answer(send, status, b"".join(b"%s: %s\r\n" % h for h in headers), body)
        assert not write_answer(send, status, b"", body)  # (begun)

    expected = asyncio.run(_answers(Limits(), request_head, by_messages))
    assert expected.endswith(b"\r\n\r\n" + body) and b"content-length" in expected
    assert asyncio.run(_answers(Limits(), request_head, at_once)) == expected
    assert not write_answer(lambda message: None, 200, b"", b"")


def test_a_client_that_expects_100_continue_gets_it_at_once():
    """A request that says Expect: 100-continue gets its 100 Continue as soon as the
    application reads its body (not held back as an answer's head: the client sends its
    body only then), and then its answer."""
    async def echo(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def exchange():
        async with _serving(Limits(), echo) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.write(b"hi")
            answer = await asyncio.wait_for(reader.readuntil(b"hi"), 10)
            writer.close()
            return interim, answer

    interim, answer = asyncio.run(exchange())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nhi")


@pytest.mark.parametrize("coding, status", [(b"gzip, chunked", 501), (b"deflate,chunked", 501),
                                            (b"identity", 400), (b"gzip", 400)])
def test_a_transfer_coding_other_than_chunked_is_refused(coding, status):
    """A body whose Transfer-Encoding is not chunked alone is refused, not read as
    chunked (httptools reads "gzip, chunked" so, and would give the model gzip's bytes:
    501; the others it refuses itself: 400); chunked alone is read."""
    body = b"3\r\nabc\r\n0\r\n\r\n"
    answer = asyncio.run(_answers(Limits(), b"POST / HTTP/1.1\r\nHost: x\r\n"
                                            b"Transfer-Encoding: " + coding + b"\r\n\r\n" + body))
    assert answer.startswith(b"HTTP/1.1 %d " % status)
    assert (b"only chunked" in answer) == (status == 501)
    answer = asyncio.run(_answers(Limits(), b"POST / HTTP/1.1\r\nHost: x\r\n"
                                            b"Transfer-Encoding: Chunked\r\n\r\n" + body))
    assert answer.startswith(b"HTTP/1.1 200 ")


def test_http_1_0_keep_alive_answers_every_request_or_closes():
    """HTTP/1.0 with Connection: keep-alive, two requests on one connection (sent
    together, or the second after the first answer): each is answered, or the
    connection is closed after the first answer; never left waiting."""
    request = b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"

    async def sized(scope, receive, send):  # (as every answer of the server's)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def exchange(together: bool) -> tuple[bytes, bytes]:
        async with _serving(Limits(), sized) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request * 2 if together else request)
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 10)
            if not together:
                writer.write(request)
            rest = await asyncio.wait_for(reader.read(), 10)  # (until the server closes)
            writer.close()
            return first, rest

    for together in (True, False):
        first, rest = asyncio.run(exchange(together))
        assert first.startswith(b"HTTP/1.1 200 ")
        assert rest == b"" or (rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"ok"))


def test_a_connection_lingers_from_its_first_answer_until_a_second_request():
    """A connection that has answered its first request and waits for a second lingers
    (on_linger(1)) until the second begins (-1); answered again, it does not linger
    again; one that ends while it lingers stops lingering before it counts as lost."""
    said = []
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"

    async def until(what: list) -> None:
        for _ in range(500):
            if said[-len(what):] == what:
                return
            await asyncio.sleep(0.01)

    async def exchange(requests: int) -> list:
        said.clear()
        async with _serving(Limits(), _ok, on_lost=lambda: said.append("lost"),
                            on_linger=said.append) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            seen = []
            for _ in range(requests):
                writer.write(request)
                await asyncio.wait_for(reader.readuntil(b"ok"), 10)
                await asyncio.sleep(0.05)  # (the server's turn after its answer)
                seen.append(list(said))
            writer.close()
            await until(["lost"])
            return seen + [list(said)]

    assert asyncio.run(exchange(1)) == [[1], [1, -1, "lost"]]
    assert asyncio.run(exchange(3)) == [[1], [1, -1], [1, -1], [1, -1, "lost"]]


def test_a_connection_closed_after_its_answer_counts_as_lost_as_the_answer_ends():
    """A connection that the server closes once it has answered (the client said
    Connection: close, or the protocol serves one request a connection) counts as lost
    (on_lost) as the answer completes, before the application's send returns, not turns
    later when the loop gets to connection_lost: a front end that accepts a connection
    meanwhile is not taken for one that still serves another (freer_front_end); one
    kept alive is not lost then."""
    said = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        said.append("answered")

    async def exchange(header: bytes, one_request: bool) -> list:
        said.clear()
        async with _serving(Limits(), app, on_lost=lambda: said.append("lost"),
                            one_request=one_request) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n")
            await asyncio.wait_for(reader.readuntil(b"ok"), 10)
            for _ in range(500):  # (until the app has returned)
                if "answered" in said:
                    break
                await asyncio.sleep(0.01)
            seen = list(said)
            writer.close()
            return seen

    assert asyncio.run(exchange(b"Connection: close\r\n", False)) == ["lost", "answered"]
    assert asyncio.run(exchange(b"", True)) == ["lost", "answered"]
    assert asyncio.run(exchange(b"", False)) == ["answered"]  # (kept alive)


def test_lingering_connections_do_not_count_in_which_front_end_is_freer():
    """A front end that has just accepted a connection gives it to another that accepts,
    runs no call and serves fewer, counting the open connections of both but the
    lingering ones (most are closing: their client's next connection is this one)."""
    metrics = Metrics(["m"], 2, rows=3)
    this, other = (Metrics(["m"], 2, rows=3, row=row, address=metrics.board.address,
                           cores=2) for row in (1, 2))
    this.watching(True)
    other.watching(True)
    this.opened_connection(received=False)
    assert this.freer_front_end(busy=False)  # one open here, none there
    this.lingering(1)
    assert not this.freer_front_end(busy=False)  # the one here lingers
    other.opened_connection(received=False)
    this.opened_connection(received=False)
    assert not this.freer_front_end(busy=False)  # one each, the lingering aside
    this.opened_connection(received=False)
    assert this.freer_front_end(busy=False)  # two here
    other.opened_connection(received=False)
    assert not this.freer_front_end(busy=False)  # two each
    other.lingering(1)
    assert this.freer_front_end(busy=False)  # two here, one there: the other's lingers
    other.watching(False)
    assert not this.freer_front_end(busy=False)  # the other does not accept


@pytest.mark.parametrize("cores, processes, cpu_per_second, spreads", [
    (1, 1, 0.9, False),  # more front ends than cores, the process keeps them busy
    (1, 1, 0.2, True),  # more front ends than cores, mostly free (a model that waits)
    (2, 1, 2.0, True),  # as many front ends as cores: always
    (2, 2, 0.9, False),  # two processes: this one keeps its share (a core) busy
])
def test_front_ends_past_the_cores_keep_a_second_connection_while_the_process_is_busy(
        monkeypatch, cores, processes, cpu_per_second, spreads):
    """With more front ends than cores, while the process uses three quarters of its
    share of the cores or more, a front end that serves one connection keeps the one it
    accepts, unless it runs a call; one that serves two hands it on, busy or not.  The
    CPU is looked at once every SATURATED_EVERY seconds at most, and a look after a
    longer pause begins anew (then connections are handed on as before)."""
    clock = SimpleNamespace(wall=100.0, cpu=0.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(
        monotonic=lambda: clock.wall, process_time=lambda: clock.cpu))

    def later(seconds: float) -> None:
        clock.wall += seconds
        clock.cpu += seconds * cpu_per_second

    rows = 3 * processes  # (a host and two front ends in each process)
    board = Metrics(["m"], 2, rows=rows, processes=processes)
    this, other = (Metrics(["m"], 2, rows=rows, row=row, address=board.board.address,
                           cores=cores, processes=processes) for row in (1, 2))
    this.watching(True)
    other.watching(True)
    this.opened_connection(received=False)  # one here, none there
    assert this.freer_front_end(busy=False)  # (its first look: nothing seen yet)
    later(1.5 * metrics_module.SATURATED_EVERY)
    assert this.freer_front_end(busy=False) is spreads
    assert this.freer_front_end(busy=True)  # in a call: the other runs none
    this.opened_connection(received=False)
    assert this.freer_front_end(busy=False)  # two here: handed on, however busy
    this.closed_connection()
    later(3 * metrics_module.SATURATED_EVERY)
    assert this.freer_front_end(busy=False)  # a look after a pause: begins anew


@pytest.mark.parametrize("cores, processes, interpreters, surplus_rows", [
    (2, 1, 4, [3, 4]),  # four front ends on two cores: the last two
    (2, 1, 2, []),  # as many front ends as cores
    (3, 2, 3, [3]),  # cores that do not divide among processes: a share of two
    (1, 2, 3, [2, 3]),  # fewer cores than processes: each keeps one front end
    (None, 1, 4, []),  # cores unknown: as many as front ends
])
def test_front_ends_past_the_share_of_the_cores_stand_aside_while_the_share_is_busy(
        monkeypatch, cores, processes, interpreters, surplus_rows):
    """With more front ends than cores, those past the process's share of the cores
    (the cores over the processes, rounded up) stand aside (surplus) while every front
    end within the share accepts and the process keeps three quarters of its share of
    the cores busy, and once aside until it uses under half; then crowded() says so at
    every look, and not otherwise.  Front ends within the share never stand aside."""
    clock = SimpleNamespace(wall=100.0, cpu=0.0, rate=0.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(
        monotonic=lambda: clock.wall, process_time=lambda: clock.cpu))

    def later(seconds: float) -> None:
        clock.wall += seconds
        clock.cpu += seconds * clock.rate

    rows = (interpreters + 1) * processes
    board = Metrics(["m"], interpreters, rows=rows, processes=processes)
    front_ends = [Metrics(["m"], interpreters, rows=rows, row=row, processes=processes,
                          cores=cores, address=board.board.address)
                  for row in range(1, interpreters + 1)]
    assert [m.row for m in front_ends if m.may_be_surplus] == surplus_rows
    assert all(m.sheds for m in front_ends) is (processes > 1 or bool(surplus_rows))
    for front_end in front_ends:
        front_end.watching(True)
        front_end.surplus()  # (a first look: nothing seen yet)
    share = (cores or 2) / processes  # (the cores a process's share has)

    def standing_aside() -> list[int]:
        later(metrics_module.SATURATED_EVERY)
        return [m.row for m in front_ends if m.surplus()]

    clock.rate = 0.8 * share  # busy: each within the share and past it alike
    assert standing_aside() == surplus_rows
    assert [m.row for m in front_ends if m.crowded()] == surplus_rows
    later(0.95 * metrics_module.SATURATED_EVERY)  # a timer's look a little early counts
    assert [m.row for m in front_ends if m.surplus()] == surplus_rows
    clock.rate = 0.6 * share  # once aside, aside down to half of the share's cores
    assert standing_aside() == surplus_rows
    clock.rate = 0.45 * share
    assert standing_aside() == []
    clock.rate = 0.7 * share  # not aside: under three quarters is not enough
    assert standing_aside() == []
    clock.rate = 0.8 * share
    assert standing_aside() == surplus_rows
    front_ends[0].watching(False)  # one within the share does not accept (stuck, say)
    assert standing_aside() == []
    front_ends[0].watching(True)
    later(3 * metrics_module.SATURATED_EVERY)  # a look after a pause begins anew
    assert [m.row for m in front_ends if m.surplus()] == []
    assert standing_aside() == surplus_rows


def test_a_busy_front_end_hands_a_connection_to_a_free_one_that_stands_aside():
    """A front end in a call (with --timeout, its loop still accepts) gives a connection
    back for a free front end past the cores even while that one stands aside (the host
    hands it there: it takes what the busy ones cannot serve), and not for a busy one."""
    board = Metrics(["m"], 3, rows=4)
    front_ends = [Metrics(["m"], 3, rows=4, row=row, cores=2, address=board.board.address)
                  for row in (1, 2, 3)]
    for front_end in front_ends[:2]:
        front_end.watching(True)
    front_ends[1].models["m"].call_began(1)  # within the share: both in a call
    front_ends[0].models["m"].call_began(1)
    front_ends[2].watching(False)  # past it: standing aside, free
    assert front_ends[2].may_be_surplus
    assert front_ends[0].freer_front_end(busy=True)
    front_ends[2].models["m"].call_began(1)
    assert not front_ends[0].freer_front_end(busy=True)


def test_a_crowded_front_end_closes_a_kept_alive_connection_once_answered():
    """While crowded() says so, a kept-alive request that arrived whole with none behind
    it is answered with Connection: close, and the connection closes (its client's next
    one may land on a freer process); otherwise, and for two requests pipelined
    together, the connection stays open."""
    crowded = [False]
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def exchange() -> list:
        async with _serving(Limits(), app, crowded=lambda: crowded[0]) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)

            async def answers(sent: bytes, count: int) -> list[bytes]:
                writer.write(sent)
                heads = []
                for _ in range(count):
                    heads.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10))
                    assert await asyncio.wait_for(reader.readexactly(2), 10) == b"ok"
                return heads

            heads = await answers(request, 1)
            crowded[0] = True
            heads += await answers(request * 2, 2)  # pipelined: kept open for both
            heads += await answers(request, 1)
            closed = await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
            return heads + [closed]

    *heads, closed = asyncio.run(exchange())
    assert [b"connection: close" in head.lower() for head in heads] == [
        False, False, False, True]
    assert closed


def test_a_front_end_is_crowded_with_two_connections_more_than_one_of_another_process(
        monkeypatch):
    """A front end is crowded when it serves two connections or more beyond the fewest
    that an accepting front end of another process serves (lingering ones aside, its own
    and the other's); the front ends of its own process, and those that do not accept, do
    not count."""
    monkeypatch.setattr(metrics_module, "CROWDED_EVERY", 0.0)
    board = Metrics(["m"], 2, rows=6, processes=2)  # rows: a host, its 2 front ends; twice
    this, neighbour, other = (
        Metrics(["m"], 2, rows=6, row=row, first=first, processes=2,
                address=board.board.address) for first, row in ((0, 1), (0, 2), (3, 1)))
    for front_end in (this, neighbour, other):
        front_end.watching(True)
    assert not this.crowded()  # none anywhere
    this.opened_connection(received=False)
    assert not this.crowded()  # one here, none there
    this.opened_connection(received=False)
    assert this.crowded()  # two here, none there
    this.lingering(1)
    assert not this.crowded()  # one lingers
    this.lingering(-1)
    other.opened_connection(received=False)
    assert not this.crowded()  # two here, one there
    other.watching(False)
    assert not this.crowded()  # the other does not accept: none is freer
    other.watching(True)
    this.opened_connection(received=False)
    assert this.crowded()  # three here, one there (the neighbour, with none, aside)
    other.opened_connection(received=False)
    assert not this.crowded()  # three here, two there
    other.lingering(1)
    assert this.crowded()  # three here, one there: the other's second lingers
    monkeypatch.setattr(metrics_module, "CROWDED_EVERY", 60.0)
    assert this.crowded()  # looked: then not again for a minute
    assert not this.crowded()


def test_a_request_that_does_not_arrive_in_time_is_408():
    answer = asyncio.run(_answers(Limits(read_timeout=0.2), b"GET / HTTP/1.1\r\nHost"))
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--read-timeout" in answer


def test_an_answer_s_head_leaves_with_its_body_in_one_write():
    from multipy.serve.http.connection import Coalescing

    class Transport:
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, data):
            self.writes.append(data)

        def close(self):
            self.closed = True

        def is_closing(self):
            return self.closed

        def get_extra_info(self, name):
            return None  # (no socket)

    transport = Transport()
    coalescing = Coalescing(transport)
    coalescing.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert transport.writes == []  # held for its body
    coalescing.write(b"ok")
    coalescing.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    coalescing.flush()  # an answer without a body to write (HEAD's)
    coalescing.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    coalescing.close()
    assert transport.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                                b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
                                b"HTTP/1.1 204 No Content\r\n\r\n"]
    assert transport.closed and coalescing.is_closing()


def test_a_head_request_is_answered_though_its_answer_has_no_body_to_write():
    answer = asyncio.run(_answers(Limits(), b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n")


# -- inference requests answered without ASGI --

class _Echo:
    """A server of one model, echo, that answers with its inputs (in this process, for
    the request path only); ``hold``, once set, makes a call wait until it is set
    again (an asyncio.Event), and ``cancelled`` counts the calls cancelled."""

    ready, states, max_request_size = True, {}, 4096
    http_restricted = grpc_restricted = ()

    def __init__(self) -> None:
        from multipy.serve.request.requests import ModelRequests

        self.hold: asyncio.Event | None = None
        self.cancelled = 0
        server = self

        class Echo(ModelRequests):
            async def _run(self, names, datatypes, arrays, started, given, request):
                with started:
                    if server.hold is not None:
                        try:
                            await server.hold.wait()
                        except asyncio.CancelledError:
                            server.cancelled += 1
                            raise
                    # (names None: given by position; answered as y0, y1, ...)
                    return (tuple(names or (f"y{k}" for k in range(len(arrays)))),
                            tuple(datatypes), *arrays)

            async def _steps(self, *arguments):
                yield await self._run(*arguments)

        self.metrics = Metrics(["echo"], 1)
        self.echo = Echo("echo", self.metrics.models["echo"])

    def model(self, name, version=None):
        if name == "boom":
            raise RuntimeError("not a ProtocolError: the endpoint fails")
        if name != "echo":
            raise ProtocolError(f"unknown model {name!r}", 404)
        return self.echo

    async def drain(self) -> None:
        pass


def _infer(path: bytes, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    """A request to path with body (its Content-Length added) and header lines."""
    return b"POST %s HTTP/%s\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path, version, b"".join(line + b"\r\n" for line in headers), len(body), body)


_X = json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2],
                             "data": [1, 2]}]}).encode()
_BINARY = json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2],
                                  "data": [1, 2]}],
                      "parameters": {"binary_data_output": True}}).encode()


@pytest.mark.parametrize("raw, statuses", [
    (_infer(b"/v2/models/echo/infer", _X), [200, 200]),
    (_infer(b"/v2/models/echo/versions/1/infer", _BINARY, b"Accept-Encoding: deflate"),
     [200, 200]),
    (_infer(b"/v2/models/echo/infer", _X, b"Connection: close"), [200]),
    (_infer(b"/v2/models/echo/infer", _X, version=b"1.0"), [200]),
    (_infer(b"/v2/models/nope/infer", _X), [404, 200]),
    (_infer(b"/v2/models/echo/infer", b"{"), [400, 200]),
    (_infer(b"/v2/models/echo/infer", b"x" * 5000), [413, 200]),  # (said: Content-Length)
    (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"".join(b"%x\r\n%s\r\n" % (1000, b"x" * 1000) for _ in range(5)) + b"0\r\n\r\n",
     [413, 200]),
    (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"".join(b"%x\r\n%s\r\n" % (1, bytes([byte])) for byte in _X) + b"0\r\n\r\n",
     [200, 200]),  # (a body in pieces of a byte)
    (_infer(b"/v2/models/boom/infer", _X), [500]),  # (the endpoint fails: closed)
    (_infer(b"/v2/models/echo/infer", _X) + _infer(b"/v2/models/echo/infer", _BINARY),
     [200, 200, 200]),
], ids=["json", "binary-deflate", "close", "http-1.0", "404", "400", "413-said", "413-come",
        "chunked", "500", "pipelined"])
def test_an_inference_request_is_answered_without_asgi_as_with_it(raw, statuses):
    """The inference endpoint that answers a request without ASGI (its protocol's
    DirectExchange) writes, byte for byte, what the same endpoint writes through ASGI,
    on the same connection state after it (closed or kept: the answers end where the
    server closes, or a request sent after them is answered too): the statuses given,
    the answers' and then, on a connection kept, a health check's."""
    from multipy.serve.http.app import create_app

    app = create_app(_Echo())
    found = []

    def direct(target: bytes):
        endpoint = app.direct(target)
        found.append(endpoint is not None)
        return endpoint

    async def exchange(directly: bool) -> bytes:
        async with _serving(Limits(), app, direct=direct if directly else None) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            await asyncio.sleep(0.2)  # (answered: then a request that shows it is kept)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)  # (until closed)
            writer.close()
            return answer

    through_asgi = asyncio.run(exchange(False))
    assert found == []
    assert [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", through_asgi)] \
        == statuses, through_asgi
    answered = asyncio.run(exchange(True))
    assert found and found[0]  # (the first request went to the endpoint directly)
    assert answered == through_asgi


def test_an_exchange_answered_keeps_neither_its_body_nor_its_protocol():
    """A request answered without ASGI stays its kept-alive connection's cycle until the
    next request: once answered it holds neither the request's body (the connection's
    memory does not keep the last request's) nor the protocol (the two are freed with
    their connection without the cycle collector)."""
    from multipy.serve.http.app import create_app
    from multipy.serve.http.uvicorn_protocol import DirectExchange

    app = create_app(_Echo())
    made = []

    async def exchange():
        async with _serving(Limits(), app, made, direct=app.direct) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_infer(b"/v2/models/echo/infer", _X))
            await asyncio.wait_for(reader.readuntil(b"]}]}"), 10)
            cycle = made[0].cycle
            writer.close()
            return cycle

    cycle = asyncio.run(exchange())
    assert type(cycle) is DirectExchange and cycle.response_complete
    assert cycle._body is None and cycle._protocol is None


def test_only_unrestricted_inference_paths_are_answered_without_asgi():
    from multipy.serve.http.app import create_app

    app = create_app(_Echo())
    for target in (b"/v2/models/echo/infer", b"/v2/models/echo/versions/2/infer"):
        assert app.direct(target) is not None, target
    for target in (b"/v2/models/echo/infer?x=1", b"/v2/models/e%63ho/infer",
                   b"/v2/models/echo/generate", b"/v2/models/echo", b"/v2/health/ready",
                   b"http://x/v2/models/echo/infer", "/v2/models/é/infer".encode()):
        assert app.direct(target) is None, target  # (ASGI's, through Starlette's rules)
    # (a long target goes the ASGI way; only inference targets are remembered)
    assert app.direct(b"/v2/models/" + b"m" * 2000 + b"/infer") is None
    remembered = app._endpoints.cache_info().currsize
    for k in range(300):
        assert app.direct(b"/v2/models/echo/x%d" % k) is None
    assert app._endpoints.cache_info().currsize == remembered
    restricted = _Echo()
    restricted.http_restricted = (("inference", "key", "value"),)
    assert create_app(restricted).direct(b"/v2/models/echo/infer") is None


def test_a_client_that_goes_during_a_call_answered_without_asgi_cancels_it():
    """The client of a request answered without ASGI goes while the model runs: the call
    is cancelled and the request counted as 499, as through ASGI."""
    from multipy.serve.http.app import create_app

    server = _Echo()
    app = create_app(server)

    async def exchange() -> None:
        server.hold = asyncio.Event()
        async with _serving(Limits(), app, direct=app.direct) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_infer(b"/v2/models/echo/infer", _X))
            for _ in range(100):  # (until the call runs)
                await asyncio.sleep(0.02)
                if b"multipy_model_calls_total{model=\"echo\"} 1.0" in _rendered(server):
                    break
            writer.close()
            for _ in range(200):
                await asyncio.sleep(0.02)
                if server.cancelled:
                    break

    asyncio.run(exchange())
    assert server.cancelled == 1
    assert b'multipy_inference_failures_total{model="echo",status="499"} 1.0' in \
        _rendered(server)


def _rendered(server: _Echo) -> bytes:
    """server's metrics, as /metrics gives them."""
    return server.metrics.render()[0]


# -- the host's choice of front end --

def test_a_new_connection_goes_to_the_front_end_with_the_fewest_open_connections():
    """FrontEnds.hand writes the connection's descriptor into the inbox of the front end
    with the fewest open connections (then the fewest calls), skipping busy ones unless
    told not to; among free ones, one that accepts on the listening socket first (one
    that stands aside is given one only when the others are busy)."""
    fronts = FrontEnds()
    metrics = Metrics(["m"], 3, rows=4)
    inboxes = [open_inbox() for _ in range(3)]
    fronts._inboxes, fronts._metrics, fronts._handed = inboxes, metrics, [2, 0, 1]
    first = Metrics(["m"], 3, rows=4, row=1, address=metrics.board.address)  # front end 0's
    first.closed_connection()
    first.closed_connection()  # both of its connections
    try:
        chosen = []
        for _ in range(3):
            left, right = socket.socketpair()
            right.close()
            assert fronts.hand(left, busy_ones=False)
            chosen.append(next(k for k, (read, _) in enumerate(inboxes) if receive(read)))
        assert chosen == [0, 1, 0]  # open: 0, 0, 1; then 1, 1, 1: the first of the fewest
        first.models["m"].call_began(1)  # front end 0 is in a call now
        left, right = socket.socketpair()
        right.close()
        assert fronts.hand(left, busy_ones=False)
        assert [bool(receive(read)) for read, _ in inboxes] == [False, True, False]
        for row in (1, 2, 3):  # every one accepts but front end 2 (with the fewest)
            Metrics(["m"], 3, rows=4, row=row, address=metrics.board.address).watching(
                row != 3)
        for busy_ones, to in ((False, [False, True, False]), (True, [False, False, True])):
            left, right = socket.socketpair()
            right.close()  # free ones: one that accepts first; any: the fewest
            assert fronts.hand(left, busy_ones=busy_ones)
            assert [bool(receive(read)) for read, _ in inboxes] == to
    finally:
        for read, write in inboxes:
            for fd in receive(read):
                os.close(fd)
            os.close(read)
            os.close(write)


# -- the model repository's requests --

def test_a_load_names_its_archive_in_parameters_or_config():
    assert archive({}) == {}
    assert archive({"path": "a.pt", "module": "m"}) == {"path": "a.pt", "module": "m"}
    assert archive({"config": json.dumps({"path": "a.pt"}), "resource": "r.pkl"}) == {
        "path": "a.pt", "resource": "r.pkl"}
    assert archive({"config": b'{"path": "b.pt"}'}) == {"path": "b.pt"}
    for wrong, says in (({"colour": "red"}, "'colour'"),
                        ({"config": "{not json"}, '"config" must be a JSON object'),
                        ({"config": "[1]"}, '"config" must be a JSON object'),
                        ({"path": 3}, "'path' must be a string"),
                        ({"path": ""}, "'path' must be a string")):
        with pytest.raises(ProtocolError, match=says) as refused:
            archive(wrong)
        assert refused.value.status == 400


def test_model_names():
    for name in ("a", "python_heavy", "Model-2.1", "_x", "x" * 128):
        check_name(name)
    for name in ("", ".x", "-x", "a/b", "a b", "a\nb", "caf\u00e9", "x" * 129):
        with pytest.raises(ProtocolError, match="cannot name a model"):
            check_name(name)
