"""One HTTP connection of ``multipy serve``: uvicorn's protocol (httptools), with the
limits a server on the open network needs, the same wherever a connection is served
(in an interpreter's front end, or on the host while the models load).

- A request's head (request line and headers) of more than ``max_header_size`` bytes,
  or with more than ``max_headers`` header fields, is answered 431 and the connection
  closed, before the rest is parsed.
- A request must arrive whole (head and body) within ``read_timeout`` seconds of its
  first byte, and a new connection must start one within as long: else 408 (or, for a
  connection that sent nothing, it is closed).
- A connection that has been answered and has not sent a byte of another request for
  uvicorn's keep-alive timeout is closed.  One timer per connection watches both, made
  again only when it would come too late (uvicorn's own makes and cancels one an answer).

An answer's head and body, which uvicorn writes apart, leave in one write
(``_Coalescing``): one system call and, when small, one TCP segment.

``request_line`` peeks at a new connection until its request line is whole, within the
same read_timeout (the host chooses by it where the connection goes), and ``accept``
accepts them.
"""
from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import httptools

logger = logging.getLogger("multipy.serve")

#: The head of a request (request line and headers), in bytes.
MAX_HEADER_SIZE = 64 << 10
#: Header fields in a request.
MAX_HEADERS = 100
#: Seconds for a request to arrive whole, from its first byte.
READ_TIMEOUT = 60.0
#: The bytes of empty lines, which before a request are ignored (RFC 9112, 2.2): they do
#: not end a connection's idle time.
_EMPTY_LINES = b"\r\n"
#: Seconds between a failed accept and the next try.
_ACCEPT_PAUSE = 0.1


@dataclass(frozen=True)
class Limits:
    max_header_size: int = MAX_HEADER_SIZE
    max_headers: int = MAX_HEADERS
    read_timeout: float = READ_TIMEOUT


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


class _Coalescing:
    """A connection's transport that holds an answer's head (uvicorn writes it alone)
    until the first piece of its body, the answer's end or the connection's close, and
    writes the two together: one system call, and for a small answer one TCP segment,
    instead of two.  An interim answer (1xx: the 100 Continue that a client waits for
    before it sends its body) is written at once.  The rest is the transport's own."""

    __slots__ = ("_transport", "_head")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is not None:
            data, self._head = self._head + data, None
        elif data.startswith(b"HTTP/") and data.endswith(b"\r\n\r\n") \
                and data[9:10] != b"1":  # ("HTTP/1.1 " then the status: not 1xx)
            self._head = data  # a head alone: its body follows (b"" when it has none)
            return
        self._transport.write(data)

    def flush(self) -> None:
        """Writes a head held, if any (an answer without a body to write: HEAD's)."""
        if self._head is not None:
            self.write(b"")

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded(base: type, limits: Limits, on_lost: Callable[[], None] | None = None,
            one_request: bool = False) -> type:
    """A subclass of uvicorn's httptools protocol ``base`` that enforces limits (see the
    module's docstring), calls on_lost() when a connection ends, and with one_request
    closes each connection once it has answered one request.  Its ``received`` counts
    the bytes read from the connection."""

    on_header = base.on_header  # (called as it is, without super(): once per field)

    class Guarded(base):  # type: ignore[valid-type,misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.transport = _Coalescing(transport)  # (flow control: the real one)
            self.received = 0
            self._limits = limits
            self._heading = True  # bytes that come now belong to a request's head
            self._head = 0
            self._tail = b""
            self._refusal: tuple[int, str] | None = None
            # when the request under way (or the connection) began; when the connection
            # went idle (answered, no byte of a next request yet); and the one timer that
            # watches both, and when it comes: at or before the earlier one's deadline
            self._since: float | None = None
            self._idle: float | None = None
            self._watch: asyncio.TimerHandle | None = None
            self._watch_at = 0.0
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm(stop_watching=True)
            try:
                super().connection_lost(exc)
            finally:
                if on_lost is not None:
                    on_lost()

        def data_received(self, data: bytes) -> None:
            self.received += len(data)
            if self._idle is None or self._since is not None or data[0] not in _EMPTY_LINES \
                    or data.strip(_EMPTY_LINES):  # (empty lines between requests are not one)
                self._idle = None
                if self._since is None:
                    self._arm()  # the first byte of a request
            if self._heading:
                seen = self._tail + data if self._tail else data  # the end may straddle
                end = seen.find(b"\r\n\r\n")
                head = self._head + (end + 4 - len(self._tail) if end >= 0 else len(data))
                if head > limits.max_header_size:
                    self._refuse(431, f"the request's head (its request line and headers) "
                                      f"has more than the {limits.max_header_size} bytes this "
                                      f"server takes (--max-header-size)")
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
            if self._since is None:
                self._arm()
            super().on_message_begin()

        def on_header(self, name: bytes, value: bytes) -> None:
            if len(self.headers) >= limits.max_headers:  # (the request's fields so far)
                self._refusal = (431, f"the request has more than the {limits.max_headers} "
                                      f"header fields this server takes (--max-headers)")
                raise _Refused
            on_header(self, name, value)

        def on_headers_complete(self) -> None:
            self._heading = False
            super().on_headers_complete()
            if one_request and self.cycle is not None:
                self.cycle.keep_alive = False

        def on_response_complete(self) -> None:
            # uvicorn's, but for its keep-alive timer: the watch's deadline instead
            self.transport.flush()
            self.server_state.total_requests += 1
            if self.transport.is_closing():
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
            if self.cycle.response_complete and not self.transport.is_closing():
                self._go_idle()  # its body came after its answer

        def _go_idle(self) -> None:
            self._idle = self.loop.time()
            self._watch_by(self._idle + self.timeout_keep_alive)

        def _arm(self) -> None:
            self._since = self.loop.time()
            self._watch_by(self._since + limits.read_timeout)

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
                if now - self._since < limits.read_timeout:
                    self._watch_by(self._since + limits.read_timeout)
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
            self._refuse(408, f"the request did not arrive whole within {limits.read_timeout:g} s "
                              f"(--read-timeout)")

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

    return Guarded


