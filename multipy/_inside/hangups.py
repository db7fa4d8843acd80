"""Calls that stop when their client is gone, though they hold the event loop that would
notice it: a model's call that a front end runs on its loop's thread (no ``--timeout``).

A thread of this interpreter watches the one call that the loop's thread runs: the
connection it answers, for its client's end of it closing (epoll's EPOLLRDHUP: a client
that closed its connection, or was killed), and the time its client stops waiting (a
gRPC deadline).  When either comes first, it cancels the call as a timeout does
(``_multipy_bootstrap.cancel``: CallCancelled at the call's next bytecode, that call
only), and the call's request is answered as gone (499).  The loop's thread pays one
registration of the connection with epoll and its removal a call, and nothing while no
call runs; the watching thread runs only when a client goes, or a deadline is set.
"""
from __future__ import annotations

import itertools
import os
import select
import threading
import time
from typing import Callable, TypeVar

import _multipy_bootstrap

from ..serve.request.messages import ProtocolError
from ..serve.request.requests import Client

Value = TypeVar("Value")

#: Serial numbers of this interpreter's cancellable calls (_multipy_bootstrap.call): from
#: 2**63 up, out of reach of the host's (``_host.next_serial``, from 1), whose calls share
#: the registry.
serials = itertools.count(1 << 63)
#: What the watcher waits for on a connection: its client's end closed, once.
_CLOSED = select.EPOLLRDHUP | select.EPOLLONESHOT


class Hangups:
    """The watch of the calls that one thread (the event loop's) runs with ``call``, one
    at a time; ``stop()`` ends it."""

    def __init__(self) -> None:
        self._poll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll.register(self._wake, select.EPOLLIN)
        #: the call that runs: (its serial, its connection or -1, its deadline or None,
        #: its thread)
        self._running: tuple[int, int, float | None, int] | None = None
        self._gone: int | None = None  # the serial of the call whose client went
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="multipy-serve-hangups",
                                         daemon=True)
        self._watcher.start()

    def call(self, client: Client, function: Callable[[], Value]) -> Value:
        """function(), cancelled if client goes first; ProtocolError (499) then."""
        fd, deadline = client
        serial = next(serials)
        watched = fd >= 0
        if watched:
            try:
                self._poll.register(fd, _CLOSED)
            except OSError:  # closed meanwhile
                watched = False
        self._running = (serial, fd, deadline, threading.get_ident())
        if deadline is not None:
            os.eventfd_write(self._wake, 1)  # (the watcher waits until then now)
        try:
            return _multipy_bootstrap.call(serial, function)
        except _multipy_bootstrap.CallCancelled:
            if self._gone != serial:  # (only this watch cancels calls of this thread)
                raise
            why = "the client went away" if deadline is None or time.monotonic() < deadline \
                else "the client's deadline passed"
            raise ProtocolError(f"{why}; its call was cancelled", 499) from None
        finally:
            self._running = None
            if watched:
                try:
                    self._poll.unregister(fd)
                except OSError:  # (closed by the model, say)
                    pass

    def stop(self) -> None:
        """Ends the watch (its thread returns)."""
        self._stopping = True
        os.eventfd_write(self._wake, 1)
        self._watcher.join()
        self._poll.close()
        os.close(self._wake)

    def _watch(self) -> None:
        while not self._stopping:
            running = self._running
            deadline = running[2] if running is not None and running[0] != self._gone \
                else None
            timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._poll.poll(timeout)
            if any(fd == self._wake for fd, _ in events):
                os.eventfd_read(self._wake)
            running = self._running
            if running is None or running[0] == self._gone:  # (cancelled once is enough)
                continue
            serial, fd, deadline, thread = running
            if (fd >= 0 and any(each == fd for each, _ in events)) or \
                    (deadline is not None and time.monotonic() >= deadline):
                self._gone = serial
                _multipy_bootstrap.cancel(thread, serial)
