"""asyncio on top of the call path: awaiting a call that runs on a worker thread, and
picking an interpreter without blocking the event loop.

A call awaited here runs as a ``multipy.timeout`` call does (``Interpreter.start``): on a
worker thread, whose end is handed to the loop with ``call_soon_threadsafe``.  The loop
only encodes the request and reads the reply.  When the awaiting task is cancelled
(``task.cancel()``, ``asyncio.wait_for``, ``asyncio.timeout``), the call is given up as at
a deadline: cancelled inside (``CallCancelled`` at its next bytecode) if it runs, never
run if it has not started, and its interpreter handed to no one until it ends.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .session import timeout

if TYPE_CHECKING:
    from ._runtime import _Job
    from .session import InterpreterSession

#: How long acquire_one sleeps between tries while every interpreter runs a call that
#: its caller gave up on.
_RETRY_SECONDS = 0.001


async def result(job: _Job) -> Any:
    """What the running call ``job`` returns (or raises), without blocking the loop.

    If the awaiting task is cancelled, the call is cancelled too (``job.cancel()``) and
    CancelledError propagates at once, without waiting for the call to stop.
    """
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def done(_job: _Job) -> None:  # on the worker thread that ran the call
        try:
            loop.call_soon_threadsafe(_set, ended)
        except RuntimeError:  # the loop is closed: no one waits for the call any more
            pass

    job.add_done_callback(done)
    try:
        await ended
    except asyncio.CancelledError:
        job.cancel()
        raise
    return job.result()


def _set(ended: asyncio.Future) -> None:
    if not ended.done():  # cancelled meanwhile
        ended.set_result(None)


async def acquire_one(manager: Any) -> InterpreterSession:
    """``manager.acquire_one()`` without blocking the loop: while every interpreter runs a
    call that its caller gave up on, this sleeps (asynchronously) and tries again."""
    while True:
        try:
            with timeout(0):  # one try: TimeoutError if no interpreter can be picked
                return manager.acquire_one()
        except TimeoutError:
            await asyncio.sleep(_RETRY_SECONDS)
