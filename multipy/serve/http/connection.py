"""A connection's limits and sockets for ``multipy serve``, whoever serves it: the limits
a server on the open network needs (``Limits``: enforced by the protocol of
multipy.serve.http.uvicorn_server, the same wherever a connection is served, in an
interpreter's front end or on the host while the models load), binding and listening
(``bind``, ``listen``), accepting (``accept``; ``accept_overdue``, for the connections
that the front ends, which accept on the same socket, have left waiting; ``stop_accepting``
before the listening socket closes), and peeking
at a new connection until its request line is whole (``request_line``: the host chooses
by it where the connection goes).

- A request's head (request line and headers) of more than ``max_header_size`` bytes,
  or with more than ``max_headers`` header fields, is answered 431 and the connection
  closed, before the rest is parsed.
- A request must arrive whole (head and body) within ``read_timeout`` seconds of its
  first byte, and a new connection must start one within as long: else 408 (or, for a
  connection that sent nothing, it is closed).
- A connection that has been answered and has not sent a byte of another request for
  uvicorn's keep-alive timeout is closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

logger = logging.getLogger("multipy.serve")

#: The head of a request (request line and headers), in bytes.
MAX_HEADER_SIZE = 64 << 10
#: Header fields in a request.
MAX_HEADERS = 100
#: Seconds for a request to arrive whole, from its first byte.
READ_TIMEOUT = 60.0
#: Connections the listening socket queues before the kernel refuses more.
BACKLOG = 2048
#: Seconds between a failed accept and the next try.
_ACCEPT_PAUSE = 0.1
#: The most connections accept takes from the queue between two turns of the event loop.
_ACCEPT_BATCH = 64


@dataclass(frozen=True)
class Limits:
    """What a connection may send: see the module's docstring."""

    max_header_size: int = MAX_HEADER_SIZE
    max_headers: int = MAX_HEADERS
    read_timeout: float = READ_TIMEOUT


class Coalescing:
    """A connection's transport that holds an answer's head (uvicorn writes it alone)
    until the first piece of its body, the answer's end or the connection's close, and
    writes the two together: one system call, and for a small answer one TCP segment,
    instead of two.  An interim answer (1xx: the 100 Continue that a client waits for
    before it sends its body) is written at once.  The rest is the transport's own
    (``is_closing``, asked several times a request, without a look-up that fails first);
    ``fd``: its socket's file descriptor (-1 if it has none)."""

    __slots__ = ("_transport", "_head", "fd", "is_closing")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.is_closing = transport.is_closing
        self._head: bytes | None = None
        connection = transport.get_extra_info("socket")
        self.fd = -1 if connection is None else connection.fileno()

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


def listen(bound: socket.socket, backlog: int = BACKLOG) -> socket.socket:
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


def waiting(listener: socket.socket) -> int:
    """How many connections wait in listener's accept queue (Linux's TCP_INFO of a
    listening socket: tcpi_unacked)."""
    info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    return _TCP_INFO.unpack_from(info)[-1]


#: struct tcp_info as far as tcpi_unacked: 8 bytes, then rto, ato, snd_mss, rcv_mss, unacked
_TCP_INFO = struct.Struct("8xIIIII")


