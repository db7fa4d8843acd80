"""The link between ``multipy serve --processes``'s supervisor and one server process: a
Unix SOCK_SEQPACKET socket pair, so that each message arrives whole, with the file
descriptors it carries (an accepted connection, the metrics board).

Each message is one of the frozen dataclasses below, written as a JSON object whose
``op`` names its class (``encode``) and read back into one (``decode``):

- supervisor to process: ``Start`` (its slot of the metrics board, of how many, and how
  many processes serve; carries the metrics board, the table of refused inputs,
  multipy.serve.request.poison, and the server's listening socket), ``Accepting``
  (whether its front ends accept connections on that socket themselves), ``Connection``
  (carries one accepted connection under a ``number``), ``Do`` (a model repository
  request to do here, under a ``number``), ``Answer`` (to an ``Ask``), ``Ping`` (a
  health check);
- process to supervisor: ``Prepared`` (its models are checked as a single server
  checks them before it listens: it takes connections), ``Ready`` (its models are
  loaded: it takes requests), ``Ask`` (a repository request that one of its front ends
  received, for every process), ``Returned`` (carries a connection that its front ends
  accepted while every one ran a call, for another process), ``Done`` (a ``Do``
  done), ``Pong`` (a ``Ping`` answered
  from its event loop: its ``stuck`` and ``busy`` interpreters, of ``interpreters``).

No message exceeds LARGEST bytes: ``send`` refuses one that would (the caller says so
where the request arrived), and ``receive`` drops, and logs, one that is cut or is not
one of these messages with fields of their types, so that nothing read from a link can
wedge its reader.  The supervisor's end is non-blocking (read from its event loop); a
process's end blocks, and is read from its event loop when readable (``receive`` never
waits).
"""
from __future__ import annotations

import array
import functools
import json
import logging
import os
import socket
import threading
import typing
from dataclasses import dataclass, field
from typing import Union

logger = logging.getLogger("multipy.serve")

#: The most bytes one message may take (a repository request's names and paths, which
#: multipy.serve.request.repository bounds well below it).
LARGEST = 1 << 16


_FDS = 4  # the most descriptors one message carries


class TooLarge(ValueError):
    """A message that would take more than LARGEST bytes."""


# -- the messages --

@dataclass(frozen=True)
class Start:
    """Supervisor to process, first: its slot of the metrics board, of ``slots``, and
    how many processes serve (carries the board, the table of refused inputs and the
    server's listening socket)."""

    process: int
    processes: int
    slots: int


@dataclass(frozen=True)
class Accepting:
    """Supervisor to process: whether its front ends accept connections on the server's
    listening socket themselves (``on``), as they do while it is ready, answers and has
    an interpreter that is not stuck."""

    on: bool


@dataclass(frozen=True)
class Connection:
    """Supervisor to process: one accepted connection (carried), under a number."""

    number: int


@dataclass(frozen=True)
class RepositoryRequest:
    """A model repository request: ``what`` ("load" or "unload") model ``name``,
    loaded from ``archive`` (the load request's body; {} for an unload)."""

    what: str
    name: str
    archive: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Do:
    """Supervisor to process: do ``request`` here, and say how it went (``Done``)."""

    number: int
    request: RepositoryRequest


@dataclass(frozen=True)
class Ask:
    """Process to supervisor: have every process do ``request``, which one of this
    process's front ends received, and say how it went (``Answer``)."""

    number: int
    request: RepositoryRequest


@dataclass(frozen=True)
class Done:
    """Process to supervisor: ``Do`` number went as status (HTTP's) and message say."""

    number: int
    status: int
    message: str = ""


@dataclass(frozen=True)
class Answer:
    """Supervisor to process: ``Ask`` number went as status and message say."""

    number: int
    status: int
    message: str = ""


@dataclass(frozen=True)
class Ping:
    """Supervisor to process: a health check, answered with a ``Pong``."""


@dataclass(frozen=True)
class Pong:
    """Process to supervisor: its interpreters, and how many are stuck and busy."""

    interpreters: int = 1
    stuck: int = 0
    busy: int = 0


@dataclass(frozen=True)
class Returned:
    """Process to supervisor: a connection (carried) that its front ends accepted while
    every one of them ran a call, for another process."""


@dataclass(frozen=True)
class Prepared:
    """Process to supervisor: its models are checked; it takes connections."""


@dataclass(frozen=True)
class Ready:
    """Process to supervisor: its models are loaded."""


Message = Union[Start, Accepting, Connection, Do, Ask, Done, Answer, Ping, Pong, Returned,
                Prepared, Ready]

_KINDS: dict[str, type] = {kind.__name__.lower(): kind for kind in typing.get_args(Message)}


