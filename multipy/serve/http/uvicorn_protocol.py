"""The HTTP protocol that every connection of ``multipy serve`` is served with
(``guarded``): uvicorn's httptools protocol under the limits of
multipy.serve.http.connection.Limits.  With multipy.serve.http.uvicorn_server, whose
``RELIED_ON`` names what of uvicorn's own it uses, the only code that relies on uvicorn
beyond its public API.

A connection served by ``guarded``'s protocol:

- is set up without looking up the addresses of its two ends (the ASGI scope's
  ``server`` and ``client`` are None) or TLS (multipy serve speaks none), and with
  uvicorn's two loggers looked up once, not again for each connection;
- has its request's head counted as it comes (431 past --max-header-size or
  --max-headers), and its request timed from its first byte (408 past --read-timeout);
  a body that httptools reads as chunked though its Transfer-Encoding is not chunked
  alone (``gzip, chunked``: the model would get it still encoded) is a 501, checked at
  its first chunk (httptools refuses the other codings: 400);
- once it has answered its first request and waits, idle, for a second, is said to
  linger (``on_linger(1)``, and ``on_linger(-1)`` when a second begins or it ends): most
  such connections are closing (their client sends one request a connection), which the
  server has not read yet;
- is closed once it has answered a kept-alive request that arrived whole, with none
  behind it, while ``crowded()`` said so (its answer says ``Connection: close``; a
  request that comes behind it before its answer begins keeps the connection open): a
  front end that serves two connections or more beyond the fewest that a front end of
  another process serves sheds one (multipy.serve.request.metrics.Metrics.crowded);
- is closed once idle for uvicorn's keep-alive timeout, by one timer per connection that
  watches both, made again only when it would come too late (uvicorn's own makes and
  cancels one an answer);
- writes an answer's head and body, which uvicorn writes apart, in one write
  (multipy.serve.http.connection.Coalescing): one system call and, when small, one TCP
  segment.
"""
from __future__ import annotations

import asyncio
import http
import json
import logging
from collections import deque
from typing import Any, Awaitable, Callable

import httptools

from .connection import Coalescing, Limits
from .exchange import check_declared, gone_away, too_large
from .uvicorn_server import FlowControl, RequestResponseCycle, write_whole

__all__ = ["DirectExchange", "connection_of", "guarded"]

