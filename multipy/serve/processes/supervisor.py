"""``multipy serve --processes P``: P server processes of --interpreters interpreters each,
behind one port, started and watched by the ``multipy serve`` process itself, the
supervisor, which runs no interpreter and imports no torch (docs/design.md, "Server
processes", says why and how).

The supervisor binds the port, starts each process fresh (exec, never fork), and passes
each the socket; it listens once one has prepared (a class whose code fails stops the
server with status 2 first).  The front ends of the processes that take connections
(ready, answering, not all stuck) accept on that socket themselves; the supervisor
accepts those left waiting more than OVERDUE seconds (every one busy, or none ready yet)
and hands them over (multipy.serve.processes.handover).  It
pings each process every PING_EVERY seconds: one that has not answered for
--health-timeout seconds is killed.  A process that ends is replaced as
multipy.serve.processes.policy.decide says, and the request whose call crashed it is
known by its digest (multipy.serve.request.poison): one that crashed two processes is
refused by every front end.  With ``--model-control explicit``, a process's load or
unload is done by every ready process, one at a time, and a replacement redoes the
repository's present state before it takes connections.  SIGHUP, and a process past
--max-requests, replace processes one at a time, each new one ready before its old one
stops.  SIGTERM or SIGINT: every process answers what it has received (within
--graceful-timeout), then the supervisor exits 0; a second SIGINT is passed on too.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Iterable

import uvloop

from ..._launch import launch_environment
from ..http.connection import accept_overdue, bind, listen, stop_accepting
from ..request.board import ACCEPTED, Board, board_width
from ..request.poison import Crashes, Table
from .handover import Handover, ServerProcess
from .link import Ask, Done, Ping, Pong, Prepared, Ready, Returned, Start, pair
from .policy import decide, ended_how
from .replication import Replication
from .rolling import Rolling
from .tasks import Tasks

logger = logging.getLogger("multipy.serve")

#: Seconds between two health checks of a process.
PING_EVERY = 1.0
#: Seconds without an answer after which a process is killed, by default
#: (--health-timeout).
HEALTH_TIMEOUT = 20.0
#: Seconds a connection may wait on the listening socket for a front end to accept it
#: before the supervisor takes it.
OVERDUE = 0.01
#: The signals by which a process's own fault ends it (its call crashed).
_FAULTS = {-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGFPE, -signal.SIGILL, -signal.SIGABRT}


@dataclass(frozen=True)
class Tunables:
    """What ``multipy serve``'s options say of the processes: the --health-timeout
    (seconds), --max-requests (None: no limit) and --max-requests-jitter."""

    health_timeout: float = HEALTH_TIMEOUT
    max_requests: int | None = None
    max_requests_jitter: int = 0


class Supervisor:
    """Serves argv's models (``multipy serve`` arguments; those it starts with named
    models) of processes of interpreters interpreters each (see the module's docstring)
    on host:port, gRPC on grpc (a socket that reserves its port) if given."""

    def __init__(self, argv: list[str], processes: int, interpreters: int, slots: int,
                 host: str, port: int, grpc: socket.socket | None,
                 graceful_timeout: float | None, models: Iterable[str] = (),
                 tunables: Tunables = Tunables()) -> None:
        self._argv, self._count, self._interpreters = argv, processes, interpreters
        self._host, self._port, self._grpc = host, port, grpc
        self._graceful_timeout = graceful_timeout
        self._tunables = tunables
        self._rows = interpreters + 1  # each process's host, then its front ends
        self._slots = processes + 1  # one spare, for a replacement beside its old process
        self.board = Board.shared(self._slots * self._rows, board_width(slots))
        self.refused = Table.shared()
        self._crashes = Crashes(self.refused)
        self._processes: list[ServerProcess] = []
        self._tasks = Tasks()
        self._starting: dict[int, int] = {}  # slot -> index of the processes starting
        self._handover = Handover(self.board, self._rows)
        self._bound: socket.socket | None = None  # the port, passed to every process
        self._models = tuple(models)
        self._replication: Replication | None = None
        self._rolling = Rolling(self._processes, self._handover, self._tasks,
                                lambda k, old: self._start(k, replaces=old),
                                lambda: self._stopping, self._stop_within(),
                                tunables.max_requests)
        self._failures = 0  # processes in a row that died while starting
        self._stopping = False
        self._signals = 0
        self._finished: asyncio.Future | None = None
        self._prepared: asyncio.Event | None = None  # set once a process has prepared
        self._status = 0
        self._ready_once = False

    def run(self) -> int:
        """Serves until SIGTERM or SIGINT (exit status 0), or until replacements keep
        dying (1).  SystemExit(2) if it cannot listen.  On uvloop's event loop, as
        uvicorn runs the server processes: its watch of the listening socket (which
        wakes at each connection that comes, under load) runs in C."""
        return uvloop.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._replication = Replication(self._models)
        self._finished = loop.create_future()
        self._prepared = asyncio.Event()
        bound = self._bound = bind(self._host, self._port)  # (a port taken is said first)
        self._port = bound.getsockname()[1]
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        for k in range(self._count):
            await self._start(k)
        checking = self._tasks.start(self._check_health(), "the health checks")
        # listening once a process has checked its models as a single server does
        # before it listens: a class whose code fails stops the server before then
        prepared = loop.create_task(self._prepared.wait())
        await asyncio.wait([prepared, self._finished], return_when=asyncio.FIRST_COMPLETED)
        prepared.cancel()
        if self._finished.done():
            bound.close()
        else:
            await self._serve(listen(bound))
        checking.cancel()
        self._rolling.cancel()
        await self._stop_all()
        return self._status

    async def _serve(self, listener: socket.socket) -> None:
        """Accepts connections on listener until the server stops."""
        accepting = asyncio.get_running_loop().create_task(accept_overdue(
            listener, self._handover.hand, lambda: int(self.board.total(ACCEPTED)), OVERDUE))
        logger.info("listening on http://%s:%d with %d server processes of %d interpreter(s) "
                    "each; loading models", self._host, self._port, self._count,
                    self._interpreters)
        try:
            await self._finished
        finally:
            await stop_accepting(accepting, listener)
            self._handover.stop()

    # -- the processes --

    async def _start(self, k: int, replaces: ServerProcess | None = None) -> ServerProcess:
        """Starts a process as process k (beside replaces, which it replaces once it is
        ready), in a free slot, and watches it until it ends."""
        slot = min(set(range(self._slots)) - {p.slot for p in self._processes}
                   - set(self._starting))
        self._starting[slot] = k  # (taken while it starts)
        try:
            return await self._spawn(k, slot, replaces)
        finally:
            del self._starting[slot]

    async def _spawn(self, k: int, slot: int, replaces: ServerProcess | None) -> ServerProcess:
        here, there = pair()
        command = [sys.executable, "-m", "multipy.serve", *self._argv, "--processes", "1",
                   "--port", str(self._port), "--link", str(there.fileno())]
        if self._grpc is not None:
            command += ["--grpc-port", str(self._grpc.getsockname()[1])]
        try:
            process = await asyncio.create_subprocess_exec(
                *command, pass_fds=(there.fileno(),), start_new_session=True,
                env=launch_environment())
        except BaseException:
            here.close()
            raise
        finally:
            there.close()
        here.send(Start(slot, self._count, self._slots),
                  (self.board.fd, self.refused.fd, self._bound.fileno()))
        record = ServerProcess(k, slot, here, process,
                          self.board.requests(slot * self._rows, self._rows), replaces=replaces)
        tunables = self._tunables
        if tunables.max_requests is not None:
            record.recycle_at = tunables.max_requests + random.randint(
                0, tunables.max_requests_jitter)
        self._processes.append(record)
        loop = asyncio.get_running_loop()
        loop.add_reader(here.fileno(), self._read, record)
        self._tasks.start(self._watch(record), f"watching {record.name()}")
        if self._stopping:  # stopped while it started
            os.kill(process.pid, signal.SIGTERM)
        return record

    async def _watch(self, record: ServerProcess) -> None:
        status = await record.process.wait()
        loop = asyncio.get_running_loop()
        self._read(record)  # what it said before it ended
        loop.remove_reader(record.link.fileno())
        record.link.close()
        for future in record.doing.values():
            if not future.done():
                future.set_result((None, "the process ended"))
        first = record.slot * self._rows
        self._handover.release(record)
        calls = self.board.busy(first, self._rows)
        crashed = self.board.crashed_input(first, self._rows) if status in _FAULTS else None
        self.board.reset(first, self._rows)
        self._processes.remove(record)
        self._handover.order(self._processes)
        record.ended.set()
        untaken = list(record.handed.values())
        record.handed.clear()
        for connection in untaken:  # handed to it, never read: another serves them
            self._handover.hand(connection)
        if self._stopping:
            if status not in (0, -signal.SIGTERM, -signal.SIGINT):
                logger.error("%s %s", record.name(), ended_how(status))
            if not self._processes:
                self._finish(self._status)
            return
        if record.retiring:
            logger.info("%s, replaced, %s", record.name(), ended_how(status))
            return
        running = f", with {calls} call(s) in progress (its report above names them)" \
            if calls else ""
        if crashed is not None and self._crashes.crashed(crashed):
            logger.error("%s was crashed by a request that has crashed another process "
                         "before: identical requests are refused from now on", record.name())
        if record.replaces in self._processes and not record.loaded:
            logger.error("%s, started to replace %s, %s while starting%s; that one serves "
                         "on", record.name(), record.replaces.name(), ended_how(status), running)
            return
        if any(p.index == record.index and not p.retiring for p in self._processes) \
                or record.index in self._starting.values():
            logger.error("%s %s%s; its replacement is starting", record.name(),
                         ended_how(status), running)
            return
        served = record.ready or calls > 0
        restart = decide(status, served, self._failures, self._prepared.is_set(),
                         self._ready_once)
        self._failures = restart.failures
        when = "" if served else " while starting"
        if restart.stop is not None:
            logger.error("%s %s%s%s; %s: stopping the server", record.name(), ended_how(status),
                         when, running, restart.why)
            self._finish(restart.stop)
            return
        others = "the other processes serve on, and " if served and self._count > 1 else ""
        logger.error("%s %s%s%s; %s%s", record.name(), ended_how(status), when, running, others,
                     restart.why)
        await self._replace(record.index, restart.pause)

    async def _replace(self, k: int, pause: float) -> None:
        """Starts a process as process k after pause seconds; tries again, after longer
        pauses, while the system cannot start one (no memory, no descriptors)."""
        while True:
            await asyncio.sleep(pause)
            if self._stopping:
                return
            try:
                await self._start(k)
                return
            except OSError as error:
                pause = min(max(1.0, 2 * pause), 60.0)
                logger.error("server process %d could not be started (%s); trying again in "
                             "%g s", k, error, pause)

    def _read(self, record: ServerProcess) -> None:
        messages = record.link.receive()
        if messages is None:  # it is ending: _watch says how
            asyncio.get_running_loop().remove_reader(record.link.fileno())
            return
        for message, fds in messages:
            if isinstance(message, Returned) and fds:  # (to another process than record)
                self._handover.hand(socket.socket(fileno=fds.pop(0)), besides=record)
            for fd in fds:
                os.close(fd)
            match message:
                case Pong():
                    record.waiting, record.health = None, message
                    self._handover.order(self._processes)
                case Prepared():
                    record.prepared = True
                    self._prepared.set()
                    self._handover.order(self._processes)
                case Ready():
                    record.loaded = True
                    self._tasks.start(self._ready(record), f"readying {record.name()}")
                case Ask():
                    self._tasks.start(self._replication.ask(record, message, self._processes),
                                      f"a model repository request of {record.name()}")
                case Done(number, status, text) if number in record.doing:
                    future = record.doing.pop(number)
                    if not future.done():
                        future.set_result((status, text))

    async def _ready(self, record: ServerProcess) -> None:
        """Process record has loaded its start-up models: it redoes the repository's
        present state, then takes connections (and the process it replaces retires)."""
        redone = await self._replication.redo(record, self._processes)
        if redone is None:
            return  # it ended
        self._failures = 0
        logger.info("%s ready in %.1f s%s", record.name(), time.monotonic() - record.started,
                    f" (its models as the repository has them: {redone} request(s) redone)"
                    if redone else "")
        self._handover.order(self._processes)
        if record.replaces is not None:
            self._rolling.retire(record.replaces)
            record.replaces = None
        if not self._ready_once and sum(p.ready for p in self._processes) >= self._count:
            self._ready_once = True
            also = "" if self._grpc is None else \
                f", gRPC on {self._host}:{self._grpc.getsockname()[1]}"
            logger.info("ready: %d server processes of %d interpreter(s), "
                        "http://%s:%d/v2/models/NAME/infer%s", self._count,
                        self._interpreters, self._host, self._port, also)

    # -- health, and replacing processes that run --

    async def _check_health(self) -> None:
        """Pings every process that has prepared, every PING_EVERY seconds; kills one
        that has not answered for --health-timeout seconds; has one that has answered
        --max-requests replaced; forgets old crashes."""
        timeout = self._tunables.health_timeout
        while True:
            await asyncio.sleep(PING_EVERY)
            now = time.monotonic()
            self._crashes.forget(now)
            self._handover.order(self._processes)  # (one that stopped answering is passed over from now on)
            for record in list(self._processes):
                self._handover.release(record)
                if not record.prepared or record.process.returncode is not None:
                    continue
                if record.waiting is None:
                    record.waiting = now  # (from the first check it has not answered)
                elif now - record.waiting > timeout and not record.retiring:
                    logger.error("%s has not answered a health check for %.0f s "
                                 "(--health-timeout): killing it", record.name(),
                                 now - record.waiting)
                    record.process.kill()
                    continue
                try:
                    record.link.send(Ping())
                except OSError:  # ending, or its link is full: it answers nothing
                    pass
                self._rolling.recycle(record)

    def _reload(self) -> None:
        """SIGHUP: every process is replaced, one at a time."""
        if not self._stopping:
            self._rolling.every_process()

    # -- stopping --

    def _stop_within(self) -> float | None:
        """Seconds a process may take to stop (--graceful-timeout, and 30 more) before
        it is killed; None: no limit."""
        return None if self._graceful_timeout is None else self._graceful_timeout + 30

    def _signalled(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("stopping: %d server process(es) answer what they have received",
                        len(self._processes))
        self._stopping = True
        for record in self._processes:
            try:
                os.kill(record.process.pid, sig)
            except ProcessLookupError:
                pass
        if self._signals == 1:
            self._finish(0)

    def _finish(self, status: int) -> None:
        self._status = max(self._status, status)
        self._stopping = True
        self._handover.stop()
        if not self._finished.done():
            self._finished.set_result(None)

    async def _stop_all(self) -> None:
        """Has every process stop (SIGTERM, unless a signal already went) and waits for
        it; one still running past --graceful-timeout (and 30 s more) is killed."""
        running = list(self._processes)
        if not self._signals:
            for record in running:
                try:
                    os.kill(record.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        limit = self._stop_within()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(p.process.wait() for p in running)), limit)
        except asyncio.TimeoutError:
            for record in running:
                if record.process.returncode is None:
                    logger.error("%s did not stop within %g s: killing it", record.name(),
                                 limit)
                    record.process.kill()
            await asyncio.gather(*(p.process.wait() for p in running))
        await asyncio.sleep(0)  # the watchers' last turn
