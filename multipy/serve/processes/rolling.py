"""Replacing the server processes of ``multipy serve --processes`` while they serve
(``Rolling``), one at a time, each new process ready before its old one stops: SIGHUP's
round of every process, and a process past --max-requests (with its jitter)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable

from .handover import Handover, ServerProcess
from .tasks import Tasks

logger = logging.getLogger("multipy.serve")


class Rolling:
    """Rounds of replacements of processes (the supervisor's list, as it changes),
    started by ``start(index, replaces)``; an old process still running stop_within
    seconds after it retired (None: no limit) is killed.  One round at a time."""

    def __init__(self, processes: list[ServerProcess], handover: Handover, tasks: Tasks,
                 start: Callable[[int, ServerProcess], Awaitable[ServerProcess]],
                 stopping: Callable[[], bool], stop_within: float | None,
                 max_requests: int | None) -> None:
        self._processes, self._handover, self._tasks = processes, handover, tasks
        self._start, self._stopping = start, stopping
        self._stop_within, self._max_requests = stop_within, max_requests
        self._round: asyncio.Task | None = None

    def every_process(self) -> None:
        """SIGHUP: every process is replaced, one at a time (unless a round runs)."""
        if self._round is not None:
            logger.warning("SIGHUP: processes are being replaced already; try again once "
                           "they are")
            return
        logger.info("SIGHUP: replacing the %d server processes, one at a time",
                    len(self._processes))
        self._round = self._tasks.start(
            self._roll(sorted(self._processes, key=lambda p: p.index)), "SIGHUP's round")

    def recycle(self, record: ServerProcess) -> None:
        """Replaces process record if it has answered its --max-requests and no round
        runs."""
        if record.recycle_at is None or not record.ready or record.retiring \
                or self._round is not None:
            return
        served = self._handover.served(record)  # (a sum over its rows: only when it may count)
        if served < record.recycle_at:
            return
        logger.info("%s has answered %d requests (--max-requests): replacing it",
                    record.name(), served)
        self._round = self._tasks.start(self._roll([record]), "replacing a process")

    def cancel(self) -> None:
        """Stops the round that runs, if one does."""
        if self._round is not None:
            self._round.cancel()

    def retire(self, record: ServerProcess) -> None:
        """Process record, replaced, takes no new connection and stops gracefully."""
        if record not in self._processes:
            return
        record.retiring = True
        self._handover.order(self._processes)
        logger.info("%s is replaced: it answers what it has received, and stops",
                    record.name())
        try:
            os.kill(record.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    async def _roll(self, old: list[ServerProcess]) -> None:
        """Replaces each process of old in turn: a new one starts beside it, and once
        it is ready the old one retires (and has stopped before the next starts).  A new
        one that dies first ends the round."""
        try:
            for record in old:
                if record not in self._processes or record.retiring or self._stopping():
                    continue
                try:
                    new = await self._start(record.index, record)
                except OSError as error:
                    logger.error("replacing the server processes stopped: a process could "
                                 "not be started (%s); the others serve on as they are",
                                 error)
                    return
                await either(new.became_ready, new.ended)
                if not new.ready:
                    logger.error("replacing the server processes stopped: the others serve "
                                 "on as they are")
                    if record.recycle_at is not None:  # tried again after as many more
                        record.recycle_at = self._handover.served(record) + \
                            (self._max_requests or 0)
                    return
                try:
                    await asyncio.wait_for(record.ended.wait(), self._stop_within)
                except asyncio.TimeoutError:
                    logger.error("%s did not stop within %g s: killing it", record.name(),
                                 self._stop_within)
                    record.process.kill()
                    await record.ended.wait()
        finally:
            self._round = None


async def either(*events: asyncio.Event) -> None:
    """Returns once one of events is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