#: The bytes of empty lines, which before a request are ignored (RFC 9112, 2.2): they do
#: not end a connection's idle time.
_EMPTY_LINES = b"\r\n"
#: uvicorn's loggers, which its protocol looks up for each connection (under logging's
#: lock): the same two every time.
_LOGGERS = (logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn.access"))


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


def guarded(base: type, limits: Limits, on_lost: Callable[[], None] | None = None,
            one_request: bool = False,
            on_linger: Callable[[int], None] | None = None,
            crowded: Callable[[], bool] | None = None,
            direct: Callable[[bytes], Endpoint | None] | None = None) -> type:
    """A subclass of uvicorn's httptools protocol ``base`` that enforces limits (see the
    module's docstring), calls on_lost() when a connection ends, on_linger(1) when one
    begins to linger and on_linger(-1) when it stops (see the module's docstring), and
    with one_request closes each connection once it has answered one request, or
    without, one whose request arrives whole while crowded() is true (see the module's
    docstring: the client's next connection may be accepted elsewhere).  Its
    ``received`` counts the bytes read from the connection; its ``progress``, an
    asyncio.Event or None, is set when it reads bytes, answers a request or ends (for
    one who waits on that).  direct(target), if given, is the endpoint that answers a
    POST request to target (the request line's bytes) without ASGI, or None: the
    protocol then gives it the request as a DirectExchange (see its docstring for
    which requests)."""
    return type("Guarded", (_Guarded, base), {
        "_limits": limits, "_on_lost": None if on_lost is None else staticmethod(on_lost),
        "_on_linger": None if on_linger is None else staticmethod(on_linger),
        "_one_request": one_request,
        "_crowded": None if crowded is None else staticmethod(crowded),
        "_directly": None if direct is None else staticmethod(direct)})


#: What answers a request without ASGI: ``await endpoint(exchange)`` answers it.
Endpoint = Callable[["DirectExchange"], Awaitable[None]]


def connection_of(send: Callable) -> int | None:
    """The file descriptor of the connection whose request send answers (a uvicorn
    cycle's send, of ``guarded``'s protocol, or a DirectExchange's ``answer``); -1 once
    its client has gone (the descriptor may be another connection's by then); None for
    another server's send."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle and type(cycle) is not DirectExchange:
        return None
    return -1 if cycle.disconnected else cycle.transport.fd


class DirectExchange:
    """A request that ``guarded``'s protocol gives an endpoint of its own (``direct``),
    not the ASGI application: a POST whose target that endpoint answers, without
    ``Expect: 100-continue`` or an upgrade, that comes on a connection with no answer
    under way (one that comes behind an answer under way, pipelined, goes to the
    application), where uvicorn neither logs each answer nor limits concurrency.
    Neither a scope nor ASGI's messages and tasks are made for it: the endpoint reads
    ``headers`` (ASGI's: names in lower case), ``await body(declared, limit)``, may then
    wait for ``gone()`` (one of the two waits at a time) and writes one whole ``answer``.

    It takes the place of uvicorn's request cycle on the protocol (``cycle``), with the
    attributes of one that uvicorn's protocol and ``write_whole`` read and set, so that
    the protocol's shutdown, pipelining and loss of the connection treat it as a cycle.
    ``closing``, if set (by a wrapper of the endpoint), is asked as the answer is written:
    true closes the connection with it."""

    # An exchange's state as it begins (its instance's own once changed).
    closing: Callable[[], bool] | None = None
    disconnected = response_started = response_complete = False
    more_body = True
    waiting_for_100_continue = False
    _size = 0
    _limit: int | None = None  # (given by body())
    _waiter: asyncio.Future | None = None

    def __init__(self, protocol: _Guarded, headers: list[tuple[bytes, bytes]],
                 keep_alive: bool) -> None:
        self.headers = headers
        self.keep_alive = keep_alive
        self.transport = protocol.transport
        self._protocol: _Guarded | None = protocol  # (None once it has answered)
        self._body: bytearray | None = bytearray()  # (None once read)

    # -- what the protocol and write_whole use of it, as of uvicorn's cycle --

    @property
    def message_event(self) -> DirectExchange:
        """What uvicorn's protocol sets when the body ends or the connection is lost:
        ``set`` wakes the endpoint if it waits."""
        return self

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self._protocol.server_state.default_headers

    @property
    def on_response(self) -> Callable[[], None]:
        return self._protocol.on_response_complete

    def piece(self, data: bytes) -> None:
        """A piece of the request's body has come (kept, in one buffer, unless it is past
        the limit; a chunked body may come in many small pieces)."""
        body = self._body
        if body is None or self.response_complete:
            return
        self._size += len(data)
        limit = self._limit
        if limit is not None and self._size > limit:
            body.clear()  # (refused: nothing more is kept)
            self.set()
        else:
            body += data

    # -- the endpoint's --

    async def body(self, declared: str | None, limit: int) -> bytes:
        """The request's body, whose Content-Length header says declared; ProtocolError
        as multipy.serve.http.exchange.read_body raises it: 413 past limit bytes (said,
        or come), 499 if the client goes away first."""
        check_declared(declared, limit)
        self._limit = limit
        while self.more_body and self._size <= limit and not self.disconnected:
            await self._wait()
        if self.disconnected:
            raise gone_away()
        if self._size > limit:
            raise too_large(limit)
        body, self._body = self._body, None  # (not kept while the model runs)
        return bytes(body)

    async def gone(self) -> None:
        """Returns once the client has gone away."""
        while not self.disconnected:
            await self._wait()

    def _wait(self) -> asyncio.Future:
        waiter = self._waiter = self._protocol.loop.create_future()
        return waiter

    async def answer(self, status: int, head: bytes, body: bytes) -> None:
        """Writes the answer: status, head (its header lines but Content-Length, each
        ending in CRLF) and body, once what waits to be written has drained; nothing if
        the client has gone, or an answer was written."""
        flow = self._protocol.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        if self.disconnected or self.response_started:
            return
        if self.closing is not None and self.closing():
            self.keep_alive = False
        write_whole(self, status, head, body)

    async def run(self, endpoint: Endpoint) -> None:
        """Has endpoint answer; if it fails, or ends without an answer, the client gets
        a 500 (and the connection closes), as uvicorn's cycle does for its
        application."""
        try:
            try:
                await endpoint(self)
            except BaseException as error:  # (uvicorn's: cancelled at a forced shutdown)
                self._protocol.logger.error("Exception in an endpoint answering without "
                                            "ASGI", exc_info=error)
            else:
                if self.response_started or self.disconnected:
                    return
                self._protocol.logger.error("An endpoint answering without ASGI returned "
                                            "without an answer.")
            if self.response_started:
                self.transport.close()
                return
            self.keep_alive = False
            await self.answer(500, b"content-type: text/plain; charset=utf-8\r\n",
                              b"Internal Server Error")
        finally:
            # (the protocol keeps it as its cycle until the next request: it keeps
            # neither the protocol, nor its body)
            self._protocol = self._body = None


class _Guarded:
    """What ``guarded``'s protocols do over uvicorn's (the first of their bases)."""

    _limits: Limits
    _on_lost: Callable[[], None] | None
    _on_linger: Callable[[int], None] | None
    _one_request: bool
    _crowded: Callable[[], bool] | None
    _directly: Callable[[bytes], Endpoint | None] | None

    # A connection's state as it begins (its instance's own once changed).
    received = 0
    progress: asyncio.Event | None = None
    _counted_lost = False  # (on_lost called)
    _idled = False  # (it has gone idle before: it lingers only the first time)
    _lingers = False
    _heading = True  # bytes that come now belong to a request's head
    _head = 0  # the head's bytes so far
    _tail = b""
    _refusal: tuple[int, str] | None = None
    _shed: Any = None  # (the cycle of a request to be closed once answered: crowded)
    # when the request under way (or the connection) began; when the connection went
    # idle (answered, no byte of a next request yet); and the one timer that watches
    # both, and when it comes: at or before the earlier one's deadline
    _since: float | None = None
    _idle: float | None = None
    _watch: asyncio.TimerHandle | None = None
    _watch_at = 0.0

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        # uvicorn's, but for its two loggers, looked up once (_LOGGERS), and what
        # connection_made sets (tests/test_uvicorn_seam.py checks that the two set
        # every attribute that uvicorn's sets)
        if not config.loaded:
            config.load()
        self.config = config
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.logger, self.access_logger = _LOGGERS
        self.access_log = self.access_logger.hasHandlers()
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.ws_protocol_class = config.ws_protocol_class
        self.root_path = config.root_path
        self.asgi_version = config.asgi_version
        self.limit_concurrency = config.limit_concurrency
        self.app_state = app_state
        self.timeout_keep_alive_task = None
        self.timeout_keep_alive = config.timeout_keep_alive
        self.server_state = server_state
        self.connections = server_state.connections
        self.tasks = server_state.tasks
        self.pipeline = deque()
        self.scope = self.headers = self.cycle = None
        self.expect_100_continue = False
        # (requests answered without ASGI only where uvicorn would do nothing more with
        # them: see DirectExchange)
        self._direct = self._directly if not self.root_path and self.limit_concurrency \
            is None and not self.access_log and not config.reset_contextvars else None

    def connection_made(self, transport: asyncio.Transport) -> None:
        # uvicorn's, less what nothing here reads, which costs a connection two system
        # calls and four objects: the addresses of its two ends (the ASGI scope's
        # "server" and "client" are None, as the specification allows), and TLS (none)
        self.connections.add(self)
        self.transport = Coalescing(transport)
        self.flow = FlowControl(transport)  # (flow control: the real one)
        self.server = self.client = None
        self.scheme = "http"
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm(stop_watching=True)
        if self.progress is not None:
            self.progress.set()
        try:
            super().connection_lost(exc)
        finally:
            self._lost()

    def eof_received(self) -> bool | None:
        """The client has closed its side: the connection closes (as uvicorn's does),
        and counts as closed now, not once the loop gets to ``connection_lost``: a new
        connection of the same client, accepted meanwhile, is not taken for a second."""
        self._lost()
        return super().eof_received()

    def _lost(self) -> None:
        if self._lingers:
            self._linger(False)
        if self._on_lost is not None and not self._counted_lost:
            self._counted_lost = True
            self._on_lost()

    def _linger(self, on: bool) -> None:
        self._lingers = on
        self._on_linger(1 if on else -1)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.progress is not None:
            self.progress.set()
        if self._idle is None or self._since is not None or data[0] not in _EMPTY_LINES \
                or data.strip(_EMPTY_LINES):  # (empty lines between requests are not one)
            self._idle = None
            if self._since is None:
                self._arm()  # the first byte of a request
        if self._heading:
            seen = self._tail + data if self._tail else data  # the end may straddle
            end = seen.find(b"\r\n\r\n")
            head = self._head + (end + 4 - len(self._tail) if end >= 0 else len(data))
            if head > self._limits.max_header_size:
                self._refuse(431, f"the request's head (its request line and headers) has "
                                  f"more than the {self._limits.max_header_size} bytes "
                                  f"this server takes (--max-header-size)")
                return
            self._head = head
            if end < 0:  # the head goes on in the next piece
                self._tail = seen[-3:]
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
                return
            message = "Invalid HTTP request received."
            self.logger.warning(message)
            self.send_400_response(message)

    def _unsupported_upgrade_warning(self) -> None:  # (uvicorn's says to install one)
        self.logger.warning("Unsupported upgrade request: answered over HTTP/1.1 "
                            "(multipy serve speaks no WebSocket).")

    def on_message_begin(self) -> None:
        self._idle = None  # (begun in the piece that ended the one before, maybe)
        if self._lingers:  # (its second request: a kept-alive connection)
            self._linger(False)
        if self._since is None:
            self._arm()
        # uvicorn's, but the scope is made once the head has come, for a request that
        # goes to the application (``_scope``)
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None

    def _scope(self) -> dict[str, Any]:
        """The request's ASGI scope as uvicorn's on_message_begin makes it (its
        on_headers_complete adds the rest): tests/test_uvicorn_seam.py compares them."""
        return {"type": "http", "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": "1.1", "server": self.server, "client": self.client,
                "scheme": self.scheme, "root_path": self.root_path, "headers": self.headers,
                "state": self.app_state.copy()}

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, under --max-headers
        headers = self.headers
        if len(headers) >= self._limits.max_headers:  # (the request's fields so far)
            self._refusal = (431, f"the request has more than the "
                                  f"{self._limits.max_headers} header fields this server "
                                  f"takes (--max-headers)")
            raise _Refused
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        headers.append((name, value))

    def on_chunk_header(self) -> None:  # (a body read as chunked: see the docstring)
        for name, value in self.headers:
            if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
                shown = value[:40].decode("latin-1")
                self._refusal = (501, f"Transfer-Encoding {shown!r} is not supported: "
                                      f"only chunked")
                raise _Refused

    def on_headers_complete(self) -> None:
        self._heading = False
        shed = self._shed
        if shed is not None:  # a request behind one that was to close it: kept open
            self._shed = None  # for both, unless that one's answer has begun
            if not shed.response_started:
                shed.keep_alive = True
        endpoint = None if self._direct is None else self._endpoint()
        if endpoint is None:
            self.scope = self._scope()
            super().on_headers_complete()
            if self._one_request and self.cycle is not None:
                self.cycle.keep_alive = False
            return
        parser = self.parser
        exchange = self.cycle = DirectExchange(
            self, self.headers, not self._one_request and parser.should_keep_alive()
            and parser.get_http_version() != "1.0")  # (as uvicorn keeps a connection)
        task = self.loop.create_task(exchange.run(endpoint))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _endpoint(self) -> Endpoint | None:
        """The endpoint that answers the request whose head has come without ASGI, if
        one does (see DirectExchange)."""
        cycle, parser = self.cycle, self.parser
        if self.expect_100_continue or (cycle is not None and not cycle.response_complete) \
                or parser.get_method() != b"POST" or parser.should_upgrade():
            return None
        return self._direct(self.url)

    def on_body(self, body: bytes) -> None:
        exchange = self.cycle
        if type(exchange) is DirectExchange:
            exchange.piece(body)
        else:
            super().on_body(body)

    def on_response_complete(self) -> None:
        # uvicorn's, but for its keep-alive timer: the watch's deadline instead
        self.transport.flush()
        self.server_state.total_requests += 1
        if self.progress is not None:
            self.progress.set()
        if self.transport.is_closing():  # (answered, and closing: it serves no more)
            self._lost()
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._start_asgi_task(*self.pipeline.pop())
            if self._since is not None:  # uvicorn reads again: the time it did not
                self._since = self.loop.time()  # does not count against the client
        elif self._since is None or self.cycle.more_body:
            self._go_idle()  # no byte of a next request has come (nor of this one's
            # body, answered before it came: its bytes end the idle time)

    def on_message_complete(self) -> None:
        self._disarm()  # arrived whole
        self._heading, self._head, self._tail = True, 0, b""
        super().on_message_complete()
        cycle = self.cycle
        if self._crowded is not None and cycle.keep_alive and not cycle.response_started \
                and not self.pipeline and self._crowded():
            cycle.keep_alive = False  # (read whole, none behind it: closed once answered)
            self._shed = cycle
        if cycle.response_complete and not self.transport.is_closing():
            self._go_idle()  # its body came after its answer

    def _go_idle(self) -> None:
        self._idle = self.loop.time()
        self._watch_by(self._idle + self.timeout_keep_alive)
        if not self._idled:
            self._idled = True
            if self._on_linger is not None:
                self._linger(True)

    def _arm(self) -> None:
        # (by the keep-alive timeout at the latest, which the idle time after a short
        # request's answer will want: one timer per connection, not one made and one
        # made again; a longer request's comes again)
        self._since = self.loop.time()
        self._watch_by(self._since + min(self._limits.read_timeout, self.timeout_keep_alive))

    def _watch_by(self, deadline: float) -> None:
        """Makes the watch come at deadline, unless it comes before."""
        if self._watch is not None:
            if self._watch_at <= deadline:
                return
            self._watch.cancel()
        self._watch = self.loop.call_at(deadline, self._check)
        self._watch_at = deadline

    def _disarm(self, stop_watching: bool = False) -> None:
        self._since = None
        if stop_watching and self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _check(self) -> None:
        """The watch's time: closed if idle for the keep-alive timeout, too slow if
        the request under way began read_timeout ago (time while uvicorn does not
        read, a request waiting behind the one before it, does not count); else
        watch again until then (neither idle nor under way: stop)."""
        self._watch = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._idle is not None:
            if now - self._idle < self.timeout_keep_alive:
                self._watch_by(self._idle + self.timeout_keep_alive)
            else:
                self.transport.close()
        elif self._since is not None:
            if self.flow.read_paused:
                self._since = now
            if now - self._since < self._limits.read_timeout:
                self._watch_by(self._since + self._limits.read_timeout)
            else:
                self._too_slow()

    def _too_slow(self) -> None:
        self._since = None
        if self.transport.is_closing():
            return
        if self._head == 0 and self._heading:  # not a byte of a request: just close
            self.transport.close()
            return
        if not self._heading and self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # (its body stalled after its answer)
            return
        self._refuse(408, f"the request did not arrive whole within "
                          f"{self._limits.read_timeout:g} s (--read-timeout)")

    def _refuse(self, status: int, message: str) -> None:
        """Answers status with message and closes the connection, unless a response
        has begun on it (then it is closed)."""
        self._disarm(stop_watching=True)
        if self.cycle is not None and not self.cycle.response_complete \
                and self.cycle.response_started:
            self.transport.close()
            return
        if self.cycle is not None:
            self.cycle.disconnected = True  # the application's answer goes nowhere
        body = json.dumps({"error": message}).encode()
        self.transport.write(b"".join([
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode(),
            b"content-type: application/json\r\n",
            f"content-length: {len(body)}\r\n".encode(),
            b"connection: close\r\n\r\n", body]))
        self.transport.close()
