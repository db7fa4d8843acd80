"""A model written as a Python class, inside one interpreter: what ``multipy serve
MODULE:CLASS`` (or ``FILE.py:CLASS``) runs here.

The contract (docs/serve/classes.md): the class is made with no
arguments; its ``load()``, if it has one, runs once, before the server is ready;
``predict(inputs)`` gets a dict of input name -> numpy array (BYTES: an array of dtype
object holding bytes) and returns the outputs: a dict of name -> array (or tensor), a
tuple or list (output0, output1, ...), or one array; it may be ``async``.  A
``predict`` that is a generator function (or an async one) streams: each dict it yields
is one piece of the answer (multipy._inside.pieces).  Class
attributes ``inputs`` (and ``outputs``) declare them, as a config.json does for an
archive: requests are then checked against them.  ``multipy.serve.InvalidInput``
raised in ``predict`` is a 400 with its message; anything else a 500.
"""
from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any

from ..serve.request.protocol import ProtocolError
from .pieces import Pieces, streams
from .serving import declaration, flat, named_outputs, raise_plainly


def load(kind: type, described_as: str) -> ServedClass:
    """An instance of the class kind (which has a ``predict``), loaded (``load()``) and
    ready to serve; its ``inputs`` and ``outputs``, if declared, read as described_as."""
    config = None
    if getattr(kind, "inputs", None) is not None:
        config = declaration({"inputs": kind.inputs, "outputs": getattr(kind, "outputs", [])},
                             f"{described_as}.inputs and .outputs")
    instance = kind()
    if callable(getattr(instance, "load", None)):
        instance.load()
    return ServedClass(instance, config)


async def own_health(check: Any) -> bool:
    """What a model's own health check says: check() (awaited if it is a coroutine
    function's) as a bool; what it raises, raised."""
    state = check()
    return bool(await state if inspect.isawaitable(state) else state)


class ServedClass:
    """One class-written model in this interpreter, called as ``multipy._inside.serving.
    Served`` is: ``infer`` (on a thread with no event loop running), ``infer_async`` (on
    the front end's loop), ``stream`` (a predict that streams), ``metadata``, ``warm_up``
    and ``forget``."""

    def __init__(self, instance: Any, config: dict[str, list[dict]] | None) -> None:
        self.instance = instance
        self.config = config
        #: whether predict is a coroutine function: awaited, on the front end's loop
        self.asynchronous = inspect.iscoroutinefunction(instance.predict)
        #: whether predict answers in pieces (a generator function, or an async one)
        self.streams = streams(instance.predict)

    def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
              ) -> tuple:
        """The model's outputs for the arrays (named names), as Served.infer gives them;
        an async predict runs to its end here, on an event loop of its own."""
        if self.asynchronous:
            return asyncio.run(self.infer_async(names, datatypes, *arrays))
        return self._answer(lambda: self.instance.predict(self._inputs(names, arrays)))

    async def infer_async(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                          *arrays: Any) -> tuple:
        """infer's, awaiting an async predict on the running loop."""
        result = await self._guarded(self.instance.predict(self._inputs(names, arrays)))
        return self._answer(lambda: result)

    def stream(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
               ) -> Pieces:
        """The pieces of the answer of a predict that streams, for the arrays (named
        names): none of predict's code has run yet."""
        return Pieces(self.instance.predict(self._inputs(names, arrays)),
                      lambda piece: self._answer(lambda: piece))

    async def _guarded(self, work: Any) -> Any:
        try:
            return await work
        except ProtocolError:
            raise
        except Exception as error:
            raise_plainly(error)

    def _inputs(self, names: tuple[str, ...], arrays: tuple) -> dict[str, Any]:
        """(A class's requests always name their inputs: ModelRequests._names.)"""
        return dict(zip(names, arrays))

    def _answer(self, predict: Any) -> tuple:
        try:
            outputs = named_outputs(sys.modules.get("torch"), predict(), set())
        except ProtocolError:  # InvalidInput: the client's fault, a 400
            raise
        except Exception as error:
            raise_plainly(error)
        return flat(outputs)

    def metadata(self) -> dict[str, Any]:
        """What the class declares (its ``inputs`` and ``outputs``), else none."""
        streaming = {"streams": True} if self.streams else {}
        if self.config is None:
            return {"inputs": [], "outputs": [], "platform": "python", **streaming}
        return {**self.config, "declared": True, "platform": "python", **streaming}

    def warm_up(self) -> None:
        """Nothing: load() has run."""

    def forget(self) -> None:
        """Nothing is kept for good beyond the module, which stays imported."""
