"""A model served by ``multipy serve``: one torch.package archive, materialised in every
interpreter of the manager, called with the arrays of decoded requests.

The host never imports torch.  Each interpreter loads the archive itself with
``multipy._inside.serving.load`` (its own PackageImporter), its tensors aliasing the
archive's storages that the host mapped once (multipy.serve.archive), so the weights are
in memory once whatever the number of interpreters.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InterpreterError
from ..replicated import ReplicatedObj
from . import archive
from .batching import Batcher
from .protocol import InferRequest, ProtocolError, Tensor

if TYPE_CHECKING:
    from ..session import Interpreter, Obj
    from .metrics import Metrics

_INSIDE = "multipy._inside.serving"


@dataclass
class ModelSpec:
    """What to serve: the archive at path, its object at (module, resource), as name."""

    name: str
    path: str
    module: str = "model"
    resource: str = "model.pkl"


class ModelError(Exception):
    """The model failed on a request (its fault, not the client's): answered with 500."""


class ServedModel:
    """One model on every interpreter of a manager.

    ``materialise(interpreter)`` loads it there (and runs its example once, if the
    archive has one); ``ready`` is true once every interpreter has it.  ``infer(request)``
    runs a request on a free interpreter, through the batcher when batching is on, and
    returns its outputs.  Every call of every model takes a turn from ``turns``, which
    the server's models share: at most one call per interpreter runs, the others wait
    in arrival order, whatever event loop they come from.  On a loop that serves one
    connection (see ``serve_inline``), a call that finds a turn free runs on the loop's
    own thread.
    """

    def __init__(self, spec: ModelSpec, manager: Any, metrics: Metrics, turns: Turns,
                 max_batch_size: int = 1, batch_delay: float = 0.0) -> None:
        self.spec = spec
        self.name = spec.name
        self._manager = manager
        self._turns = turns
        self._series = metrics.models[spec.name]
        self._storages: dict[str, Any] | None = None
        self._mapping = threading.Lock()
        self.replicated = ReplicatedObj(manager, self._load)
        self._materialised: set[Interpreter] = set()
        self._metadata: dict[str, list[dict]] | None = None
        self._parameters: list[str] = []
        self._batcher = Batcher(self._call, max_batch_size, batch_delay) \
            if max_batch_size > 1 else None

    # -- loading: from the start-up thread --

    def _load(self, interpreter: Interpreter) -> Obj:
        with self._mapping:  # interpreters load in parallel: the archive is mapped once
            if self._storages is None:
                self._storages = archive.storages(self.spec.path)
        load = interpreter.global_(_INSIDE, "load")
        return load(self.spec.path, self.spec.module, self.spec.resource, self._storages)

    def materialise(self, interpreter: Interpreter) -> None:
        """Loads the model on interpreter and warms it up; the first one also reads the
        metadata."""
        instance = self.replicated.instance(interpreter)
        instance.call_value("warm_up")
        if self._metadata is None:
            self._metadata = instance.call_value("metadata")
            self._parameters = [spec["name"] for spec in self._metadata["inputs"]]
        self._materialised.add(interpreter)

    @property
    def ready(self) -> bool:
        """Whether every interpreter has materialised the model."""
        return len(self._materialised) == len(self._manager)

    def metadata(self) -> dict[str, Any]:
        """The protocol's model metadata: inputs named after forward's parameters."""
        described = self._metadata or {"inputs": [], "outputs": []}
        return {"name": self.name, "versions": ["1"], "platform": "pytorch_torch_package",
                "inputs": described["inputs"], "outputs": described["outputs"]}

    # -- serving: on the event loop --

    async def infer(self, request: InferRequest) -> list[Tensor]:
        """The outputs for request, as the request selects them; ProtocolError for an
        output it names that the model does not give, ModelError if the model fails,
        BatchError if a batch's outputs cannot be split."""
        place = _Place(self._series.queued)
        try:
            if self._batcher is not None:
                outputs = await self._batcher.submit(request.inputs, place)
            else:
                outputs = await self._call(request.inputs, [place])
        finally:
            place.leave()
        return self._select(outputs, request)

    async def _call(self, inputs: list[Tensor], places: list[_Place]) -> list[Tensor]:
        """One call of the model, with inputs that hold the requests at places."""
        names = self._names(inputs)
        datatypes = tuple(t.datatype for t in inputs)
        arrays = [t.array for t in inputs]
        series, name, turns, inline = self._series, self.name, self._turns, _here.inline
        try:
            if (inline is not None and len(inline.connections) + inline.arriving <= 1
                    and turns.try_take()):
                # This loop serves only the connection this request came on, and an
                # interpreter is free: the call runs here, blocking the loop, with no
                # hand-over to a worker thread and back.  The server hands new
                # connections to loops not in such a call while there is one; a
                # connection handed to this one meanwhile waits for the call to end.
                for place in places:
                    place.leave()
                inline.calling = True
                try:
                    with _Busy(series, len(places)):
                        outputs = self.replicated.call_method("infer", names, datatypes, *arrays)
                finally:
                    inline.calling = False
                    turns.give()
            else:
                async with turns:
                    for place in places:
                        place.leave()
                    with _Busy(series, len(places)):
                        outputs = await self.replicated.acall_method(
                            "infer", names, datatypes, *arrays)
        except InterpreterError as error:  # a type the host cannot re-create
            raise ModelError(f"model {name!r} raised {error.type_name}: {error.message}") from error
        except Exception as error:
            raise ModelError(f"model {name!r} raised {type(error).__name__}: {error}") from error
        output_names, output_datatypes, *arrays = outputs
        return [Tensor(*output) for output in zip(output_names, output_datatypes, arrays)]

    def _names(self, inputs: list[Tensor]) -> tuple[str, ...] | None:
        """The inputs' names when every one names one of forward's parameters (they are
        given by name), else None (by position in request order)."""
        names = tuple(t.name for t in inputs)
        if self._parameters and set(names) <= set(self._parameters):
            return names
        return None

    def _select(self, outputs: list[Tensor], request: InferRequest) -> list[Tensor]:
        if request.outputs is None:
            return outputs
        given = {t.name: t for t in outputs}
        missing = [name for name, _ in request.outputs if name not in given]
        if missing:
            raise ProtocolError(f"model {self.name!r} has no output {missing[0]!r}; its "
                                f"outputs are {', '.join(given) or 'none'}")
        return [given[name] for name, _ in request.outputs]

    async def drain(self) -> None:
        """Runs what waits in the batcher now and waits for it (at shutdown)."""
        if self._batcher is not None:
            await self._batcher.drain()



class Turns:
    """The interpreters' turns, shared by the models of a server and every event loop
    that calls them: ``count`` calls run at once, the others wait in arrival order.

    ``async with turns:`` waits for a turn (a cancelled wait takes none); ``try_take``
    takes one only if one is free, for a call that must not wait; ``give`` returns one,
    from any thread, handing it to the first call waiting.
    """

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiting: deque[tuple[asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._lock = threading.Lock()

    def try_take(self) -> bool:
        with self._lock:
            return self._take()

    def _take(self) -> bool:
        """Under the lock: takes a free turn, if there is one (a turn is free only while
        no call waits: none is jumped)."""
        if self._free:
            self._free -= 1
            return True
        return False

    def give(self) -> None:
        with self._lock:
            while self._waiting:
                waiter, loop = self._waiting.popleft()
                try:
                    loop.call_soon_threadsafe(self._hand, waiter)
                    return
                except RuntimeError:  # its loop is closed: no one waits there any more
                    continue
            self._free += 1

    def _hand(self, waiter: asyncio.Future) -> None:
        """On the waiter's loop: the turn is its, unless it stopped waiting meanwhile."""
        if waiter.cancelled():
            self.give()
        else:
            waiter.set_result(None)

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._take():
                return
            waiter = loop.create_future()
            self._waiting.append((waiter, loop))
        try:
            await waiter
        except asyncio.CancelledError:
            with self._lock:
                handed = (waiter, loop) not in self._waiting
                if not handed:
                    self._waiting.remove((waiter, loop))
            if handed and waiter.done() and not waiter.cancelled():
                self.give()  # handed, then cancelled before it ran: passed on
            raise  # (handed but not yet there: _hand passes it on)

    async def __aexit__(self, *exc_info: Any) -> None:
        self.give()


class ServingLoop:
    """An event loop that serves connections, as whoever hands it connections and its
    calls see it: ``connections``, its open ones (uvicorn's set); ``arriving``, those
    handed to it and not there yet; ``calling``, whether it is in a call on its own
    thread (see ``serve_inline``)."""

    def __init__(self, connections: set) -> None:
        self.connections = connections
        self.arriving = 0
        self.calling = False


class _LoopThread(threading.local):
    """The inline loop on this thread, if there is one (class default: none)."""

    inline: ServingLoop | None = None


_here = _LoopThread()


def serve_inline(loop: ServingLoop) -> None:
    """Lets the event loop on this thread, ``loop``, call models on this thread, blocking
    itself, whenever its connections, open and arriving, are at most one: the request's
    own.  For a loop with no batching and no per-request timeout only."""
    _here.inline = loop


class _Busy:
    """One call of a model in the metrics: calls, the requests it answers, busy
    interpreters while it runs."""

    __slots__ = ("_series", "_requests")

    def __init__(self, series: Any, requests: int) -> None:
        self._series, self._requests = series, requests

    def __enter__(self) -> None:
        self._series.busy.inc()
        self._series.calls.inc()
        self._series.batched.observe(self._requests)

    def __exit__(self, *exc_info: Any) -> None:
        self._series.busy.dec()


class _Place:
    """A request's place in its model's queue, which it leaves once, when its call
    starts or, failing that, when it is answered."""

    __slots__ = ("_gauge",)

    def __init__(self, gauge: Any) -> None:
        gauge.inc()
        self._gauge = gauge

    def leave(self) -> None:
        if self._gauge is not None:
            self._gauge.dec()
            self._gauge = None