def encode(message: Message) -> bytes:
    """message as the bytes that carry it: the JSON object of its fields, and its
    class's name, lowercase, as ``op``."""
    return json.dumps({"op": type(message).__name__.lower(), **vars(message)},
                      ensure_ascii=False, default=vars).encode()  # (vars: a field's own)


def decode(data: bytes) -> Message:
    """The message that data carries; ValueError if it carries none (not JSON, not an
    object, an unknown ``op``, a field missing, unknown or of another type)."""
    value = json.loads(data)
    kind = _KINDS.get(value.get("op")) if isinstance(value, dict) else None
    if kind is None:
        raise ValueError("not a message")
    return _built({k: v for k, v in value.items() if k != "op"}, kind)


@functools.cache
def _hints(kind: type) -> dict[str, object]:
    return typing.get_type_hints(kind)


def _built(value: object, kind: object) -> object:
    """value (decoded JSON) as kind: a message's class (or RepositoryRequest), int, str,
    bool or dict[str, str]; ValueError if it is not one."""
    if kind in (int, str, bool):
        if type(value) is not kind:  # (a bool is not an int here)
            raise ValueError(f"{value!r} is not a {kind.__name__}")
        return value
    if typing.get_origin(kind) is dict:
        if not isinstance(value, dict) or not all(
                type(k) is str and type(v) is str for k, v in value.items()):
            raise ValueError(f"{value!r} is not an object of strings")
        return value
    hints = _hints(kind)
    if not isinstance(value, dict) or set(value) - set(hints):
        raise ValueError(f"{value!r} is not a {kind.__name__}")
    try:
        return kind(**{name: _built(item, hints[name]) for name, item in value.items()})
    except TypeError as error:  # a field missing
        raise ValueError(str(error)) from None


def pair() -> tuple[Link, socket.socket]:
    """(the supervisor's end, the process's end, inheritable: passed to it by exec)."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    here.setblocking(False)
    there.set_inheritable(True)
    return Link(here), there


class Link:
    """One end of a link: ``send`` and ``receive`` whole messages, each with the file
    descriptors it carries.  Sends from several threads are each whole."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._sending = threading.Lock()

    @classmethod
    def inherited(cls, fd: int) -> Link:
        """The process's end, from the descriptor it was given."""
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.socket.fileno()

    def send(self, message: Message, fds: tuple[int, ...] = ()) -> None:
        """Sends message with fds (which stay open here); OSError if the other end has
        gone (BrokenPipeError) or, on a non-blocking end, cannot take it now
        (BlockingIOError); TooLarge if it would take more than LARGEST bytes."""
        data = encode(message)
        if len(data) > LARGEST:
            raise TooLarge(f"a {type(message).__name__} message of {len(data)} bytes (at "
                           f"most {LARGEST})")
        with self._sending:
            socket.send_fds(self.socket, [data], list(fds))

    def first(self) -> tuple[Message, list[int]]:
        """The next message, waiting for it (a process's ``Start``, which the supervisor
        sends as it starts the process); ConnectionError if the link has closed or
        that is not a message."""
        data, fds, flags = _receive(self.socket, 0)
        if not data:
            raise ConnectionError("the supervisor closed the link before it said anything")
        message = _parsed(data, flags)
        if message is None:
            raise ConnectionError("the supervisor's first message is not one")
        return message, fds

    def receive(self) -> list[tuple[Message, list[int]]] | None:
        """The messages waiting now, each with the descriptors it carried (the caller's
        to close); None once the other end has closed the link.  One that is not a
        message (cut at LARGEST bytes, or not one that ``decode`` reads) is logged and
        dropped, its descriptors closed."""
        got = []
        while True:
            try:
                data, fds, flags = _receive(self.socket, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return got
            except ConnectionResetError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                return got or None
            message = _parsed(data, flags)
            if message is None:
                for fd in fds:
                    os.close(fd)
                continue
            got.append((message, fds))

    def close(self) -> None:
        self.socket.close()


def _receive(sock: socket.socket, flags: int) -> tuple[bytes, list[int], int]:
    """(data, descriptors, the message's flags) of the next message, with recvmsg's
    flags (socket.recv_fds before CPython 3.12 drops them: MSG_DONTWAIT would wait)."""
    fds = array.array("i")
    data, ancillary, got, _ = sock.recvmsg(LARGEST + 1, socket.CMSG_LEN(_FDS * fds.itemsize),
                                           flags)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), got


def _parsed(data: bytes, flags: int) -> Message | None:
    """The message that data holds, or None (logged) if it holds none."""
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > LARGEST:
        logger.error("a link message of more than %d bytes (or with more descriptors than "
                     "one carries) was dropped", LARGEST)
        return None
    try:
        return decode(data)
    except ValueError as error:  # (json's JSONDecodeError and UnicodeDecodeError are too)
        logger.error("a link message that is not one was dropped (%s): %r", error, data[:200])
        return None