async def request_line(connection: socket.socket, limits: Limits) -> bytes | None:
    """What connection has sent (left unread there) once its request line has arrived
    whole, or once read_timeout seconds have passed, the client has stopped sending, or
    a head's max_header_size bytes have come without the line's end; None if nothing
    came, or the connection failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.read_timeout
    more = asyncio.Event()
    fd = connection.fileno()
    seen = b""
    loop.add_reader(fd, more.set)
    try:
        while b"\n" not in seen and len(seen) < limits.max_header_size:
            # readable once a byte more has come (or the client has stopped sending)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, len(seen) + 1)
            more.clear()
            await asyncio.wait_for(more.wait(), deadline - loop.time())
            peeked = connection.recv(limits.max_header_size, socket.MSG_PEEK)
            if len(peeked) == len(seen):  # it stopped
                break
            seen = peeked
    except asyncio.TimeoutError:
        pass
    except OSError:  # it went
        return None
    finally:
        loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return seen or None


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), a free port for 0, that does not listen yet: a
    connection to it is refused until ``listen``.  If it cannot bind (the port is taken,
    say), logs why in one line that names the address and --port, and raises
    SystemExit(2): an option to change, as any other."""
    bound = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind((host, port))
    except OSError as error:
        bound.close()
        _cannot_listen(host, port, error)
    return bound


def listen(bound: socket.socket, backlog: int = 2048) -> socket.socket:
    """bound (from ``bind``), listening and non-blocking; SystemExit(2), as bind's, if
    it cannot listen (another socket took the port meanwhile)."""
    try:
        bound.listen(backlog)
    except OSError as error:
        host, port = bound.getsockname()[:2]
        bound.close()
        _cannot_listen(host, port, error)
    bound.setblocking(False)
    return bound


def _cannot_listen(host: str, port: int, error: OSError) -> NoReturn:
    logger.error("cannot listen on %s:%d: %s (--port picks another port)", host, port, error)
    raise SystemExit(2) from None


async def accept(listener: socket.socket, hand: Callable[[socket.socket], None]) -> None:
    """Accepts connections on listener until cancelled, giving each to hand.  An error
    accepting one (too many open files, say) is logged, and accepting goes on after a
    pause."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                connection, _ = await loop.sock_accept(listener)
            except OSError as error:
                logger.error("accepting a connection failed, trying again in %s s: %s",
                             _ACCEPT_PAUSE, error)
                await asyncio.sleep(_ACCEPT_PAUSE)
                continue
            hand(connection)
    finally:
        listener.close()
