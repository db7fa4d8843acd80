"""``multipy serve --processes P``: P server processes of --interpreters interpreters each,
behind one port, started and watched by the ``multipy serve`` process itself, the
supervisor, which runs no interpreter and imports no torch.

Why: one process is one address space, so a model that crashes (a segfault in a C
extension, an abort, the OOM killer) ends every request in it; and glibc gives a process
at most 15 interpreters.  P processes lose one P-th of the server to a crash, and hold
up to 15 P interpreters.

How:

- The supervisor listens on the HTTP port itself, accepts every connection and hands it
  to a process through that process's link (multipy.serve.link: a Unix socket, the
  connection's descriptor passed with SCM_RIGHTS), round robin over the processes that
  are ready (over those that start, while none is: they answer health and readiness
  themselves, as a single server does while it loads).  It binds the port first, and
  listens once a process has prepared (loaded each model written as a class on its
  first interpreter, as a single server does before it listens: multipy.serve.service.
  Service.prepare); a process that exits with status 2 before then (a class whose code
  fails) stops the server with status 2 before it ever listens.  No accepted connection waits in
  the accept queue of a process that may die; a process hands its connections on to its
  interpreters' front ends as a single server does.  gRPC is served by every front end
  of every process on the port the supervisor reserves (SO_REUSEPORT: the kernel spreads
  connections; those still queued in a process that dies are reset, and gRPC clients
  retry).
- Processes are started fresh (exec of ``python -m multipy.serve`` with the same options
  and ``--processes 1``, in a new session), never forked from a process with
  interpreters: forking one is unsafe, and the supervisor starts none.
- The metrics board (multipy.serve.metrics) is one shared memory file that every process
  maps, with rows for each process: ``/metrics`` and the statistics extension count
  every process, whichever answers.  A process that ends leaves its counts; what its
  rows said of the present (calls running, requests queued) goes back to 0.
- A process that dies is logged (its signal or exit status, its calls in progress; the
  crash report it wrote names the model and request) and replaced at once if it had
  served, else after a pause that doubles (1, 2, 4, 8 s); after 5 replacements in a row
  that died while starting, the server stops with exit status 1.
- With ``--model-control explicit``, a load or unload that any process receives is
  asked of the supervisor, which has every ready process do it, one request at a time,
  and answers with the first failure (else success).  It keeps each request, in order:
  a replacement does them all once its start-up models are loaded, before it is handed a
  connection, so that it serves what the others serve (and its metrics' slots are theirs).
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
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .._launch import launch_environment
from .connection import accept, bind, listen
from .link import Link, pair
from .metrics import Board, board_width

logger = logging.getLogger("multipy.serve")

#: Replacements in a row that die while starting before the server gives up.
START_FAILURES = 5
#: Connections the supervisor holds while no process runs (a replacement is starting).
_HELD = 4096


@dataclass
class _Process:
    """One server process, as the supervisor knows it."""

    index: int
    link: Link
    process: Any  # asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    #: it has checked its models (a class loaded on its first interpreter): it takes
    #: connections
    prepared: bool = False
    ready: bool = False
    #: numbers of the ``do`` requests sent to it -> the future of its ``done``
    doing: dict[int, asyncio.Future] = field(default_factory=dict)


class Supervisor:
    """Serves argv's models (``multipy serve`` arguments, of processes of interpreters
    interpreters each; see the module's docstring) on host:port, gRPC on grpc (a socket
    that reserves its port) if given."""

    def __init__(self, argv: list[str], processes: int, interpreters: int, slots: int,
                 host: str, port: int, grpc: socket.socket | None,
                 graceful_timeout: float | None) -> None:
        self._argv, self._count, self._interpreters = argv, processes, interpreters
        self._host, self._port, self._grpc = host, port, grpc
        self._graceful_timeout = graceful_timeout
        self._rows = interpreters + 1  # each process's host, then its front ends
        self.board = Board.shared(processes * self._rows, board_width(slots))
        self._processes: list[_Process | None] = [None] * processes
        self._turn = itertools.count()
        self._held: list[socket.socket] = []
        self._numbers = itertools.count(1)
        #: the repository's requests done so far, in order (a replacement does them)
        self._done_so_far: list[dict[str, Any]] = []
        self._repository: asyncio.Lock | None = None
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
        for k in range(self._count):
            await self._start(k)
        # listening once a process has checked its models as a single server does
        # before it listens: a class whose code fails stops the server before then
        prepared = loop.create_task(self._prepared.wait())
        await asyncio.wait([prepared, self._finished], return_when=asyncio.FIRST_COMPLETED)
        prepared.cancel()
        if self._finished.done():
            bound.close()
        else:
            await self._serve(listen(bound))
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

    async def _start(self, k: int) -> None:
        """Starts process k, and watches it until it ends."""
        here, there = pair()
        command = [sys.executable, "-m", "multipy.serve", *self._argv, "--processes", "1",
                   "--port", str(self._port), "--link", str(there.fileno())]
        if self._grpc is not None:
            command += ["--grpc-port", str(self._grpc.getsockname()[1])]
        try:
            process = await asyncio.create_subprocess_exec(
                *command, pass_fds=(there.fileno(),), start_new_session=True,
                env=launch_environment())
        finally:
            there.close()
        here.send({"op": "start", "process": k, "processes": self._count},
                  (self.board.fd,))
        record = _Process(k, here, process)
        self._processes[k] = record
        loop = asyncio.get_running_loop()
        loop.add_reader(here.fileno(), self._read, record)
        loop.create_task(self._watch(record))

    async def _watch(self, record: _Process) -> None:
        status = await record.process.wait()
        loop = asyncio.get_running_loop()
        loop.remove_reader(record.link.fileno())
        record.link.close()
        for future in record.doing.values():
            if not future.done():
                future.set_result((None, "the process ended"))
        first = record.index * self._rows
        calls = self.board.busy(first, self._rows)
        self.board.reset(first, self._rows)
        self._processes[record.index] = None
        if self._stopping:
            if status not in (0, -signal.SIGTERM, -signal.SIGINT):
                logger.error("server process %d (pid %d) ended with %s", record.index,
                             record.process.pid, _status(status))
            if not any(self._processes):
                self._finish(self._status)
            return
        running = f", with {calls} call(s) in progress (its report above names them)" \
            if calls else ""
        if record.ready:
            self._failures = 0
            logger.error("server process %d (pid %d) %s%s; the other processes serve on, "
                         "and a replacement starts now", record.index, record.process.pid,
                         _status(status), running)
            await self._start(record.index)
            return
        self._failures += 1
        if not self._prepared.is_set() and status == 2:
            logger.error("server process %d (pid %d) %s before the server listened: a model "
                         "cannot be served (see above); stopping the server", record.index,
                         record.process.pid, _status(status))
            self._finish(2)
            return
        if self._failures >= START_FAILURES or not self._ready_once and status in (1, 2):
            logger.error("server process %d (pid %d) %s while starting%s; %s: stopping the "
                         "server", record.index, record.process.pid, _status(status), running,
                         "its models failed to load (see above)" if status in (1, 2) else
                         f"{self._failures} processes in a row died while starting")
            self._finish(1)
            return
        pause = 2.0 ** (self._failures - 1)
        logger.error("server process %d (pid %d) %s while starting%s; a replacement starts "
                     "in %g s", record.index, record.process.pid, _status(status), running,
                     pause)
        await asyncio.sleep(pause)
        if not self._stopping:
            await self._start(record.index)

    def _read(self, record: _Process) -> None:
        messages = record.link.receive()
        if messages is None:  # it is ending: _watch says how
            asyncio.get_running_loop().remove_reader(record.link.fileno())
            return
        for message, fds in messages:
            for fd in fds:
                os.close(fd)
            op = message["op"]
            if op == "prepared":
                record.prepared = True
                self._prepared.set()
                held, self._held = self._held, []  # what came while none took connections
                for connection in held:
                    self._hand(connection)
            elif op == "ready":
                asyncio.get_running_loop().create_task(self._ready(record))
            elif op == "ask":
                asyncio.get_running_loop().create_task(self._ask(record, message))
            elif op == "done" and message["number"] in record.doing:
                future = record.doing.pop(message["number"])
                if not future.done():
                    future.set_result((message["status"], message["message"]))

    async def _ready(self, record: _Process) -> None:
        """Process record has loaded its start-up models: it does the repository's
        requests done so far, then takes connections."""
        async with self._repository:
            for request in self._done_so_far:
                status, message = await self._do(record, request)
                if status is None:
                    return  # it ended
                if status != 200:
                    logger.warning("server process %d: redoing the model repository's %s of "
                                   "%r: %s", record.index, request["what"], request["name"],
                                   message)
            if self._processes[record.index] is not record:
                return
            record.ready = True
        self._failures = 0
        logger.info("server process %d (pid %d) ready in %.1f s", record.index,
                    record.process.pid, time.monotonic() - record.started)
        if not self._ready_once and all(p is not None and p.ready for p in self._processes):
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
        except OSError as error:
            record.doing.pop(number, None)
            return None, str(error)
        return await future

    async def _ask(self, record: _Process, message: dict[str, Any]) -> None:
        """A repository request that process record received: every ready process does
        it; record gets the first failure, else success."""
        request = {key: message[key] for key in ("what", "name", "archive")}
        async with self._repository:
            ready = [p for p in self._processes if p is not None and p.ready]
            answers = await asyncio.gather(*(self._do(p, request) for p in ready))
            if any(answer[0] is not None for answer in answers):
                self._done_so_far.append(request)
        failed = [answer for answer in answers if answer[0] not in (200, None)]
        status, text = failed[0] if failed else (200, "")
        if not any(answer[0] is not None for answer in answers):
            status, text = 503, "no server process could do it; try again"
        try:
            record.link.send({"op": "answer", "number": message["number"],
                              "status": status, "message": text})
        except OSError:  # it has ended: no one waits
            pass

    # -- connections --

    def _hand(self, connection: socket.socket) -> None:
        """Gives connection to the next ready process (the next one that takes
        connections while none is ready), or holds it while none takes them."""
        running = [p for p in self._processes if p is not None and p.prepared]
        ready = [p for p in running if p.ready] or running
        turn = next(self._turn)
        for k in range(len(ready)):
            record = ready[(turn + k) % len(ready)]
            try:
                record.link.send({"op": "connection"}, (connection.fileno(),))
            except OSError:  # ending, or its link is full: the next
                continue
            connection.close()
            return
        if len(self._held) < _HELD and not self._stopping:
            self._held.append(connection)
        else:
            connection.close()

    # -- stopping --

    def _signalled(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("stopping: %d server process(es) answer what they have received",
                        sum(p is not None for p in self._processes))
        self._stopping = True
        for record in self._processes:
            if record is not None:
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
        running = [p for p in self._processes if p is not None]
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
                    logger.error("server process %d (pid %d) did not stop within %g s: "
                                 "killing it", record.index, record.process.pid, limit)
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
