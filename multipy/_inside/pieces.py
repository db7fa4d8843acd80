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
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            step = self._loop.create_task(self.anext())
            try:
                return self._loop.run_until_complete(step)
            except BaseException:  # (a cancel of the call: the model's stream ends too)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        self._loop.run_until_complete(step)
                raise
        try:
            piece = next(self._source)  # type: ignore[call-overload]
        except StopIteration:
            return None
        except ProtocolError:
            raise
        except Exception as error:
            raise_plainly(error)
        return self._answer(piece)

    async def anext(self) -> tuple | None:
        try:
            piece = await self._source.__anext__()  # type: ignore[union-attr]
        except StopAsyncIteration:
            return None
        except ProtocolError:
            raise
        except Exception as error:
            raise_plainly(error)
        return self._answer(piece)

    def close(self) -> None:
        if not self.asynchronous:
            self._source.close()  # type: ignore[union-attr]
            return
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self.aclose())
        finally:
            self._loop.close()

    async def aclose(self) -> None:
        await self._source.aclose()  # type: ignore[union-attr]


def streams(function: Callable) -> bool:
    """Whether function answers in pieces: a generator function, or an async one."""
    return inspect.isgeneratorfunction(function) or inspect.isasyncgenfunction(function)
