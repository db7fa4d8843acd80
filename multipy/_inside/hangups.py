"""Calls that stop when their client is gone, though they hold the event loop that would
notice it: a model's call that a front end runs on its loop's thread (no ``--timeout``).

A thread of this interpreter looks at the call that the loop's thread runs every
``_TICK`` seconds.  A call it finds running has its connection watched from then on
for its client's end closing (epoll's EPOLLRDHUP: a client that closed its connection,
or was killed), until it ends; a call with a deadline (gRPC's) is looked at by then.
When the client goes, the thread cancels the call as a timeout does
(``_multipy_bootstrap.cancel``: CallCancelled at the call's next bytecode, that call
only), and its request is answered as gone (499).  The loop's thread pays no system
call: short calls end unseen, and the watching thread wakes ``1 / _TICK`` times a
second, whether calls run or not.
"""
from __future__ import annotations

import itertools
import logging
import select
import threading
import time
from typing import Any

import _multipy_bootstrap

from ..serve.http.uvicorn_protocol import connection_of
from ..serve.request.messages import ProtocolError

logger = logging.getLogger("multipy.serve")

#: Serial numbers of this interpreter's cancellable calls (_multipy_bootstrap.call): from
#: 2**63 up, out of reach of the host's (``_host.next_serial``, from 1), whose calls share
#: the registry.
serials = itertools.count(1 << 63)
#: Seconds between the watching thread's looks at the call that runs: the most a gone
#: client's call runs on before its connection is watched (or past its deadline).
_TICK = 0.05
#: What the watcher waits for on a call's connection: its client's end closed, once.
_CLOSED = select.EPOLLRDHUP | select.EPOLLONESHOT


class Hangups:
    """The watch of the calls that one thread runs, one at a time, from ``start()``,
    which that thread (the event loop's) calls, until ``stop()``.  The thread runs each
    call through ``_multipy_bootstrap.call(serial, ...)``, with ``running`` set to
    (serial, its request: an InferRequest) while it runs (set and cleared by the caller,
    on its hot path: no call of this class's), and asks ``gone`` what a CallCancelled
    that it raised means."""

    def __init__(self) -> None:
        self._thread = 0  # the one that calls
        #: the call that runs, as its caller sets it: (its serial, its InferRequest,
        #: whose ``connection`` and ``deadline`` say where its client is)
        self.running: tuple[int, Any] | None = None
        self._gone: int | None = None  # the serial of the call whose client went
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="multipy-serve-hangups",
                                         daemon=True)

    def start(self) -> None:
        """Starts the watch of the calling thread's calls."""
        self._thread = threading.get_ident()
        self._watcher.start()

    def gone(self, serial: int, request: Any) -> ProtocolError | None:
        """The answer (499) to request, whose call serial raised CallCancelled, if this
        watch cancelled it (its client went away, or its deadline passed); None if
        another did."""
        if self._gone != serial:
            return None
        deadline = request.deadline
        why = "the client went away" if deadline is None or time.monotonic() < deadline \
            else "the client's deadline passed"
        return ProtocolError(f"{why}; its call was cancelled", 499)

    def stop(self) -> None:
        """Ends the watch (its thread returns within _TICK seconds)."""
        self._stopping = True
        if self._watcher.is_alive():
            self._watcher.join()

    def _watch(self) -> None:
        watch: tuple[int, Any] | None = None  # (serial, an epoll of its connection only)
        while not self._stopping:
            try:
                watch = self._look(watch)
            except Exception:  # (a watch that fails must not end: say so, and go on)
                logger.exception("the watch of calls whose clients go failed")
                watch = self._unwatch(watch)
                time.sleep(_TICK)
        self._unwatch(watch)

    def _look(self, watch: tuple[int, Any] | None) -> tuple[int, Any] | None:
        """One look at the call that runs, watch being the watch of its connection made
        at an earlier look (an epoll of its own: closed with it, so that no registration
        outlives it, whatever became of the descriptor); the watch to keep."""
        running = self.running
        if watch is not None and (running is None or running[0] != watch[0]):
            watch = self._unwatch(watch)
        timeout = _TICK
        if running is not None and running[0] != self._gone:
            serial, request = running
            deadline = request.deadline
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.monotonic()))
            fd = None if watch is not None or request.connection is None \
                else connection_of(request.connection)
            if fd == -1:  # its client is gone already
                self._cancel(serial)
                return None
            if fd is not None:
                poll = select.epoll()
                try:
                    poll.register(fd, _CLOSED)
                    watch = (serial, poll)
                except OSError:  # closed meanwhile
                    poll.close()
        hung_up = False
        if watch is None:
            time.sleep(timeout)
        else:
            hung_up = bool(watch[1].poll(timeout))
        running = self.running
        if running is None or running[0] == self._gone:
            return watch
        serial, request = running
        if (hung_up and watch is not None and watch[0] == serial) or \
                (request.deadline is not None and time.monotonic() >= request.deadline):
            self._cancel(serial)
        return watch

    def _cancel(self, serial: int) -> None:
        self._gone = serial
        _multipy_bootstrap.cancel(self._thread, serial)

    @staticmethod
    def _unwatch(watch: tuple[int, Any] | None) -> None:
        if watch is not None:
            watch[1].close()