async def _readable(fd: int) -> None:
    """Returns once fd is readable (a connection waits in a listener's queue)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(fd)


def _accept_queued(listener: socket.socket, hand: Callable[[socket.socket], None],
                   most: int) -> OSError | None:
    """Accepts up to most connections waiting in listener's queue, giving each to hand
    as it is accepted (so that a cancellation between two awaits loses none); the error
    that stopped it, if one did, or None."""
    for _ in range(most):
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return None
        except OSError as error:  # too many open files, say
            return error
        hand(connection)
    return None


async def accept_overdue(listener: socket.socket, hand: Callable[[socket.socket], None],
                         accepted: Callable[[], int], after: float) -> None:
    """Accepts, until cancelled, the connections that have waited in listener's queue for
    more than after seconds while others accept on it too (the front ends: accepted()
    counts what they have taken, ever), giving each to hand; those they take in time are
    theirs.  It looks at the queue once every after seconds while connections come, and
    sleeps until one comes once a look finds none waiting and none taken since the last.
    (Each look is one callback of the loop's, with no task step, future or sleep of its
    own; under load, no watch of the socket is changed between two.)"""
    watch = _Overdue(listener, hand, accepted, after)
    try:
        await asyncio.get_running_loop().create_future()  # (until cancelled)
    finally:
        watch.stop()


class _Overdue:
    """accept_overdue's watch, from its making until ``stop()``: a connection in the
    queue wakes it (``_came``), which notes what the others have taken and the queue;
    after seconds later ``_look`` accepts the connections noted that the others have not
    taken meanwhile, and notes again for its next look, unless none waits and none was
    taken since (then a connection wakes it again)."""

    def __init__(self, listener: socket.socket, hand: Callable[[socket.socket], None],
                 accepted: Callable[[], int], after: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._listener, self._hand, self._accepted, self._after = \
            listener, hand, accepted, after
        self._fd = listener.fileno()  # (its owner may close it once this stops)
        self._seen = (0, 0)  # (queued, taken) at the last note
        self._look_at: asyncio.TimerHandle | None = None
        self._loop.add_reader(self._fd, self._came)

    def stop(self) -> None:
        self._loop.remove_reader(self._fd)
        if self._look_at is not None:
            self._look_at.cancel()

    def _came(self) -> None:
        self._loop.remove_reader(self._fd)
        self._note(True)

    def _look(self) -> None:
        self._look_at = None
        queued, taken = self._seen
        since = 0
        try:
            since = self._accepted() - taken
            # (the queue is first in, first out: the first `overdue` are those seen before)
            error = _accept_queued(self._listener, self._hand, queued - since)
            if error is not None:
                logger.error("accepting a connection failed: %s", error)
        finally:
            self._note(since > 0)

    def _note(self, came: bool) -> None:
        """Notes what the others have taken, then the queue (in that order: one taken
        between the two makes the next look accept one too few, never one too soon),
        and looks again after seconds if connections came since the last look (woken by
        one, or the others took some) or one waits; else, or if noting failed, sleeps
        until a connection comes."""
        looks = False
        try:
            taken = self._accepted()
            queued = waiting(self._listener)
            if came or queued:
                self._seen = (queued, taken)
                self._look_at = self._loop.call_later(self._after, self._look)
                looks = True
        finally:
            if not looks:
                self._loop.add_reader(self._fd, self._came)


async def stop_accepting(accepting: asyncio.Task, listener: socket.socket) -> None:
    """Cancels accepting (the task of ``accept`` or ``accept_overdue`` on listener), waits
    for it to end, however it ends (an error it ended with is the task's, logged by the
    loop, not raised here), then closes listener.  In that order: a listener closed while
    the event loop still watches it, a watch begun since the loop's last poll, aborts the
    process (uvloop's libuv cannot register the closed descriptor, and calls abort())."""
    accepting.cancel()
    await asyncio.wait([accepting])
    listener.close()


async def accept(listener: socket.socket, hand: Callable[[socket.socket], None]) -> None:
    """Accepts connections on listener until cancelled, giving each to hand as it is
    accepted: cancelled, it has lost none (a connection is accepted only where no await
    separates it from hand).  An error accepting one (too many open files, say) is
    logged, and accepting goes on after a pause."""
    fd = listener.fileno()
    while True:
        await _readable(fd)
        error = _accept_queued(listener, hand, _ACCEPT_BATCH)
        if error is not None:
            logger.error("accepting a connection failed, trying again in %s s: %s",
                         _ACCEPT_PAUSE, error)
            await asyncio.sleep(_ACCEPT_PAUSE)
