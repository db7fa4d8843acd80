"""The channel between host threads and one interpreter's thread.

Every message is a fixed-size header written atomically to a pipe; no payload ever
travels through one.  A payload is a ``bytes`` object that its sender keeps alive
while the receiver copies it straight out of the sender's memory (host and
interpreters share one address space; DESIGN.md 3.8: nothing is freed across the
boundary, each side frees only what it allocated).

* Requests go to the interpreter's request pipe.  A call names the reply pipe of the
  calling host thread (each host thread owns one), so replies go straight to the
  waiting thread with no dispatcher in between.
* The host keeps a request's bytes until its reply arrives.  The interpreter keeps
  each reply's bytes until it sends the next reply to the same pipe, by which time
  the host has copied them.
* A waiting side first polls its pipe for a moment, yielding the CPU between polls,
  and only then sleeps: waking a sleeping thread costs tens of microseconds on a
  virtual machine, while a call often answers within a few.  Of the host threads
  waiting at one time, one polls and the others sleep (see _polling_until).
* Tokens of lent tensors that an interpreter no longer aliases go back on a pipe of
  their own, which the host drains after a call when a shared counter says it was
  written to; the interpreter never blocks on it (what does not fit waits for the
  next chance).  Not in replies: the reply to a call its caller gave up on may never
  be read.
* A reply that arrives for a call its caller gave up on (timeout, Ctrl-C) is
  discarded by the owner of the reply pipe; it is never delivered to another call.
  A reply that creates an object carries its handle in the header, so that
  discarding it releases the object without reading a payload that may be gone.
"""
from __future__ import annotations

import ctypes
import fcntl
import itertools
import os
import select
import struct
import threading
import time
import weakref
from typing import Callable

from ._sharing import Exports

#: kind, reply fd, request id (or handle id for RELEASE), payload address, payload
#: length, when it was sent (time.monotonic())
REQUEST = struct.Struct("=IiQQQd")
#: request id, new object handle (0: none), payload address, payload length, status
REPLY = struct.Struct("=QQQQI")

CALL, RELEASE, STOP = 1, 2, 3
OK, ERROR, CLOSED = 0, 1, 2
#: A token of a host object an interpreter no longer aliases, on the release pipe.
TOKEN = struct.Struct("=Q")

#: How long a waiting side polls before it sleeps.  Longer polls catch the replies of
#: longer calls, but polling callers take CPU from the interpreters (measured: worse
#: throughput with two interpreters on two cores).  An interpreter polls only while
#: its requests come within this time of its replies (see InterpreterEnd.serve).
SPIN_SECONDS = 100e-6
#: Room in an interpreter's request pipe: thousands of headers before a writer blocks.
REQUEST_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

_probe = b"probe"
#: Offset of a bytes object's data from its id() in this CPython.
_BYTES_DATA = ctypes.cast(ctypes.c_char_p(_probe), ctypes.c_void_p).value - id(_probe)
del _probe


def address_of(data: bytes) -> int:
    """Address of the bytes' data; valid while the object is alive."""
    return id(data) + _BYTES_DATA


def copy_from(address: int, length: int) -> bytes:
    """A private copy of length bytes at address (memory the other side keeps alive)."""
    return ctypes.string_at(address, length) if length else b""


