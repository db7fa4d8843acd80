"""What bounds a client's cost to `multipy serve`: small hostile requests refused without
stalling or exhausting it, request heads bounded, --read-timeout and --graceful-timeout
for slow clients, and keep-alive timed from each answer; on the shared server ``served``
(conftest.py), and on one of its own for the timeouts.
"""
from __future__ import annotations

import gzip
import http.client
import json
import select
import signal
import socket
import time


from serving import (_answer_while_sending, _http_answers, _infer_json, _request, _rss,  # noqa: E402
                     _start, _stop, _until_accepted)


def test_small_hostile_requests_are_refused_without_stalling_or_exhausting(served):
    # Each request is small; before, each took the loop for seconds or the process's
    # memory by gigabytes before (or instead of) its error.
    good = {"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}
    before = _rss(served)

    def infer(body: bytes, headers=None) -> tuple[int, str]:
        status, _, answer = _request(served, "POST", "/v2/models/cast/infer", body, headers)
        return status, json.loads(answer)["error"]

    def tensor(**change) -> bytes:
        return json.dumps({"inputs": [{**good["inputs"][0], **change}]}).encode()

    # a shape of 100,000 huge dimensions (2 MB): refused by its rank, the message short
    status, message = infer(tensor(shape=[2 ** 62] * 100_000))
    assert status == 400 and "at most 64" in message and len(message) < 1000
    # (the fourth: empty, but numpy refuses its other sizes' product; found by the fuzzer)
    for shape in ([2 ** 40] * 3, [0, 10 ** 30], [1] * 100, [0, 13, 842287639, 842337135],
                  [2, "2"]):
        status, message = infer(tensor(shape=shape))
        assert status == 400 and "shape" in message, (shape, message)
    # a body that expands to 1 GB: refused past the limit, never expanded whole
    bomb = gzip.compress(b"\0" * (1 << 30), compresslevel=9)
    assert len(bomb) < 2 << 20
    status, message = infer(bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "expands" in message
    # one output asked for 10,000 times
    status, message = infer(json.dumps({**good, "outputs": [{"name": "same"}] * 10_000}).encode())
    assert status == 400 and "once" in message and len(message) < 1000
    # strings where numbers go, the first long: refused before any array is built
    status, message = infer(tensor(shape=[25_001], data=["x" * 10_000] + [""] * 25_000))
    assert status == 400 and "numbers" in message and "str" in message
    # far more values than the shape claims
    status, message = infer(tensor(shape=[2], data=[1.0] * 1_000_000))
    assert status == 400 and "more" in message
    # a datatype that is not a string
    for datatype in (["FP32"], {"a": 1}, 7):
        status, message = infer(tensor(datatype=datatype))
        assert status == 400 and "datatype" in message, (datatype, message)
    # a body past --max-request-size (64 MiB by default): said by its length, before
    # anything is read, or as it arrives (chunked, no length)
    start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
    status, message = _answer_while_sending(served, [start + b"Content-Length: %d\r\n\r\n{"
                                                     % (1 << 40)] + [b" " * (1 << 20)] * 8)
    assert status == 413 and "--max-request-size" in message
    chunk = b"100000\r\n" + b" " * (1 << 20) + b"\r\n"
    status, message = _answer_while_sending(
        served, [start + b"Transfer-Encoding: chunked\r\n\r\n1\r\n[\r\n"] + [chunk] * 70)
    assert status == 413 and "--max-request-size" in message
    # and the server still answers, in bounded memory
    status, answer = _infer_json(served, "cast", good)
    assert status == 200 and answer["outputs"][0]["data"] == [1.0, 2.0]
    assert _rss(served) - before < 400 << 20


def test_request_heads_are_bounded_in_size_and_fields(served):
    """A head past --max-header-size (64 KiB by default), in one huge header or in many,
    or with more than --max-headers fields (100), is a 431 before the rest is parsed,
    however its bytes come; a head just inside both is served, and so is the next
    request."""
    good = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                   "data": [3]}]}).encode()
    start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
    end = b"Content-Length: %d\r\n\r\n" % len(good) + good
    huge = start + b"X-Huge: " + b"a" * (1 << 20) + b"\r\n" + end
    status, message = _answer_while_sending(served, [huge[i:i + 65536]
                                                     for i in range(0, len(huge), 65536)])
    assert status == 431 and "--max-header-size" in message
    many = start + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 1000) for i in range(70)) + end
    assert _answer_while_sending(served, [many])[0] == 431
    fields = start + b"".join(b"X-%d: c\r\n" % i for i in range(150)) + end
    status, message = _answer_while_sending(served, [fields])
    assert status == 431 and "--max-headers" in message
    # 101 fields (Host, Content-Length and 99 more), sent a byte at a time: refused
    fields = start + b"".join(b"X-%d: c\r\n" % i for i in range(99)) + end
    status, message = _answer_while_sending(served, [fields[i:i + 1]
                                                     for i in range(len(fields))])
    assert status == 431 and "--max-headers" in message
    # 100, in pieces that end within a line and within the head's end: served
    fields = start + b"".join(b"X-%d: c\r\n" % i for i in range(98)) + end
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        for i in range(0, len(fields), 7):
            sock.sendall(fields[i:i + 7])
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()
    inside = start + b"".join(b"X-%d: %s\r\n" % (i, b"d" * 500) for i in range(90)) + end
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(inside)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()
        assert json.loads(response.read())["outputs"][0]["data"] == [3.0]
    status, answer = _infer_json(served, "cast", json.loads(good))
    assert status == 200 and answer["outputs"][0]["data"] == [3.0]


