"""The inbox of an interpreter's front end: a pipe through which the host hands it
connections and tells it to stop, without waiting for its GIL.

Each message is one native int32 (a write of 4 bytes into a pipe is atomic, so reads
of a multiple of 4 bytes return whole messages): a file descriptor >= 0 is an accepted
connection, which the front end owns from then on; STOP and FORCE stop it; ACCEPT and
PAUSE start and stop its accepting on the server's listening socket.  The host
makes the pipe (``open_inbox``), writes (``send``) and closes both ends once the front
end has ended; the front end reads (``receive``) from its event loop.
"""
from __future__ import annotations

import os
import struct

STOP = -1  #: stop gracefully: every connection sent before is served, every request answered
FORCE = -2  #: stop at once, as uvicorn does on a second Ctrl-C (a model call still ends first)
ACCEPT = -3  #: accept connections on the listening socket while free
PAUSE = -4  #: accept none (the host hands them, if any)
_MESSAGE = struct.Struct("i")


def open_inbox() -> tuple[int, int]:
    """(read end, write end), both non-blocking and closed on exec."""
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def send(write_end: int, message: int) -> None:
    """Writes one message; BlockingIOError if the inbox is full (about 16,000 unread)."""
    os.write(write_end, _MESSAGE.pack(message))


def receive(read_end: int) -> list[int]:
    """The messages waiting now (none if there are none, or the write end is closed)."""
    try:
        data = os.read(read_end, _MESSAGE.size * 1024)
    except BlockingIOError:
        return []
    return [value for (value,) in _MESSAGE.iter_unpack(data)]