def make_pipe(size: int | None = None) -> tuple[int, int]:
    """A pipe for headers: its read end does not block (see _read), its write end does.
    size: room to ask for (reply pipes keep the default: they hold a few headers)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    if size:
        try:
            fcntl.fcntl(write_fd, _F_SETPIPE_SZ, size)
        except OSError:
            pass  # the system's default size still works; writers may block sooner
    return read_fd, write_fd


def _read(fd: int, size: int, deadline: float | None, spin: float) -> bytes:
    """Reads at most size bytes: polls for spin seconds (if no other thread of this
    interpreter is polling), then sleeps until data arrives or the deadline
    (time.monotonic()) passes (TimeoutError)."""
    global _polling_until
    spin_until = None
    while True:
        try:
            data = os.read(fd, size)
        except BlockingIOError:
            now = time.monotonic()
            if spin_until is None:
                spin_until = now + spin if spin > 0 and now >= _polling_until else now
                if spin_until > now:
                    _polling_until = spin_until
            if now < spin_until:
                os.sched_yield()
                continue
            if deadline is not None and now >= deadline:
                raise TimeoutError("the interpreter did not answer in time") from None
            poller = select.poll()  # unlike select(), any fd number
            poller.register(fd, select.POLLIN)
            poller.poll(None if deadline is None else max(0, (deadline - now) * 1000))
            continue
        if spin_until and _polling_until == spin_until:
            _polling_until = 0.0  # done polling: another thread may
        if not data:
            raise EOFError("channel closed")
        return data


#: Until when (time.monotonic()) a thread of this interpreter polls.  Polling releases
#: and retakes the GIL on every try, stalling the interpreter's other threads' Python
#: (and polling threads take CPU from the interpreters): with several host threads
#: waiting, one polls and the others sleep.  A deadline, not a lock: nothing is left
#: held when an exception interrupts a poll.
_polling_until = 0.0


def read_header(fd: int, header: struct.Struct, deadline: float | None = None,
                spin: float | None = None) -> tuple:
    """Reads one whole header (headers are written atomically; the loop is defensive)."""
    data = _read(fd, header.size, deadline, SPIN_SECONDS if spin is None else spin)
    while len(data) < header.size:
        data += _read(fd, header.size - len(data), None, SPIN_SECONDS)
    return header.unpack(data)


_request_ids = itertools.count(1)

#: The tensors and arrays the host lent to interpreters (see _sharing), until an
#: interpreter gives their tokens back.
host_exports = Exports()


class _ReplyPipe:
    """The reply pipe of one host thread, and the calls it still waits for."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = make_pipe()
        #: request id -> (request bytes kept alive, channel that releases a late reply's object)
        self.pending: dict[int, tuple[bytes, HostEnd]] = {}

    def wait(self, request_id: int, deadline: float | None) -> tuple[int, int, int, int]:
        """Waits for request_id's reply; returns (status, handle, address, length)."""
        while True:
            reply_id, handle, address, length, status = read_header(self.read_fd, REPLY, deadline)
            _, channel = self.pending.pop(reply_id, (None, None))
            if reply_id == request_id:
                return status, handle, address, length
            if handle and channel is not None:  # a late reply to a call that was given up
                channel.release(handle)

    def __del__(self) -> None:
        if self.pending:
            # Replies are still due (calls given up by a thread that has ended): keep the
            # pipe open so that no other file can take its number while they arrive.
            if _abandoned is not None:  # None while Python itself shuts down
                _abandoned.append(self)
        else:
            os.close(self.read_fd)
            os.close(self.write_fd)


_abandoned: list[_ReplyPipe] = []
_thread_reply = threading.local()


def _reply_pipe() -> _ReplyPipe:
    try:
        return _thread_reply.pipe
    except AttributeError:
        _thread_reply.pipe = pipe = _ReplyPipe()
        return pipe


class ChannelClosedError(Exception):
    """The interpreter end of the channel is stopped."""


def _stop_all_in_child() -> None:
    """After fork the interpreters' threads do not exist in the child: its calls and
    releases must not reach the parent's interpreters through the inherited pipes."""
    for end in list(_host_ends):
        end._closed_because = "it belongs to the parent of this forked process"


_host_ends: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=_stop_all_in_child)


#: Words of host memory both ends of a channel read: set by the host (stopping), and
#: by the interpreter (calls completed; loop finished; writes to the release pipe).
_STOPPING, _COMPLETED, _FINISHED, _RELEASE_WRITES = range(4)
_STATE = ctypes.c_uint64 * 4


