"""The interpreters' front ends of a server, as the host runs them (``FrontEnds``): each
in its interpreter, on a host thread of its own, handed connections through its inbox
(multipy.serve.http.inbox) and told of the model repository's changes through
multipy.serve.host.control."""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading

from ..http.inbox import ACCEPT, FORCE, PAUSE, STOP, open_inbox, receive, send
from ..request.contract import FrontEndCalls, FrontEndSettings
from ..request.metrics import Metrics
from .control import Control, Repository
from .service import Service

logger = logging.getLogger("multipy.serve")

#: seconds a front end may take to start serving
_START_TIMEOUT = 60.0


class FrontEnds:
    """The interpreters' front ends (multipy._inside.front_end), once the models are
    ready: each runs in its interpreter on a host thread of its own.  Given the
    server's listening socket, each accepts its connections itself while it is free
    (multipy._inside.front_end); ``hand`` gives a connection that the host accepted to
    the one with the fewest open connections (then the fewest calls running), skipping
    any that has stopped, by writing its file descriptor into that front end's inbox:
    the host never waits for an interpreter's GIL to hand one.
    The host owns the inboxes: what a front end leaves in its inbox when it ends, the
    host closes."""

    def __init__(self) -> None:
        self._fronts: list[FrontEndCalls] = []  # the FrontEnd in each interpreter
        self._threads: list[threading.Thread] = []
        self._inboxes: list[tuple[int, int]] = []  # (read end, write end) of each
        self._handed: list[int] = []  # connections handed to each, ever
        #: (read end, write end) of the pipe of connections the front ends give back
        self._given = open_inbox()
        self._metrics: Metrics | None = None
        self._control: Control | None = None
        self._stopping = False
        self._forced = False
        #: whether the front ends accept on the listening socket, once told (None: not yet)
        self._accepting: bool | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a front end ended, or force

    def start(self, service: Service, grpc: str | None = None,
              repository: Repository | None = None,
              listener: socket.socket | None = None, accepting: bool = True) -> None:
        """Makes a front end in each interpreter of service, which is loaded, and runs
        them, each also serving gRPC on grpc ("HOST:PORT") if given, their model
        repository requests done by repository (default: the service; see
        multipy.serve.host.control), and each accepting connections on listener itself
        if given, from the start if accepting, else once ``accepting(True)``; raises
        what failed."""
        with self._lock:
            if self._accepting is None:
                self._accepting = accepting
        options, metrics = service.options, service.metrics
        settings = FrontEndSettings(
            names=tuple(service.models),
            described={name: model.described for name, model in service.models.items()},
            states=dict(service.states), interpreters=service.interpreters,
            board=metrics.board.address, rows=metrics.board.rows, first=metrics.first,
            processes=metrics.processes, cores=metrics.cores, slots=metrics.slots,
            stuck_after=metrics.stuck_after, max_batch_size=options.max_batch_size,
            batch_delay=options.batch_timeout_ms / 1000, timeout=options.timeout,
            max_request_size=options.max_request_size, limits=options.limits,
            graceful_timeout=options.graceful_timeout, grpc=grpc,
            model_control=service.model_control, strict_readiness=service.strict_readiness,
            http_restricted=service.http_restricted, grpc_restricted=service.grpc_restricted,
            refused=None if service.refused is None else service.refused.address,
            listener=-1 if listener is None else listener.fileno(), accepting=self._accepting,
            given_back=self._given[1])
        fronts, inboxes, controls = [], [], []
        interpreters = service.manager.all_instances()
        try:
            for k, interpreter in enumerate(interpreters):
                inboxes.append(open_inbox())
                controls.append(open_inbox())
                loaded = {name: model.instance(interpreter)
                          for name, model in service.models.items()}
                make = interpreter.global_("multipy._inside.front_end", "FrontEnd")
                fronts.append(FrontEndCalls(make(loaded, dataclasses.replace(
                    settings, row=k + 1, inbox=inboxes[k][0], control=controls[k][1]))))
        except BaseException:
            for pipe in inboxes + controls:
                os.close(pipe[0])
                os.close(pipe[1])
            raise
        self._control = Control(service, fronts, interpreters, controls, repository)
        self._control.start()
        threads = [threading.Thread(target=self._run, args=(k,), daemon=True,
                                    name=f"multipy-serve-front-{k}") for k in range(len(fronts))]
        with self._lock:
            self._fronts, self._threads, self._inboxes = fronts, threads, inboxes
            self._metrics, self._handed = metrics, [0] * len(fronts)
            for thread in threads:
                thread.start()
            if self._stopping:  # stopped while they were made
                self._tell(STOP)
        for k, front in enumerate(fronts):  # (gRPC connections find a server listening)
            if not front.wait_serving(_START_TIMEOUT) and not self._stopping:
                raise RuntimeError(f"interpreter {k}'s front end did not start serving "
                                   f"within {_START_TIMEOUT} s (its error, if any, is above)")

    def _run(self, k: int) -> None:
        try:
            self._fronts[k].run()
        except BaseException as error:
            if not self._stopping:
                logger.error("interpreter %d's front end failed; the others serve its "
                             "connections from now on: %s: %s", k, type(error).__name__,
                             error, exc_info=error)
        finally:
            with self._changed:  # nothing is written into its inbox any more
                read, write = self._inboxes[k]
                self._inboxes[k] = (-1, -1)
                self._changed.notify_all()
            _close_left(read)
            os.close(write)

    def _open(self) -> list[int]:
        """Under the lock: the front ends that run and are not stuck (multipy.serve.
        metrics.Metrics.stuck)."""
        if self._stopping:
            return []
        return [k for k, (_, write) in enumerate(self._inboxes)
                if write >= 0 and self._metrics.stuck(k + 1) is None]

    @property
    def given_back(self) -> int:
        """The read end of the pipe through which the front ends give connections back
        (multipy._inside.accepting): ``receive`` them, and ``hand`` each on."""
        return self._given[0]

    def can_take_free(self) -> bool:
        """Whether a front end runs that is not stuck, nor busy."""
        with self._lock:
            return bool(self._takers(busy_ones=False))

    def _takers(self, busy_ones: bool) -> list[int]:
        """Under the lock: the front ends that run and are not stuck, and, unless
        busy_ones, not busy (Metrics.busy)."""
        return [k for k in self._open() if busy_ones or not self._metrics.busy(k + 1)]

    def can_take(self) -> bool:
        """Whether a front end runs that is not stuck."""
        with self._lock:
            return bool(self._open())

    def hand(self, connection: socket.socket, busy_ones: bool) -> bool:
        """Gives connection to the front end with the fewest open connections (then the
        least busy) among those that run and are not stuck, and, unless busy_ones, are
        not busy (in a call, or decoding a large request: Metrics.busy), those that
        accept first among these (one past the cores that stands aside is given one
        only when those that accept are busy: Metrics.surplus); False if there is none
        (the caller serves it)."""
        with self._lock:
            metrics = self._metrics
            running = self._takers(busy_ones)
            if not running:
                return False
            k = min(running, key=lambda k: (
                not busy_ones and not metrics.accepts(k + 1),
                metrics.open_connections(k + 1, self._handed[k]), metrics.busy(k + 1)))
            fd = connection.detach()
            try:
                send(self._inboxes[k][1], fd)
            except OSError as error:  # its inbox is full: thousands wait there
                os.close(fd)
                logger.error("interpreter %d's front end has not taken the connections "
                             "handed to it (%s): closing a new one", k, error)
                return True
            self._handed[k] += 1
        return True

    def accepting(self, on: bool) -> None:
        """Has every front end accept on the listening socket (while free), or not."""
        with self._lock:
            self._accepting = on
            if not self._stopping:
                self._tell(ACCEPT if on else PAUSE)

    def stop(self) -> None:
        """Stops every front end gracefully (each serves the connections handed to it
        and answers what it has received) and waits for them, until ``force``."""
        with self._changed:
            self._stopping = True
            self._tell(STOP)
            self._changed.wait_for(lambda: self._forced or all(
                write < 0 for _, write in self._inboxes))
            if self._forced:
                return
        for thread in self._threads:
            thread.join()
        if self._control is not None:
            self._control.close()

    def close(self) -> None:
        """Once stopped: closes the pipe of connections given back, and those in it
        (unless forced: a front end may still write there, and the process ends)."""
        if self._forced:
            return
        _close_left(self._given[0])
        os.close(self._given[1])

    def force(self) -> None:
        """Stops the front ends at once, as uvicorn does on a second SIGINT (a model
        call still ends first), and ends ``stop``'s wait."""
        with self._changed:
            self._forced = True
            self._tell(FORCE)
            self._changed.notify_all()

    def _tell(self, message: int) -> None:
        """Under the lock: message to every front end that runs."""
        for k, (_, write) in enumerate(self._inboxes):
            if write >= 0:
                try:
                    send(write, message)
                except OSError as error:
                    logger.error("interpreter %d's front end could not be told (%d): %s",
                                 k, message, error)


def _close_left(inbox: int) -> None:
    """Closes the connections left in an inbox that no front end reads any more, and
    the inbox."""
    try:
        while left := receive(inbox):
            for fd in left:
                if fd >= 0:
                    os.close(fd)
    finally:
        os.close(inbox)
