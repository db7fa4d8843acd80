"""The tasks that the supervisor and a server process start on their event loops, kept
until they end (asyncio keeps only weak references to tasks), each failure logged with
its traceback rather than lost with the task."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

logger = logging.getLogger("multipy.serve")


class Tasks:
    """Tasks started by ``start``, each kept until it ends."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()

    def start(self, work: Coroutine[Any, Any, Any], what: str) -> asyncio.Task:
        """A task running work (what says it in the log, if it fails), kept until it
        ends; an exception it raises is logged (a cancel is not)."""
        task = asyncio.get_running_loop().create_task(work)
        self._running.add(task)
        task.add_done_callback(lambda done: self._ended(done, what))
        return task

    def _ended(self, task: asyncio.Task, what: str) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            logger.error("%s failed: %s: %s", what, type(error).__name__, error,
                         exc_info=error)
