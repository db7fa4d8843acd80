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
from typing import Any, Callable

import httptools

from .connection import Coalescing, Limits
from .uvicorn_server import FlowControl

__all__ = ["guarded"]

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
            crowded: Callable[[], bool] | None = None) -> type:
    """A subclass of uvicorn's httptools protocol ``base`` that enforces limits (see the
    module's docstring), calls on_lost() when a connection ends, on_linger(1) when one
    begins to linger and on_linger(-1) when it stops (see the module's docstring), and
    with one_request closes each connection once it has answered one request, or
    without, one whose request arrives whole while crowded() is true (see the module's
    docstring: the client's next connection may be accepted elsewhere).  Its
    ``received`` counts the bytes read from the connection; its ``progress``, an
    asyncio.Event or None, is set when it reads bytes, answers a request or ends (for
    one who waits on that)."""
    return type("Guarded", (_Guarded, base), {
        "_limits": limits, "_on_lost": None if on_lost is None else staticmethod(on_lost),
        "_on_linger": None if on_linger is None else staticmethod(on_linger),
        "_one_request": one_request,
        "_crowded": None if crowded is None else staticmethod(crowded),
        # (called as it is, without super(): once per header field)
        "_base_on_header": base.on_header})


class _Guarded:
    """What ``guarded``'s protocols do over uvicorn's (the first of their bases)."""

    _limits: Limits
    _on_lost: Callable[[], None] | None
    _on_linger: Callable[[int], None] | None
    _one_request: bool
    _crowded: Callable[[], bool] | None
    _base_on_header: Callable[[Any, bytes, bytes], None]

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
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self._limits.max_headers:  # (the request's fields so far)
            self._refusal = (431, f"the request has more than the "
                                  f"{self._limits.max_headers} header fields this server "
                                  f"takes (--max-headers)")
            raise _Refused
        self._base_on_header(name, value)

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
        super().on_headers_complete()
        if self._one_request and self.cycle is not None:
            self.cycle.keep_alive = False

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
