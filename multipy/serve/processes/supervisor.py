"""``multipy serve --processes P``: P server processes of --interpreters interpreters each,
behind one port, started and watched by the ``multipy serve`` process itself, the
supervisor, which runs no interpreter and imports no torch.

Why: one process is one address space, so a model that crashes (a segfault in a C
extension, an abort, the OOM killer) ends every request in it; and glibc gives a process
at most 15 interpreters.  P processes lose one P-th of the server to a crash, and hold
up to 15 P interpreters.

How:

- The supervisor listens on the HTTP port itself, accepts every connection and hands it
  to a process through that process's link (multipy.serve.processes.link: a Unix socket, the
  connection's descriptor passed with SCM_RIGHTS), round robin over the processes that
  take connections (``_takers``): ready, answering their health checks, and with an
  interpreter free of a stuck call.  It keeps its own copy of each connection until the
  process has taken it, before reading a byte (the process notes the last one it took
  on the metrics board: ``_release``): one that dies first has the connections it had
  not taken handed to another.  It binds the port first, and listens
  once a process has prepared (loaded each model written as a class on its first
  interpreter, as a single server does before it listens: Service.prepare); a process
  that exits with status 2 before then (a class whose code fails) stops the server with
  status 2 before it ever listens.  gRPC is served by every front end of every process
  on the port the supervisor reserves (SO_REUSEPORT: the kernel spreads connections;
  those still queued in a process that dies are reset, and gRPC clients retry).
- Processes are started fresh (exec of ``python -m multipy.serve`` with the same options
  and ``--processes 1``, in a new session), never forked from a process with
  interpreters: forking one is unsafe, and the supervisor starts none.
- Health: every PING_EVERY seconds each process is pinged over its link, and answers
  from its event loop with how many of its interpreters are stuck and busy.  One that
  has not answered for UNRESPONSIVE_AFTER seconds gets no new connection; for
  --health-timeout seconds, it is killed (SIGKILL) and replaced.  One whose every
  interpreter is stuck gets no new connection until one is free.
- The metrics board (multipy.serve.request.metrics) is one shared memory file that every process
  maps, with rows for each of P + 1 slots (the spare one for a process that replaces
  another while it still runs): ``/metrics`` and the statistics extension count every
  process, whichever answers.  A process that ends leaves its counts; what its rows said
  of the present (calls running, requests queued) goes back to 0.
- A process that dies is logged (its signal or exit status, its calls in progress; the
  crash report it wrote names the model and request) and replaced as ``decide`` says:
  at once if it had loaded its models or died in a call; else after a pause that
  doubles (1, 2, 4, 8 s), and after START_FAILURES such deaths in a row the server stops
  with exit status 1.  The call that crashed it is known by its digest
  (multipy.serve.request.poison): a request identical to one that has crashed two processes is
  refused, for a while, by every front end.
- With ``--model-control explicit``, a load or unload that any process receives is
  asked of the supervisor, which has every ready process do it, one request at a time,
  and answers with the first failure (else success).  It keeps the repository's present
  state (``_Present``): a replacement redoes what makes that state, once its start-up
  models are loaded and before it is handed a connection, so that it serves what the
  others serve (and its metrics' slots are theirs).
- Rolling replacement: SIGHUP replaces every process, one at a time, and a process that
  has answered about --max-requests requests (plus up to --max-requests-jitter) is
  replaced alone: the new process starts in the spare slot and, once it is ready, the
  old one gets no new connection and is stopped gracefully (SIGTERM).  A new process
  that fails to start stops a SIGHUP's round; the old ones serve on.
- SIGTERM or SIGINT: the supervisor stops accepting and passes the signal on to every
  process, which stops as a single server does (every request it received answered,
  within --graceful-timeout); then it exits 0.  A second SIGINT is passed on too (each
  stops at once).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from ..._launch import launch_environment
from ..http.connection import accept, bind, listen
from ..request.metrics import Board, board_width
from ..request.poison import Crashes, Table
from .link import Link, pair
from .tasks import Tasks

logger = logging.getLogger("multipy.serve")

#: Replacements in a row that die while starting before the server gives up.
START_FAILURES = 5
#: Seconds between two health checks of a process.
PING_EVERY = 1.0
#: Seconds without an answer to a health check after which a process gets no new
#: connection.
UNRESPONSIVE_AFTER = 3.0
#: Seconds without an answer after which a process is killed, by default
#: (--health-timeout).
HEALTH_TIMEOUT = 20.0
#: Connections the supervisor holds while no process takes them (one is starting).
_HELD = 4096
#: Connections handed to a process above which the supervisor closes its copies of
#: those it has taken (it does every second too).
_KEPT = 32
#: The signals by which a process's own fault ends it (its call crashed).
_FAULTS = {-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGFPE, -signal.SIGILL, -signal.SIGABRT}


@dataclass(frozen=True)
class Restart:
    """What the supervisor does when a process has ended: start a replacement after
    ``pause`` seconds, or (``stop`` not None) stop the server with that exit status;
    ``failures``: the processes in a row that have died while starting, from now on."""

    pause: float = 0.0
    stop: int | None = None
    failures: int = 0
    why: str = ""


def decide(status: int, served: bool, failures: int, listening: bool,
           ever_ready: bool) -> Restart:
    """What follows the end (returncode status) of a process that had ``served`` (loaded
    its models, or was running a call: a request's crash is never a start failure),
    after ``failures`` processes in a row died while starting, the server ``listening``
    (a process had prepared) and ``ever_ready`` (every process has been ready once)."""
    if served:
        return Restart(0.0, None, 0, "a replacement starts now")
    failures += 1
    if not listening and status == 2:
        return Restart(stop=2, failures=failures,
                       why="before the server listened: a model cannot be served (see above)")
    if not ever_ready and status in (1, 2):
        return Restart(stop=1, failures=failures, why="its models failed to load (see above)")
    if failures >= START_FAILURES:
        return Restart(stop=1, failures=failures,
                       why=f"{failures} processes in a row died while starting")
    pause = 2.0 ** (failures - 1)
    return Restart(pause, None, failures, f"a replacement starts in {pause:g} s")


class _Present:
    """The model repository as every process serves it now, kept from the requests that
    changed it (``note``), whatever their number: what each model name loaded since
    the start last loaded (its archive), and whether it is loaded, unloaded, or failed
    to load (a name new to the server keeps its place in the index and its slot of the
    metrics all the same).  ``requests`` redo it on a process that has just loaded the
    start-up models (``started_with``), in the order the names came."""

    def __init__(self, started_with: Iterable[str]) -> None:
        self._started_with = frozenset(started_with)
        self._names: dict[str, tuple[dict[str, str], str]] = {}  # name -> (archive, state)

    def note(self, what: str, name: str, archive: dict[str, str],
             statuses: list[int | None]) -> None:
        """Request what ("load", "unload") of model name (from archive) had statuses
        from the processes (None: one ended first)."""
        known = name in self._names or name in self._started_with
        if what == "load":
            if 200 in statuses:
                self._names[name] = (archive, "loaded")
            elif 500 in statuses and not known:  # its load failed where it was tried
                self._names[name] = (archive, "failed")
        elif 200 in statuses and known:
            self._names[name] = (self._names.get(name, ({}, ""))[0], "unloaded")

    def requests(self) -> Iterator[dict[str, Any]]:
        """The requests that make a freshly started process's repository this one."""
        for name, (archive, state) in self._names.items():
            if state != "unloaded" or name not in self._started_with:
                yield {"what": "load", "name": name, "archive": archive}
            if state == "unloaded":
                yield {"what": "unload", "name": name, "archive": {}}


@dataclass
class _Process:
    """One server process, as the supervisor knows it."""

    index: int  #: which of the P processes it is (the logs' "server process k")
    slot: int  #: its rows of the metrics board
    link: Link
    process: Any  # asyncio.subprocess.Process
    baseline: int  #: the requests its slot had counted when it started
    started: float = field(default_factory=time.monotonic)
    #: it has checked its models (a class loaded on its first interpreter): it takes
    #: connections while no process is ready, and its health is checked
    prepared: bool = False
    loaded: bool = False  #: it has loaded its start-up models
    ready: bool = False  #: it has redone the repository's requests: it takes connections
    retiring: bool = False  #: replaced: it takes no new connection, and stops
    replaces: _Process | None = None  #: the process it replaces while that one runs
    #: since when a health check waits for its answer (time.monotonic(); None: none waits)
    waiting: float | None = None
    health: dict[str, int] = field(default_factory=dict)  #: what it answered last
    recycle_at: int | None = None  #: the requests after which it is replaced
    #: numbers of the connections handed to it and not yet taken -> the connection
    handed: dict[int, socket.socket] = field(default_factory=dict)
    #: numbers of the ``do`` requests sent to it -> the future of its ``done``
    doing: dict[int, asyncio.Future] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def responsive(self, now: float) -> bool:
        return self.waiting is None or now - self.waiting < UNRESPONSIVE_AFTER

    def all_stuck(self) -> bool:
        return self.health.get("stuck", 0) >= self.health.get("interpreters", 1)

    def name(self) -> str:
        return f"server process {self.index} (pid {self.process.pid})"


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
        self._processes: list[_Process] = []
        self._tasks = Tasks()
        self._takers: list[_Process] = []  # where new connections go: see _order
        self._starting: dict[int, int] = {}  # slot -> index of the processes starting
        self._turn = itertools.count()
        self._held: list[socket.socket] = []
        self._numbers = itertools.count(1)
        self._present = _Present(models)
        self._repository: asyncio.Lock | None = None
        self._rolling: asyncio.Task | None = None  # a SIGHUP's round, or a recycling
        self._failures = 0  # processes in a row that died while starting
        self._stopping = False
        self._signals = 0
        self._finished: asyncio.Future | None = None
        self._prepared: asyncio.Event | None = None  # set once a process has prepared
        self._status = 0
        self._ready_once = False

    def run(self) -> int:
        """Serves until SIGTERM or SIGINT (exit status 0), or until replacements keep
        dying (1).  SystemExit(2) if it cannot listen."""
        return asyncio.run(self._main())

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        self._repository = asyncio.Lock()
        self._finished = loop.create_future()
        self._prepared = asyncio.Event()
        bound = bind(self._host, self._port)  # (a port that is taken is said first)
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
        if self._rolling is not None:
            self._rolling.cancel()
        await self._stop_all()
        return self._status

    async def _serve(self, listener: socket.socket) -> None:
        """Accepts connections on listener until the server stops."""
        accepting = asyncio.get_running_loop().create_task(accept(listener, self._hand))
        logger.info("listening on http://%s:%d with %d server processes of %d interpreter(s) "
                    "each; loading models", self._host, self._port, self._count,
                    self._interpreters)
        try:
            await self._finished
        finally:
            accepting.cancel()
            listener.close()
            for held in self._held:
                held.close()

    # -- the processes --

    async def _start(self, k: int, replaces: _Process | None = None) -> _Process:
        """Starts a process as process k (beside replaces, which it replaces once it is
        ready), in a free slot, and watches it until it ends."""
        slot = min(set(range(self._slots)) - {p.slot for p in self._processes}
                   - set(self._starting))
        self._starting[slot] = k  # (taken while it starts)
        try:
            return await self._spawn(k, slot, replaces)
        finally:
            del self._starting[slot]

    async def _spawn(self, k: int, slot: int, replaces: _Process | None) -> _Process:
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
        here.send({"op": "start", "process": slot, "processes": self._count,
                   "slots": self._slots}, (self.board.fd, self.refused.fd))
        record = _Process(k, slot, here, process,
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

    async def _watch(self, record: _Process) -> None:
        status = await record.process.wait()
        loop = asyncio.get_running_loop()
        self._read(record)  # what it said before it ended
        loop.remove_reader(record.link.fileno())
        record.link.close()
        for future in record.doing.values():
            if not future.done():
                future.set_result((None, "the process ended"))
        first = record.slot * self._rows
        self._release(record)
        calls = self.board.busy(first, self._rows)
        crashed = self.board.crashed_input(first, self._rows) if status in _FAULTS else None
        self.board.reset(first, self._rows)
        self._processes.remove(record)
        self._order()
        record.ended.set()
        untaken = list(record.handed.values())
        record.handed.clear()
        for connection in untaken:  # handed to it, never read: another serves them
            self._hand(connection)
        if self._stopping:
            if status not in (0, -signal.SIGTERM, -signal.SIGINT):
                logger.error("%s %s", record.name(), _status(status))
            if not self._processes:
                self._finish(self._status)
            return
        if record.retiring:
            logger.info("%s, replaced, %s", record.name(), _status(status))
            return
        running = f", with {calls} call(s) in progress (its report above names them)" \
            if calls else ""
        if crashed is not None and self._crashes.crashed(crashed):
            logger.error("%s was crashed by a request that has crashed another process "
                         "before: identical requests are refused from now on", record.name())
        if record.replaces in self._processes and not record.loaded:
            logger.error("%s, started to replace %s, %s while starting%s; that one serves "
                         "on", record.name(), record.replaces.name(), _status(status), running)
            return
        if any(p.index == record.index and not p.retiring for p in self._processes) \
                or record.index in self._starting.values():
            logger.error("%s %s%s; its replacement is starting", record.name(),
                         _status(status), running)
            return
        served = record.ready or calls > 0
        restart = decide(status, served, self._failures, self._prepared.is_set(),
                         self._ready_once)
        self._failures = restart.failures
        when = "" if served else " while starting"
        if restart.stop is not None:
            logger.error("%s %s%s%s; %s: stopping the server", record.name(), _status(status),
                         when, running, restart.why)
            self._finish(restart.stop)
            return
        others = "the other processes serve on, and " if served and self._count > 1 else ""
        logger.error("%s %s%s%s; %s%s", record.name(), _status(status), when, running, others,
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

    def _read(self, record: _Process) -> None:
        messages = record.link.receive()
        if messages is None:  # it is ending: _watch says how
            asyncio.get_running_loop().remove_reader(record.link.fileno())
            return
        for message, fds in messages:
            for fd in fds:
                os.close(fd)
            op = message["op"]
            if op == "pong":
                record.waiting, record.health = None, message
                self._order()
            elif op == "prepared":
                record.prepared = True
                self._prepared.set()
                self._order()
            elif op == "ready":
                record.loaded = True
                self._tasks.start(self._ready(record), f"readying {record.name()}")
            elif op == "ask":
                self._tasks.start(self._ask(record, message),
                                  f"a model repository request of {record.name()}")
            elif op == "done" and message.get("number") in record.doing:
                future = record.doing.pop(message["number"])
                if not future.done():
                    future.set_result((message.get("status"), message.get("message", "")))

    async def _ready(self, record: _Process) -> None:
        """Process record has loaded its start-up models: it redoes the repository's
        present state, then takes connections (and the process it replaces retires)."""
        redone = 0
        async with self._repository:
            for request in self._present.requests():
                redone += 1
                status, message = await self._do(record, request)
                if status is None:
                    return  # it ended
                if status != 200:
                    logger.warning("server process %d: redoing the model repository's %s of "
                                   "%r: %s", record.index, request["what"], request["name"],
                                   message)
            if record not in self._processes:
                return
            record.ready = True
        self._failures = 0
        logger.info("%s ready in %.1f s%s", record.name(), time.monotonic() - record.started,
                    f" (its models as the repository has them: {redone} request(s) redone)"
                    if redone else "")
        self._order()
        if record.replaces is not None:
            self._retire(record.replaces)
            record.replaces = None
        if not self._ready_once and sum(p.ready for p in self._processes) >= self._count:
            self._ready_once = True
            also = "" if self._grpc is None else \
                f", gRPC on {self._host}:{self._grpc.getsockname()[1]}"
            logger.info("ready: %d server processes of %d interpreter(s), "
                        "http://%s:%d/v2/models/NAME/infer%s", self._count,
                        self._interpreters, self._host, self._port, also)

    async def _do(self, record: _Process, request: dict[str, Any]) -> tuple[int | None, str]:
        """(status, message) of process record doing request; (None, why) if it ended."""
        number = next(self._numbers)
        future = asyncio.get_running_loop().create_future()
        record.doing[number] = future
        try:
            record.link.send({**request, "op": "do", "number": number})
        except (OSError, ValueError) as error:
            record.doing.pop(number, None)
            return None, str(error)
        return await future

    async def _ask(self, record: _Process, message: dict[str, Any]) -> None:
        """A repository request that process record received: every ready process does
        it; record gets the first failure, else success."""
        try:
            request = {"what": message["what"], "name": str(message["name"]),
                       "archive": dict(message["archive"])}
        except (KeyError, TypeError, ValueError):
            status, text = 400, "a model repository request that says nothing this server knows"
        else:
            async with self._repository:
                ready = [p for p in self._processes if p.ready and not p.retiring]
                answers = await asyncio.gather(*(self._do(p, request) for p in ready))
                self._present.note(request["what"], request["name"], request["archive"],
                                   [status for status, _ in answers])
            failed = [answer for answer in answers if answer[0] not in (200, None)]
            status, text = failed[0] if failed else (200, "")
            if not any(answer[0] is not None for answer in answers):
                status, text = 503, "no server process could do it; try again"
        try:
            record.link.send({"op": "answer", "number": message.get("number"),
                              "status": status, "message": text})
        except OSError:  # it has ended: no one waits
            pass

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
            self._order()  # (one that stopped answering is passed over from now on)
            for record in list(self._processes):
                self._release(record)
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
                    record.link.send({"op": "ping"})
                except OSError:  # ending, or its link is full: it answers nothing
                    pass
                if record.recycle_at is not None and record.ready and not record.retiring \
                        and self._rolling is None and self._served(record) >= record.recycle_at:
                    logger.info("%s has answered %d requests (--max-requests): replacing it",
                                record.name(), self._served(record))
                    self._rolling = self._tasks.start(self._roll([record]),
                                                      "replacing a process")

    def _served(self, record: _Process) -> int:
        return self.board.requests(record.slot * self._rows, self._rows) - record.baseline

    def _reload(self) -> None:
        """SIGHUP: every process is replaced, one at a time."""
        if self._stopping:
            return
        if self._rolling is not None:
            logger.warning("SIGHUP: processes are being replaced already; try again once "
                           "they are")
            return
        logger.info("SIGHUP: replacing the %d server processes, one at a time",
                    len(self._processes))
        self._rolling = self._tasks.start(
            self._roll(sorted(self._processes, key=lambda p: p.index)), "SIGHUP's round")

    async def _roll(self, old: list[_Process]) -> None:
        """Replaces each process of old in turn: a new one starts beside it, and once
        it is ready the old one retires (and has stopped before the next starts).  A new
        one that dies first ends the round."""
        try:
            for record in old:
                if record not in self._processes or record.retiring or self._stopping:
                    continue
                try:
                    new = await self._start(record.index, replaces=record)
                except OSError as error:
                    logger.error("replacing the server processes stopped: a process could "
                                 "not be started (%s); the others serve on as they are",
                                 error)
                    return
                ended = asyncio.get_running_loop().create_task(new.ended.wait())
                while not (new.ready or new.ended.is_set()):
                    await asyncio.wait([ended], timeout=0.1)
                ended.cancel()
                if not new.ready:
                    logger.error("replacing the server processes stopped: the others serve "
                                 "on as they are")
                    if record.recycle_at is not None:  # tried again after as many more
                        record.recycle_at = self._served(record) + \
                            self._tunables.max_requests
                    return
                limit = None if self._graceful_timeout is None else self._graceful_timeout + 30
                try:
                    await asyncio.wait_for(record.ended.wait(), limit)
                except asyncio.TimeoutError:
                    logger.error("%s did not stop within %g s: killing it", record.name(),
                                 limit)
                    record.process.kill()
                    await record.ended.wait()
        finally:
            self._rolling = None

    def _retire(self, record: _Process) -> None:
        """Process record, replaced, takes no new connection and stops gracefully."""
        if record not in self._processes:
            return
        record.retiring = True
        self._order()
        logger.info("%s is replaced: it answers what it has received, and stops",
                    record.name())
        try:
            os.kill(record.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    # -- connections --

    def _taking(self, record: _Process, now: float | None = None) -> bool:
        """Whether record takes new connections before any other kind: ready, not
        retiring, answering, with an interpreter free of a stuck call."""
        now = time.monotonic() if now is None else now
        return record.ready and not record.retiring and record.responsive(now) \
            and not record.all_stuck()

    def _order(self) -> None:
        """Decides which processes new connections go to (``_takers``), as their state
        changes (and every second), and hands them what was held meanwhile: those
        ``_taking``; else, while none is, those ready and answering (each answers what
        it can: a stuck one, 503); else those that have prepared and answer (none is
        ready: they answer health and readiness themselves)."""
        now = time.monotonic()
        alive = [p for p in self._processes if p.prepared and not p.retiring
                 and p.process.returncode is None and p.responsive(now)]
        self._takers = [p for p in alive if self._taking(p, now)] or \
            [p for p in alive if p.ready] or alive
        if self._held and self._takers:
            held, self._held = self._held, []
            for connection in held:
                self._hand(connection)

    def _hand(self, connection: socket.socket) -> None:
        """Gives connection to the next process that takes it (``_takers``), keeping a
        copy until that one has taken it; holds it while none takes connections (closes
        it once the server stops)."""
        if self._stopping:
            connection.close()
            return
        takers = self._takers
        turn = next(self._turn)
        for k in range(len(takers)):
            record = takers[(turn + k) % len(takers)]
            number = next(self._numbers)
            try:
                record.link.send({"op": "connection", "number": number},
                                 (connection.fileno(),))
            except OSError:  # ending, or its link is full: the next
                continue
            record.handed[number] = connection
            if len(record.handed) > _KEPT:
                self._release(record)
            return
        if len(self._held) < _HELD:
            self._held.append(connection)
        else:
            connection.close()

    def _release(self, record: _Process) -> None:
        """Closes this side's copies of the connections process record has taken."""
        taken = self.board.taken(record.slot * self._rows)
        while record.handed:
            number = next(iter(record.handed))
            if number > taken:
                break
            record.handed.pop(number).close()

    # -- stopping --

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
        limit = None if self._graceful_timeout is None else self._graceful_timeout + 30
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


def _status(status: int) -> str:
    """How a process ended, as returncode says it."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "?"
        return f"was killed by signal {-status} ({name})"
    return f"exited with status {status}"
