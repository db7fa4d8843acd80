"""The one module that relies on uvicorn beyond its public API: uvicorn's server,
``Config`` and ``Server`` (and its ``LOGGING_CONFIG``) without its command line; the
httptools protocol that every connection of ``multipy serve`` is served with, under the
limits of multipy.serve.http.connection.Limits (``guarded``); and ``write_answer``, which
writes a whole answer through that protocol's request cycle at once.  ``RELIED_ON`` names
every attribute of uvicorn's own that this module (and the server's life, which runs
uvicorn's ``Server``) uses beyond that API; tests/test_uvicorn_seam.py checks each on
the installed uvicorn, and fails with its name on a uvicorn that lacks it.

Importing any of uvicorn's modules runs its package's ``__init__``, which imports
``uvicorn.main``: its command line, with click, watchfiles and the supervisors'
multiprocessing (about 2 MiB of a process's memory, in the host and in every
interpreter's front end), none of which a server started from code uses.  This module
imports uvicorn's package without running that ``__init__`` (the package's module made
from its spec, as the import system makes it, and registered), then the modules of the
server that it needs.  The package then has ``Config`` and ``Server``, which uvicorn's
own modules import from it; the first use of any other of its names (``uvicorn.run``,
``uvicorn.__version__``: code of others', Ray Serve's say) runs the real ``__init__``
then, so that such code finds the package whole.  Where uvicorn's package is imported
already, it is used as it is.

A connection served by ``guarded``'s protocol:

- has its request's head counted as it comes (431 past --max-header-size or
  --max-headers), and its request timed from its first byte (408 past --read-timeout);
  a body that httptools reads as chunked though its Transfer-Encoding is not chunked
  alone (``gzip, chunked``: the model would get it still encoded) is a 501, checked at
  its first chunk (httptools refuses the other codings: 400);
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
import importlib.util
import json
import sys
from types import ModuleType
from typing import Any, Callable

import httptools

from .connection import Coalescing, Limits


def _package() -> ModuleType:
    """uvicorn's package, registered in sys.modules; its ``__init__`` not run, unless
    someone imported it before."""
    found = sys.modules.get("uvicorn")
    if found is not None:
        return found
    spec = importlib.util.find_spec("uvicorn")
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")
    package = importlib.util.module_from_spec(spec)
    ran = []

    def whole(name: str) -> Any:
        """A name of the package that is not set yet: the real ``__init__`` runs first
        (once)."""
        if not ran:
            ran.append(True)
            spec.loader.exec_module(package)
        try:
            return vars(package)[name]
        except KeyError:
            raise AttributeError(f"module 'uvicorn' has no attribute {name!r}") from None

    package.__getattr__ = whole  # type: ignore[attr-defined]
    sys.modules["uvicorn"] = package
    return package


_uvicorn = _package()

from uvicorn.config import LOGGING_CONFIG, Config  # noqa: E402
from uvicorn.server import Server  # noqa: E402

_uvicorn.Config, _uvicorn.Server = Config, Server  # as its __init__ sets them

# (the HTTP protocol that Config picks, httptools's: its status lines and request cycle)
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle  # noqa: E402

__all__ = ["Config", "LOGGING_CONFIG", "RELIED_ON", "Server", "connection_of", "guarded",
           "write_answer"]

_PROTOCOL = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"
_CYCLE = "uvicorn.protocols.http.httptools_impl.RequestResponseCycle"
_SERVER = "uvicorn.server.Server"
_FLOW = "uvicorn.protocols.http.flow_control.FlowControl"
#: What of uvicorn's own this module, and the server that runs uvicorn's ``Server``
#: (multipy.serve.main, multipy._inside.front_end), use beyond its public API, as
#: (where, name, kind): kind "method" (a function of that class, called or overridden
#: with these parameters), "attribute" (set on its instances by that class's code) or
#: "name" (of that module).  tests/test_uvicorn_seam.py checks each.
RELIED_ON: tuple[tuple[str, str, str], ...] = (
    ("uvicorn.protocols.http.httptools_impl", "STATUS_LINE", "name"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle", "name"),
    (_PROTOCOL, "connection_made(transport)", "method"),
    (_PROTOCOL, "connection_lost(exc)", "method"),
    (_PROTOCOL, "data_received(data)", "method"),
    (_PROTOCOL, "on_message_begin()", "method"),
    (_PROTOCOL, "on_header(name, value)", "method"),
    (_PROTOCOL, "on_headers_complete()", "method"),
    (_PROTOCOL, "on_message_complete()", "method"),
    (_PROTOCOL, "on_response_complete()", "method"),
    (_PROTOCOL, "send_400_response(msg)", "method"),
    (_PROTOCOL, "_start_asgi_task(cycle, app)", "method"),
    (_PROTOCOL, "_unsupported_upgrade_warning()", "method"),
    (_PROTOCOL, "transport", "attribute"),
    (_PROTOCOL, "parser", "attribute"),
    (_PROTOCOL, "headers", "attribute"),
    (_PROTOCOL, "cycle", "attribute"),
    (_PROTOCOL, "pipeline", "attribute"),
    (_PROTOCOL, "flow", "attribute"),
    (_PROTOCOL, "loop", "attribute"),
    (_PROTOCOL, "logger", "attribute"),
    (_PROTOCOL, "server_state", "attribute"),
    (_PROTOCOL, "timeout_keep_alive", "attribute"),
    (_CYCLE, "on_response", "attribute"),
    (_CYCLE, "transport", "attribute"),
    (_CYCLE, "flow", "attribute"),
    (_CYCLE, "scope", "attribute"),
    (_CYCLE, "access_log", "attribute"),
    (_CYCLE, "default_headers", "attribute"),
    (_CYCLE, "message_event", "attribute"),
    (_CYCLE, "disconnected", "attribute"),
    (_CYCLE, "keep_alive", "attribute"),
    (_CYCLE, "waiting_for_100_continue", "attribute"),
    (_CYCLE, "response_started", "attribute"),
    (_CYCLE, "response_complete", "attribute"),
    (_CYCLE, "more_body", "attribute"),
    (_FLOW, "read_paused", "attribute"),
    (_FLOW, "write_paused", "attribute"),
    (_FLOW, "resume_reading()", "method"),
    ("uvicorn.server.ServerState", "total_requests", "attribute"),
    ("uvicorn.server.ServerState", "connections", "attribute"),
    ("uvicorn.config.Config", "http_protocol_class", "attribute"),
    (_SERVER, "startup(sockets)", "method"),
    (_SERVER, "shutdown(sockets)", "method"),
    (_SERVER, "handle_exit(sig, frame)", "method"),
    (_SERVER, "capture_signals()", "method"),
    (_SERVER, "server_state", "attribute"),
    (_SERVER, "lifespan", "attribute"),
    (_SERVER, "started", "attribute"),
    (_SERVER, "should_exit", "attribute"),
    (_SERVER, "force_exit", "attribute"),
)
#: The bytes of empty lines, which before a request are ignored (RFC 9112, 2.2): they do
#: not end a connection's idle time.
_EMPTY_LINES = b"\r\n"



def connection_of(send: Callable) -> int | None:
    """The file descriptor of the connection whose request send (a cycle's of
    ``guarded``'s protocol) answers; -1 once its client has gone (the descriptor may be
    another connection's by then); None for another server's send."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return None
    return -1 if cycle.disconnected else cycle.transport.fd


def write_answer(send: Callable, status: int, head: bytes, body: bytes) -> bool:
    """Writes a whole answer, status with head (its header lines but Content-Length, each
    ending in CRLF, valid as they are) and body, in one write, as uvicorn's httptools
    cycle writes the two ASGI messages of it (its start, with a Content-Length, and its
    body), when send is such a cycle's send, ready to write, and returns True: the
    answer is complete, and the connection closed unless it is kept alive.  False, with
    nothing done, when send is another server's, or the cycle's writes wait to drain, or
    it would log the answer, or has begun one, or its client has gone: the caller sends
    the messages then."""
    cycle = getattr(send, "__self__", None)
    if (type(cycle) is not RequestResponseCycle or cycle.response_started
            or cycle.disconnected or cycle.flow.write_paused or cycle.access_log
            or cycle.scope["method"] == "HEAD"):
        return False
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    lines = [STATUS_LINE[status]]
    lines += [b"%s: %s\r\n" % pair for pair in cycle.default_headers]  # (server, date)
    lines += [head, b"content-length: %d\r\n" % len(body)]
    if not cycle.keep_alive:
        lines.append(b"connection: close\r\n")
    lines += [b"\r\n", body]
    cycle.transport.write(b"".join(lines))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


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
            self.transport = Coalescing(transport)  # (flow control: the real one)
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

        def on_chunk_header(self) -> None:  # (a body read as chunked: see the docstring)
            for name, value in self.headers:
                if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
                    shown = value[:40].decode("latin-1")
                    self._refusal = (501, f"Transfer-Encoding {shown!r} is not supported: "
                                          f"only chunked")
                    raise _Refused

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