class HostEnd:
    """The host's end of the channel to one interpreter; safe to use from any thread."""

    def __init__(self, request_fd: int, released_fd: int) -> None:
        self._request_fd = request_fd
        self._released_fd = released_fd  # read end of the interpreter's release pipe
        self._lock = threading.RLock()  # an Obj finaliser may release while a send holds it
        self._closed_because: str | None = None  # why the interpreter cannot be reached
        self._state = _STATE()  # shared with the interpreter end
        self._calls_sent = 0       # calls written, in the order the interpreter runs them
        self._last_abandoned = 0   # the latest call a caller gave up on
        self._release_writes_seen = 0  # _RELEASE_WRITES when the release pipe was last drained
        _host_ends.add(self)

    @property
    def state_address(self) -> int:
        """Where the interpreter end finds the words it shares with this end."""
        return ctypes.addressof(self._state)

    def loop_finished(self) -> bool:
        """Whether the interpreter's loop has ended (after stop(): it is finalising)."""
        return bool(self._state[_FINISHED])

    def running_abandoned_call(self) -> bool:
        """Whether the interpreter still runs (or has queued) a call its caller gave up on."""
        return self._state[_COMPLETED] < self._last_abandoned

    def _send(self, kind: int, reply_fd: int, ident: int, data: bytes) -> int:
        """Writes one request; returns a CALL's position among the calls sent."""
        header = REQUEST.pack(kind, reply_fd, ident, address_of(data), len(data),
                              time.monotonic())
        with self._lock:
            if self._closed_because:
                raise ChannelClosedError(self._closed_because)
            os.write(self._request_fd, header)
            if kind == CALL:
                self._calls_sent += 1
            return self._calls_sent

    def call(self, data: bytes, timeout: float | None = None) -> tuple[int, int, bytes]:
        """Sends a request and waits for its reply: (status, new object handle, bytes).

        On timeout (TimeoutError) or interruption the call is given up: its late reply
        is discarded, and the object it created released, by a later call of this thread.
        """
        pipe = _reply_pipe()
        request_id = next(_request_ids)
        pipe.pending[request_id] = (data, self)
        position = self._calls_sent + 1  # at least: if sending is interrupted, it may be sent
        try:
            try:
                position = self._send(CALL, pipe.write_fd, request_id, data)
            except (ChannelClosedError, OSError):
                del pipe.pending[request_id]  # surely not sent
                raise
            deadline = None if timeout is None else time.monotonic() + timeout
            status, handle, address, length = pipe.wait(request_id, deadline)
        except BaseException:  # timeout, Ctrl-C: the call runs on without its caller
            if request_id in pipe.pending:
                with self._lock:
                    self._last_abandoned = max(self._last_abandoned, position)
            raise
        reply = copy_from(address, length)
        self.drain_released()
        return status, handle, reply

    def drain_released(self) -> None:
        """Frees the host objects the interpreter gave back on its release pipe; reads
        the pipe only if the interpreter wrote to it since the last time; never blocks."""
        writes = self._state[_RELEASE_WRITES]  # read before draining: later writes count again
        if writes == self._release_writes_seen:
            return
        while True:
            try:
                data = os.read(self._released_fd, 1 << 16)
            except BlockingIOError:
                self._release_writes_seen = writes  # not before: an interrupted drain repeats
                return
            for (token,) in TOKEN.iter_unpack(data):  # tokens are written whole
                host_exports.release(token)

    def release(self, handle: int) -> None:
        """Tells the interpreter to drop an object handle; does not wait."""
        try:
            self._send(RELEASE, -1, handle, b"")
        except (ChannelClosedError, OSError):
            pass  # the interpreter is gone, and its objects with it

    def stop(self) -> None:
        """Asks the interpreter's loop to end: calls already queued get CLOSED."""
        with self._lock:
            if not self._closed_because:
                self._closed_because = "the interpreter is stopped: the process is exiting"
                self._state[_STOPPING] = 1
                os.write(self._request_fd, REQUEST.pack(STOP, -1, 0, 0, 0, 0.0))


class InterpreterEnd:
    """The interpreter thread's end: reads requests and writes replies, in order.

    Tokens appended to ``released`` (host objects this interpreter no longer aliases)
    go back to the host on the release pipe, after each request.
    """

    def __init__(self, request_fd: int, released_fd: int, state_address: int) -> None:
        self._request_fd = request_fd
        self._released_fd = released_fd  # write end, not blocking: see _send_released
        self._state = _STATE.from_address(state_address)  # the host's memory
        self._last_reply: dict[int, bytes] = {}
        self.released: list[int] = []

    def _send_released(self) -> None:
        """Gives tokens back on the release pipe; what does not fit in it now waits."""
        batch = 4096 // TOKEN.size  # one write of at most PIPE_BUF bytes is whole
        while self.released:
            try:
                os.write(self._released_fd, b"".join(map(TOKEN.pack, self.released[:batch])))
            except BlockingIOError:
                return
            del self.released[:batch]
            self._state[_RELEASE_WRITES] += 1

    def serve(self, handle_call: Callable[[bytes], tuple[int, int, bytes]],
              release: Callable[[int], None]) -> None:
        """Runs until STOP: each CALL's payload goes to handle_call, whose
        (status, new object handle, bytes) is sent back to the caller's reply pipe.
        handle_call must not raise; a reply that cannot be written is dropped.

        After a reply it polls for the next request only if the last one was sent within
        SPIN_SECONDS of the reply before it: for calls that come far apart (a host thread
        that has more to do between calls) polling only takes CPU from other threads."""
        spin, replied = SPIN_SECONDS, time.monotonic()
        while True:
            kind, reply_fd, ident, address, length, sent = read_header(
                self._request_fd, REQUEST, spin=spin)
            if kind == CALL:
                spin = SPIN_SECONDS if sent - replied < SPIN_SECONDS else 0.0
                if self._state[_STOPPING]:  # the process is exiting: drop what is queued
                    status, handle, data = CLOSED, 0, b""
                else:
                    status, handle, data = handle_call(copy_from(address, length))
                self._last_reply[reply_fd] = data  # alive until the caller has copied it
                self._send_released()
                try:
                    os.write(reply_fd, REPLY.pack(ident, handle, address_of(data), len(data),
                                                  status))
                except OSError:
                    pass  # the caller's pipe is gone: nobody waits for this reply
                replied = time.monotonic()
                self._state[_COMPLETED] += 1
            elif kind == RELEASE:
                release(ident)
                self._send_released()
            elif kind == STOP:
                # Host threads may still be copying the last replies while this
                # interpreter finalises: never free them.
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._last_reply))
                self._state[_FINISHED] = 1
                return