def test_slow_requests_idle_connections_and_a_stalled_stop_are_bounded(packages, tmp_path):
    """With --read-timeout 1: a request whose head, or body, stops arriving is a 408, a
    connection that sends nothing is closed, and a client that keeps its request
    coming in time is served, as is one whose request waits 2 s behind another.  With
    --graceful-timeout 1, a client stalled in the middle of its body does not keep
    SIGTERM from ending the server (exit status 0)."""
    server = _start(tmp_path, [packages["cast"], packages["slow"]], "--interpreters", "1",
                    "--read-timeout", "1", "--graceful-timeout", "1")
    try:
        good = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                                       "data": [5]}]}).encode()
        start = b"POST /v2/models/cast/infer HTTP/1.1\r\nHost: test\r\n"
        status, message = _answer_while_sending(server, [start + b"X-Slow: "])
        assert status == 408 and "--read-timeout" in message
        status, message = _answer_while_sending(
            server, [start + b"Content-Length: %d\r\n\r\n" % len(good) + good[:5]])
        assert status == 408
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as idle:
            assert idle.recv(1) == b""  # closed by the server
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            for piece in (start, b"Content-Length: %d\r\n\r\n" % len(good), good):
                sock.sendall(piece)
                time.sleep(0.2)  # in time: well inside the second
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 200
            assert json.loads(response.read())["outputs"][0]["data"] == [5.0]
        # a request pipelined behind a call of 2 s, which uvicorn does not read meanwhile
        slow = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                                       "data": [2]}]}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(slow), slow) + start
                         + b"Content-Length: %d\r\n\r\n" % len(good) + good)
            for expected, (status, body) in zip(([4.0], [5.0]), _http_answers(sock)):
                assert status.startswith(b"HTTP/1.1 200 "), (status, body)
                assert json.loads(body)["outputs"][0]["data"] == expected
        # a client that stalls halfway through its body, as SIGTERM comes
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        try:
            stalled.sendall(start + b"Content-Length: 1000\r\n\r\n{")
            _until_accepted(server.port)
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=60) == 0, server.output()
            answer = stalled.recv(1 << 16)  # answered (408) or closed: not left open
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
        finally:
            stalled.close()
    finally:
        _stop(server)


#: uvicorn's keep-alive timeout, which multipy serve keeps (seconds)
_KEEP_ALIVE = 5.0


def _answered(sock: socket.socket) -> http.client.HTTPResponse:
    """The next answer on sock, read whole."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response


def _open_until(sock: socket.socket, until_time: float) -> None:
    """Asserts that the server has not closed sock (or written to it) before until_time
    (time.monotonic's)."""
    left = until_time - time.monotonic()
    assert left <= 0 or not select.select([sock], [], [], left)[0], "closed too early"


def test_keep_alive_closes_only_a_connection_idle_for_its_timeout(served):
    """One connection: requests 3 s apart keep it (the timeout counts from each answer);
    a request whose head began while it was idle is answered though its rest comes after
    the timeout; once idle, it is closed when the timeout has passed, not before, and an
    empty line (no request's start) does not change that."""
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        for _ in range(3):  # the second and third past 5 s from the first answer
            sock.sendall(live)
            assert _answered(sock).status == 200
            _open_until(sock, time.monotonic() + 3)
        sent = time.monotonic()
        sock.sendall(live[:10])  # a head begun while idle, finished after the timeout
        _open_until(sock, sent + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200
        sent = time.monotonic()
        sock.sendall(live)
        assert _answered(sock).status == 200
        sock.sendall(b"\r\n")  # an empty line, which does not begin a request
        _open_until(sock, sent + _KEEP_ALIVE - 0.1)  # (idle from the answer, after sent)
        assert sock.recv(1) == b""  # then closed by the server (within recv's 60 s)


def test_a_request_begun_while_the_answer_before_it_is_written_is_not_cut_by_keep_alive(
        served):
    """A pipelined request whose head is cut short arrives while the one before it runs:
    when that one is answered the connection is not idle, so keep-alive does not close it
    while the rest of the head takes longer than the timeout to come."""
    body = json.dumps({"inputs": [{"name": "seconds", "shape": [1], "datatype": "FP32",
                                   "data": [0.5]}]}).encode()
    slow = (b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: test\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(slow + live[:10])
        response = _answered(sock)
        assert response.status == 200
        _open_until(sock, time.monotonic() + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200


def test_keep_alive_counts_from_an_answer_given_before_its_body_came(served):
    """An answer given before the request's body came (404: no such model): if the body
    never comes, the connection is closed at the keep-alive timeout, with nothing written
    after the answer (no 408 for a request answered); if it comes after the answer, the
    connection is closed the keep-alive timeout after it, not left open, unless a next
    request began in the same piece: that one is answered, however late its rest."""
    body = b"x" * 100_000
    head = (b"POST /v2/models/nonexistent/infer HTTP/1.1\r\nHost: test\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    for sends_body in (False, True):
        with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
            sent = time.monotonic()
            sock.sendall(head)
            assert _answered(sock).status == 404
            if sends_body:
                sent = time.monotonic()
                sock.sendall(body)
            _open_until(sock, sent + _KEEP_ALIVE - 0.1)
            assert sock.recv(1 << 16) == b""  # closed by the server, nothing written
    # the body, then in the same piece a next request's head, whose rest comes late
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        sock.sendall(head)
        assert _answered(sock).status == 404
        sent = time.monotonic()
        sock.sendall(body + live[:10])
        _open_until(sock, sent + _KEEP_ALIVE + 1)
        sock.sendall(live[10:])
        assert _answered(sock).status == 200
