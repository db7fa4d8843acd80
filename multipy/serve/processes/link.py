"""The link between ``multipy serve --processes``'s supervisor and one server process: a
Unix SOCK_SEQPACKET socket pair, so that each message arrives whole, with the file
descriptors it carries (an accepted connection, the metrics board).

A message is a JSON object with an ``op``:

- supervisor to process: ``start`` (its slot of the metrics board, of how many, and how
  many processes serve; carries the metrics board and the table of refused inputs,
  multipy.serve.request.poison), ``connection`` (carries one accepted connection under a
  ``number``), ``do`` (a model repository request to do here: ``what`` "load" or
  "unload", ``name``, ``archive``; under a ``number``), ``answer`` (to an ``ask``:
  ``number``, ``status``, ``message``), ``ping`` (a health check);
- process to supervisor: ``prepared`` (its models are checked as a single server
  checks them before it listens: it takes connections), ``ready`` (its models
  are loaded: it takes requests), ``ask`` (a repository request that one of its front
  ends received, for every process: ``number``, ``what``, ``name``, ``archive``), ``done``
  (a ``do`` done: ``number``, ``status``, ``message``), ``pong`` (a ``ping`` answered
  from its event loop: ``stuck`` and ``busy`` interpreters, of ``interpreters``, and the
  inference ``requests`` it has answered).

No message exceeds LARGEST bytes: ``send`` refuses one that would (the caller says so
where the request arrived), and ``receive`` drops, and logs, one that is cut or is not
a JSON object with an ``op``, so that nothing read from a link can wedge its reader.
The supervisor's end is non-blocking (read from its event loop); a process's end
blocks, and is read from its event loop when readable (``receive`` never waits).
"""
from __future__ import annotations

import array
import json
import logging
import os
import socket
import threading
from typing import Any

logger = logging.getLogger("multipy.serve")

#: The most bytes one message may take (a repository request's names and paths, which
#: multipy.serve.request.repository bounds well below it).
LARGEST = 1 << 16


_FDS = 4  # the most descriptors one message carries


class TooLarge(ValueError):
    """A message that would take more than LARGEST bytes."""


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

    def send(self, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        """Sends message with fds (which stay open here); OSError if the other end has
        gone (BrokenPipeError) or, on a non-blocking end, cannot take it now
        (BlockingIOError); TooLarge if it would take more than LARGEST bytes."""
        data = json.dumps(message, ensure_ascii=False).encode()
        if len(data) > LARGEST:
            raise TooLarge(f"a {message.get('op')!r} message of {len(data)} bytes (at most "
                           f"{LARGEST})")
        with self._sending:
            socket.send_fds(self.socket, [data], list(fds))

    def first(self) -> tuple[dict[str, Any], list[int]]:
        """The next message, waiting for it (a process's ``start``, which the supervisor
        sends as it starts the process); ConnectionError if the link has closed."""
        data, fds, flags = _receive(self.socket, 0)
        if not data:
            raise ConnectionError("the supervisor closed the link before it said anything")
        message = _parsed(data, flags)
        if message is None:
            raise ConnectionError("the supervisor's first message is not one")
        return message, fds

    def receive(self) -> list[tuple[dict[str, Any], list[int]]] | None:
        """The messages waiting now, each with the descriptors it carried (the caller's
        to close); None once the other end has closed the link.  A message that is not
        one (cut at LARGEST bytes, not a JSON object with an "op") is logged and
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


def _parsed(data: bytes, flags: int) -> dict[str, Any] | None:
    """The message that data holds, or None (logged) if it holds none."""
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > LARGEST:
        logger.error("a link message of more than %d bytes (or with more descriptors than "
                     "one carries) was dropped", LARGEST)
        return None
    try:
        message = json.loads(data)
    except ValueError as error:
        message = error
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        logger.error("a link message that is not one was dropped: %r", data[:200])
        return None
    return message
