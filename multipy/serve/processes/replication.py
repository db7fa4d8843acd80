"""The model repository of ``multipy serve --processes``, kept the same in every server
process (``Replication``): a load or unload that one process's front end receives is
done by every ready process, one request at a time; a process that has just loaded the
start-up models redoes the repository's present state (multipy.serve.processes.policy
.Present) before it takes connections."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Iterable

from .handover import ServerProcess
from .link import Answer, Ask, Do, RepositoryRequest
from .policy import Present

logger = logging.getLogger("multipy.serve")


class Replication:
    """The repository of the processes that a supervisor runs, started with models."""

    def __init__(self, models: Iterable[str]) -> None:
        self._present = Present(models)
        self._numbers = itertools.count(1)  # of the ``Do`` requests
        self._one_at_a_time = asyncio.Lock()

    async def redo(self, record: ServerProcess, still: list[ServerProcess]) -> int | None:
        """Has process record redo the repository's present state, and marks it ready
        if it is still in still: the requests redone; None if it ended first."""
        redone = 0
        async with self._one_at_a_time:
            for request in self._present.requests():
                redone += 1
                status, message = await self._do(record, request)
                if status is None:
                    return None
                if status != 200:
                    logger.warning("server process %d: redoing the model repository's %s of "
                                   "%r: %s", record.index, request.what, request.name, message)
            if record not in still:
                return None
            record.ready = True
            record.became_ready.set()
        return redone

    async def ask(self, record: ServerProcess, message: Ask,
                  processes: list[ServerProcess]) -> None:
        """A repository request that process record received: every ready process of
        processes does it; record is answered with the first failure, else success."""
        request = message.request
        if request.what not in ("load", "unload"):
            status, text = 400, f"a model repository request to {request.what!r}"
        else:
            async with self._one_at_a_time:
                ready = [p for p in processes if p.ready and not p.retiring]
                answers = await asyncio.gather(*(self._do(p, request) for p in ready))
                self._present.note(request, [status for status, _ in answers])
            failed = [answer for answer in answers if answer[0] not in (200, None)]
            status, text = failed[0] if failed else (200, "")
            if not any(answer[0] is not None for answer in answers):
                status, text = 503, "no server process could do it; try again"
        try:
            record.link.send(Answer(message.number, status, text))
        except OSError:  # it has ended: no one waits
            pass

    async def _do(self, record: ServerProcess, request: RepositoryRequest
                  ) -> tuple[int | None, str]:
        """(status, message) of process record doing request; (None, why) if it ended."""
        number = next(self._numbers)
        future = asyncio.get_running_loop().create_future()
        record.doing[number] = future
        try:
            record.link.send(Do(number, request))
        except (OSError, ValueError) as error:
            record.doing.pop(number, None)
            return None, str(error)
        return await future
