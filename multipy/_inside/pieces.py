"""A model's answer in pieces, inside one interpreter: what a model that streams gives
its front end (multipy._inside.front_end) in place of one answer.

A model streams when the function that answers a request is a generator function, or
an async generator function (a class's ``predict``; a LitAPI's with ``stream=True``):
calling it runs none of its code, and each of its yields is one piece of the answer.
``Pieces`` runs it one piece at a time, each step a call of its own, so that the front
end writes each piece as it is made, and answers other requests between steps.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any, AsyncIterator, Callable, Iterator

from ..serve.request.messages import ProtocolError
from .serving import raise_plainly

#: Seconds that a cancelled step of an async generator run on a loop of its own is given
#: to stop (a cancel that lands in the loop's own code may leave it waiting for nothing).
_STOPS_WITHIN = 0.5


class Pieces:
    """The pieces that source (a generator, or an async generator) yields, each made
    into outputs as ``Served.infer`` returns them by answer(piece).  ``next()`` runs the
    model to its next piece (an async generator on an event loop of its own, kept for
    its next steps: on a thread with no loop running), ``anext()`` awaits it on the
    running loop; each returns None once the model has ended, and raises what the
    model raised as ``raise_plainly`` raises it (a ProtocolError, InvalidInput's, as
    it is).  ``close()`` or ``aclose()`` ends the model early: its ``finally`` runs."""

    def __init__(self, source: Iterator | AsyncIterator, answer: Callable[[Any], tuple]
                 ) -> None:
        self._source, self._answer = source, answer
        #: whether source is an async generator (``anext``, on the front end's loop)
        self.asynchronous = inspect.isasyncgen(source)
        self._loop: asyncio.AbstractEventLoop | None = None  # next()'s, for an async one

    def next(self) -> tuple | None:
        if self.asynchronous:
            return self._next_on_own_loop()
        try:
            with _plainly():
                piece = next(self._source)  # type: ignore[call-overload]
        except StopIteration:
            return None
        return self._answer(piece)

    def _next_on_own_loop(self) -> tuple | None:
        """next() of an async generator, on a loop of this object's own, which ends with
        the stream: at its end, or at what a step raised (a cancel of the call too: the
        step is cancelled, waited for _STOPS_WITHIN seconds at most, and the model's
        stream ended)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        if loop.is_closed():
            return None
        step = loop.create_task(self.anext())
        try:
            piece = loop.run_until_complete(step)
        except BaseException:
            self._end_own_loop(step)
            raise
        if piece is None:
            self._end_own_loop(step)
        return piece

    def _end_own_loop(self, step: asyncio.Task) -> None:
        loop = self._loop
        with contextlib.suppress(BaseException):  # (the stream is over, whatever it says)
            if not step.done():
                step.cancel()
                loop.run_until_complete(asyncio.wait({step}, timeout=_STOPS_WITHIN))
            if step.done():  # (else the model still runs its step: it is not closed)
                loop.run_until_complete(self._source.aclose())
        loop.close()

    async def anext(self) -> tuple | None:
        try:
            with _plainly():
                piece = await self._source.__anext__()  # type: ignore[union-attr]
        except StopAsyncIteration:
            return None
        return self._answer(piece)

    def close(self) -> None:
        if not self.asynchronous:
            self._source.close()  # type: ignore[union-attr]
            return
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._loop.is_closed():  # (ended already)
            return
        try:
            self._loop.run_until_complete(self.aclose())
        finally:
            self._loop.close()

    async def aclose(self) -> None:
        await self._source.aclose()  # type: ignore[union-attr]


@contextlib.contextmanager
def _plainly() -> Iterator[None]:
    """What the model raises in it, as ``raise_plainly`` raises it (a ProtocolError, and
    a builtin exception such as the end of its iteration, as it is)."""
    try:
        yield
    except ProtocolError:
        raise
    except Exception as error:
        raise_plainly(error)


def streams(function: Callable) -> bool:
    """Whether function answers in pieces: a generator function, or an async one."""
    return inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function)
