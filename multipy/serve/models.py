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
    returns its outputs.  The calls an event loop makes share its slots: at most one
    call per interpreter runs, the others queue (in arrival order).  On a loop that
    serves one connection (see ``serve_inline``), the call runs on the loop's own thread.
    """

    def __init__(self, spec: ModelSpec, manager: Any, metrics: Metrics,
                 max_batch_size: int = 1, batch_delay: float = 0.0) -> None:
        self.spec = spec
        self.name = spec.name
        self._manager = manager
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
        series, name, here = self._series, self.name, _here
        try:
            if here.connections is not None and len(here.connections) <= 1:
                # This loop serves only the connection this request came on: the call
                # runs here, blocking the loop (nothing else waits on it), with no
                # hand-over to a worker thread and back.
                for place in places:
                    place.leave()
                with _Busy(series, len(places)):
                    outputs = self.replicated.call_method("infer", names, datatypes, *arrays)
            else:
                if here.slots is None:  # made on this loop's thread, by its first call
                    here.slots = asyncio.Semaphore(len(self._manager))
                async with here.slots:
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



class _LoopThread(threading.local):
    """What the event loop on this thread calls models with (class defaults: none yet)."""

    #: one per interpreter: calls beyond them queue here, in arrival order
    slots: asyncio.Semaphore | None = None
    #: the loop's open connections, when it may call a model on its own thread
    connections: set | None = None


_here = _LoopThread()


def serve_inline(connections: set) -> None:
    """Lets the event loop on this thread call models on this thread, blocking itself,
    whenever ``connections`` (its open connections) holds at most one: the request's
    own.  For a loop with no batching and no per-request timeout only."""
    _here.connections = connections


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
