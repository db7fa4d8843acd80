"""The link between ``multipy serve --processes``'s supervisor and one server process: a
Unix SOCK_SEQPACKET socket pair, so that each message arrives whole, with the file
descriptors it carries (an accepted connection, the metrics board).

A message is a JSON object with an ``op``:

- supervisor to process: ``start`` (which process it is, of how many; carries the
  metrics board), ``connection`` (carries one accepted connection, which the process owns
  from then on), ``do`` (a model repository request to do here: ``what`` "load" or
  "unload", ``name``, ``archive``; under a ``number``), ``answer`` (to an ``ask``:
  ``number``, ``status``, ``message``);
- process to supervisor: ``prepared`` (its models are checked as a single server
  checks them before it listens: it takes connections), ``ready`` (its models are
  loaded: it takes requests), ``ask``
  (a repository request that one of its front ends received, for every process:
  ``number``, ``what``, ``name``, ``archive``), ``done`` (a ``do`` done: ``number``,
  ``status``, ``message``).

The supervisor's end is non-blocking (read from its event loop); a process's end
blocks, and is read from its event loop when readable (``receive`` never waits).
"""
from __future__ import annotations

import json
import os
import socket
import threading
from typing import Any

#: The most bytes one message may take (a repository request's names and paths).
_LARGEST = 1 << 16


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
        (BlockingIOError)."""
        data = json.dumps(message).encode()
        with self._sending:
            socket.send_fds(self.socket, [data], list(fds))

    def first(self) -> tuple[dict[str, Any], list[int]]:
        """The next message, waiting for it (a process's ``start``, which the supervisor
        sends as it starts the process); ConnectionError if the link has closed."""
        data, fds, _, _ = socket.recv_fds(self.socket, _LARGEST, 4)
        if not data:
            raise ConnectionError("the supervisor closed the link before it said anything")
        return json.loads(data), fds

    def receive(self) -> list[tuple[dict[str, Any], list[int]]] | None:
        """The messages waiting now, each with the descriptors it carried (the caller's
        to close); None once the other end has closed the link."""
        got = []
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.socket, _LARGEST, 4,
                                                  socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return got
            except ConnectionResetError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                return got or None
            got.append((json.loads(data), fds))

    def close(self) -> None:
        self.socket.close()
