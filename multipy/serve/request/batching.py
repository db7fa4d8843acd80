"""Dynamic batching: requests that arrive close together run as one call.

Requests whose inputs all have the same leading (batch) size, and agree in names,
datatypes and the other dimensions, wait together until their rows reach the largest
batch or the oldest has waited the batch timeout.  Then each input is concatenated along
dimension 0, the model runs once, and every output is split back along dimension 0, each
request getting its own rows; or, for a model that answers each request of a call on its
own (a Triton Python model's ``execute``), each gets its own answer (``Outcomes``).  A
request that cannot be batched (a scalar input, inputs of different leading sizes, or as
many rows as the largest batch) runs alone, at once.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from .messages import Tensor


class Outcomes(list):
    """A call's answer for each of its requests, in order: its outputs (a list of
    Tensor), or the exception that its client gets."""

    def only(self) -> list[Tensor]:
        """The outputs of a call's one request; raises its exception."""
        (outcome,) = self
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


#: Runs the model once: (inputs, the tokens of the requests they hold) -> outputs, or
#: each request's own.
Run = Callable[[list[Tensor], list[Any]], Awaitable["list[Tensor] | Outcomes"]]


class BatchError(Exception):
    """A batch's outputs cannot be split back into its requests (the model's fault)."""


@dataclass
class _Waiting:
    inputs: list[Tensor]
    rows: int
    token: object
    answer: asyncio.Future


@dataclass
class _Batch:
    waiting: list[_Waiting] = field(default_factory=list)
    rows: int = 0
    timer: asyncio.TimerHandle | None = None


class Batcher:
    """Gathers one model's requests into batches of at most ``max_rows`` rows, waiting at
    most ``delay`` seconds after the first; ``run`` calls the model.  Used from one
    event loop."""

    def __init__(self, run: Run, max_rows: int, delay: float) -> None:
        if max_rows < 2:
            raise ValueError(f"a batch holds at least 2 rows, not {max_rows}")
        self._run = run
        self._max_rows = max_rows
        self._delay = max(delay, 0.0)
        self._open: dict[tuple, _Batch] = {}
        self._running: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        """Requests waiting for their batch to start."""
        return sum(len(batch.waiting) for batch in self._open.values())

    async def submit(self, inputs: list[Tensor], token: object = None
                     ) -> list[Tensor] | Outcomes:
        """The outputs for this request's inputs, run in a batch when it can be; token
        goes with the request to ``run`` (Outcomes of one, if run gives them, where it
        runs alone).

        Raises what the model call raised, or BatchError if an output has not one row
        per row of the batch.  Cancelling the caller takes its request out of the batch;
        a batch all of whose requests were cancelled is cancelled too.
        """
        rows = batch_rows(inputs)
        if rows is None or rows >= self._max_rows:
            return await self._run(inputs, [token])
        key = tuple((t.name, t.datatype, t.array.shape[1:]) for t in inputs)
        batch = self._open.get(key)
        if batch is not None and batch.rows + rows > self._max_rows:
            self._start(key)  # this request would not fit: the batch goes as it is
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self._delay, self._start, key, batch)
        waiting = _Waiting(inputs, rows, token, asyncio.get_running_loop().create_future())
        batch.waiting.append(waiting)
        batch.rows += rows
        if batch.rows >= self._max_rows:
            self._start(key)
        return await waiting.answer

    def _start(self, key: tuple, batch: _Batch | None = None) -> None:
        """Runs the open batch under key (only if it is still ``batch``, when given)."""
        if batch is not None and self._open.get(key) is not batch:
            return
        batch = self._open.pop(key)
        if batch.timer is not None:
            batch.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._execute(batch.waiting))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

        def forsaken(_answer: asyncio.Future) -> None:
            if all(w.answer.cancelled() for w in batch.waiting):
                task.cancel()  # no one waits: the call is cancelled inside

        for waiting in batch.waiting:
            waiting.answer.add_done_callback(forsaken)

    async def _execute(self, batch: list[_Waiting]) -> None:
        waiting = [w for w in batch if not w.answer.done()]
        if not waiting:
            return
        try:
            import numpy as np  # (the host makes batchers, but runs batches only as it serves)

            total = sum(w.rows for w in waiting)
            inputs = [Tensor(first.name, first.datatype,
                             np.concatenate([w.inputs[i].array for w in waiting]))
                      for i, first in enumerate(waiting[0].inputs)]
            outputs = await self._run(inputs, [w.token for w in waiting])
            if isinstance(outputs, Outcomes):
                for w, outcome in zip(waiting, outputs):
                    if w.answer.done():
                        continue
                    if isinstance(outcome, BaseException):
                        w.answer.set_exception(outcome)
                    else:
                        w.answer.set_result(outcome)
                return
            for output in outputs:
                if output.array.ndim == 0 or output.array.shape[0] != total:
                    raise BatchError(
                        f"output {output.name!r} has shape {list(output.array.shape)}, not a "
                        f"leading dimension of {total} (one row per row of the batch's "
                        f"inputs): this model cannot be batched; serve it with "
                        f"--max-batch-size 1")
            start = 0
            for w in waiting:
                stop = start + w.rows
                if not w.answer.done():
                    w.answer.set_result([Tensor(o.name, o.datatype, o.array[start:stop])
                                         for o in outputs])
                start = stop
        except asyncio.CancelledError:
            for w in waiting:
                w.answer.cancel()
            raise
        except Exception as error:
            for w in waiting:
                if not w.answer.done():
                    w.answer.set_exception(error)

    async def drain(self) -> None:
        """Starts every open batch now and waits for every batch to end (at shutdown)."""
        for key in list(self._open):
            self._start(key)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)


def batch_rows(inputs: list[Tensor]) -> int | None:
    """The leading size that every input shares, or None if they do not share one (or
    one is a scalar): such a request cannot be batched."""
    sizes = {t.array.shape[0] if t.array.ndim else None for t in inputs}
    if len(sizes) != 1:
        return None
    rows = sizes.pop()
    return rows if rows else None
