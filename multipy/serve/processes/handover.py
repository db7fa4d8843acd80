"""The supervisor's hand-over of connections (``Handover``): which server processes'
front ends accept on the listening socket themselves (those that take connections: told
by ``Accepting``), to which process each connection that the supervisor accepts goes
(those that no front end took in time, and all while none takes any), and its copy of
each, kept until the process has taken it (the process notes the number of the last one
it took in its host row of the metrics board, before it reads a byte of any): a process
that dies first has those handed to another.  ``ServerProcess`` is one process as the
supervisor knows it."""
from __future__ import annotations

import asyncio
import asyncio.subprocess
import itertools
import socket
import time
from dataclasses import dataclass, field
from ..request.board import Board
from .link import Accepting, Connection, Link, Pong

#: Seconds without an answer to a health check after which a process gets no new
#: connection.
UNRESPONSIVE_AFTER = 3.0
#: Connections held while no process takes them (one is starting).
_HELD = 4096
#: Connections handed to a process above which the copies of those it has taken are
#: closed (``release`` does it every second too).
_KEPT = 32


@dataclass
class ServerProcess:
    """One server process, as the supervisor knows it."""

    index: int  #: which of the P processes it is (the logs' "server process k")
    slot: int  #: its rows of the metrics board
    link: Link
    process: asyncio.subprocess.Process
    baseline: int  #: the requests its slot had counted when it started
    started: float = field(default_factory=time.monotonic)
    #: it has checked its models (a class loaded on its first interpreter): it takes
    #: connections while no process is ready, and its health is checked
    prepared: bool = False
    loaded: bool = False  #: it has loaded its start-up models
    ready: bool = False  #: it has redone the repository's requests: it takes connections
    retiring: bool = False  #: replaced: it takes no new connection, and stops
    accepting: bool = False  #: its front ends accept on the listening socket (told so)
    replaces: ServerProcess | None = None  #: the process it replaces while that one runs
    #: since when a health check waits for its answer (time.monotonic(); None: none waits)
    waiting: float | None = None
    health: Pong = field(default_factory=Pong)  #: what it answered last
    recycle_at: int | None = None  #: the requests after which it is replaced
    #: numbers of the connections handed to it and not yet taken -> the connection
    handed: dict[int, socket.socket] = field(default_factory=dict)
    #: numbers of the ``do`` requests sent to it -> the future of its ``done``
    doing: dict[int, asyncio.Future] = field(default_factory=dict)
    became_ready: asyncio.Event = field(default_factory=asyncio.Event)  #: set with ready
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def responsive(self, now: float) -> bool:
        """Whether it has answered every health check but one of the last
        UNRESPONSIVE_AFTER seconds."""
        return self.waiting is None or now - self.waiting < UNRESPONSIVE_AFTER

    def taking(self, now: float) -> bool:
        """Whether it takes new connections before any other kind: ready, not retiring,
        answering, with an interpreter free of a stuck call."""
        return self.ready and not self.retiring and self.responsive(now) and \
            self.health.stuck < self.health.interpreters

    def name(self) -> str:
        return f"server process {self.index} (pid {self.process.pid})"


class Handover:
    """Hands connections to the processes (each of ``rows`` rows of board), in the
    order ``order`` decides."""

    def __init__(self, board: Board, rows: int) -> None:
        self._board, self._rows = board, rows
        self._takers: list[ServerProcess] = []
        self._held: list[socket.socket] = []
        self._turn = itertools.count()
        self._numbers = itertools.count(1)
        self._stopped = False

    def order(self, processes: list[ServerProcess]) -> None:
        """Decides which of processes new connections go to, as their state changes
        (and every second), and hands them what was held meanwhile: those ``taking``;
        else, while none is, those ready and answering (each answers what it can: a stuck
        one, 503); else those that have prepared and answer (none is ready: they answer
        health and readiness themselves)."""
        now = time.monotonic()
        alive = [p for p in processes if p.prepared and not p.retiring
                 and p.process.returncode is None and p.responsive(now)]
        taking = [p for p in alive if p.taking(now)]
        self._takers = taking or [p for p in alive if p.ready] or alive
        for record in processes:
            if record.accepting != (record in taking):
                try:
                    record.link.send(Accepting(record in taking))
                except OSError:  # ending: it accepts nothing more
                    continue
                record.accepting = record in taking
        if self._held and self._takers:
            held, self._held = self._held, []
            for connection in held:
                self.hand(connection)

    def hand(self, connection: socket.socket, besides: ServerProcess | None = None) -> None:
        """Gives connection to the next process that takes it (another than besides,
        where there is another), keeping a copy until that one has taken it; holds it
        while none takes connections (closes it once stopped)."""
        if self._stopped:
            connection.close()
            return
        takers = [p for p in self._takers if p is not besides] or self._takers
        turn = next(self._turn)
        for k in range(len(takers)):
            record = takers[(turn + k) % len(takers)]
            number = next(self._numbers)
            try:
                record.link.send(Connection(number), (connection.fileno(),))
            except OSError:  # ending, or its link is full: the next
                continue
            record.handed[number] = connection
            if len(record.handed) > _KEPT:
                self.release(record)
            return
        if len(self._held) < _HELD:
            self._held.append(connection)
        else:
            connection.close()

    def served(self, record: ServerProcess) -> int:
        """The requests process record has answered since it started."""
        return self._board.requests(record.slot * self._rows, self._rows) - record.baseline

    def release(self, record: ServerProcess) -> None:
        """Closes the copies of the connections process record has taken."""
        taken = self._board.taken(record.slot * self._rows)
        while record.handed:
            number = next(iter(record.handed))
            if number > taken:
                break
            record.handed.pop(number).close()

    def stop(self) -> None:
        """Takes no more connections: closes those held, and any handed from now on."""
        self._stopped = True
        for connection in self._held:
            connection.close()
        self._held = []
