"""A model served by ``multipy serve``, as the host sees it: one torch.package archive
or one Python class (multipy.serve.host.model_class), materialised in every interpreter of
the manager.

The host never imports torch.  Each interpreter loads the archive itself with
``multipy._inside.serving.load`` (its own PackageImporter), its tensors aliasing the
archive's storages in its own mapping of the file, where the host found them
(multipy.serve.host.archive): the page cache's pages, so the weights are in memory once
whatever the number of interpreters; on a CUDA device, in device memory once, copied
there by the host through the driver (``archive.on_device``).  Once every
model is ready, each interpreter's front end answers requests with its own copy (multipy._inside.front_end);
the host itself calls a model only for Ray Serve's replicas and for connections that
arrived while the interpreters started (``ServedModel.infer``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from ..._aio import acquire_one, result
from ...errors import InterpreterError
from ...replicated import ReplicatedObj
from ..request.contract import ServedCalls
from ..request.messages import InferRequest, ProtocolError
from ..request.poison import Table, check
from ..request.requests import ModelError, ModelRequests, Started
from . import archive
from . import model_class
from . import triton_model

if TYPE_CHECKING:
    from ...manager import InterpreterManager
    from ...session import Interpreter, Obj
    from ..request.metrics import Metrics

logger = logging.getLogger("multipy.serve")

_INSIDE = "multipy._inside.serving"
_INSIDE_CLASS = "multipy._inside.classes"
_INSIDE_TRITON = "multipy._inside.served_triton"


@dataclass
class ModelSpec:
    """What to serve, as name: the archive at path, its object at (module, resource);
    or, of kind "class", the class called resource in module (imported by name, or from
    the file at path if there is one); or, of kind "triton", the Triton Python model in
    the folder at path (multipy.serve.host.triton_model)."""

    name: str
    path: str
    module: str = "model"
    resource: str = "model.pkl"
    kind: str = "archive"

    def check(self) -> None:
        """ArchiveError, model_class.ClassError or triton_model.ModelConfigError, unless
        the model can be loaded (as far as the host sees without importing it)."""
        if self.kind == "class":
            model_class.check(self.path, self.module, self.resource)
        elif self.kind == "triton":
            triton_model.read(self.path)
        else:
            archive.check(self.path, self.module, self.resource)

    @property
    def loading(self) -> str:
        """What loading it does in each interpreter, as the start-up log says it."""
        if self.kind == "triton":
            return "a Triton model's model.py imported and its initialize() run"
        if self.kind == "class":
            return "a model class's instance made"
        return "torch imported and an archive loaded"

    @property
    def has_code(self) -> bool:
        """Whether loading the model runs its own code (a class's, a Triton model's),
        which may raise: the first interpreter loads it before the server listens."""
        return self.kind in ("class", "triton")

    def __str__(self) -> str:
        if self.kind == "class":
            return f"{self.path or self.module}:{self.resource}"
        if self.kind == "triton":
            return f"Triton model {self.name!r} ({self.path})"
        return self.path


class ServedModel(ModelRequests):
    """One model on every interpreter of a manager.

    ``materialise(interpreter)`` loads it there (and runs its example once, if the
    archive has one), on device (an archive's model: "cpu", "cuda" or "cuda:N"; so is a
    LitAPI's and an nn.Module's, other classes choose their own); ``ready`` is true once
    every interpreter has it, and ``instance`` is the loaded model there.
    ``infer(request)`` (see ModelRequests) runs a request on a free interpreter: every
    call of every model takes a turn from ``turns``, which the server's models share, so
    that at most one call per interpreter runs and the others wait in arrival order.
    """

    def __init__(self, spec: ModelSpec, manager: InterpreterManager, metrics: Metrics,
                 turns: Turns,
                 max_batch_size: int = 1, batch_delay: float = 0.0,
                 timeout: float | None = None, device: str = "cpu",
                 refused: Table | None = None) -> None:
        super().__init__(spec.name, metrics.models[spec.name], max_batch_size, batch_delay,
                         timeout)
        self.spec = spec
        self._metrics = metrics
        self._manager = manager
        self._turns = turns
        self.device = device
        self.max_batch_size = max_batch_size
        self._refused = refused  # with --processes: the inputs that crashed processes
        self._storages: tuple | None = None  # load's storages (and device, keeper) arguments
        self._mapping = threading.Lock()
        self.replicated = ReplicatedObj(manager, self._load)
        self._calls = ServedCalls(self.replicated)
        self._materialised: set[Interpreter] = set()

    # -- loading: from the start-up thread --

    def _load(self, interpreter: Interpreter) -> Obj:
        spec = self.spec
        if spec.kind == "class":
            return interpreter.global_(_INSIDE_CLASS, "load")(
                spec.path, spec.module, spec.resource, spec.name, self.device,
                self.max_batch_size)
        if spec.kind == "triton":
            model = triton_model.read(spec.path)
            return interpreter.global_(_INSIDE_TRITON, "load")(
                model.model_file, spec.name, model.version, json.dumps(model.config),
                interpreter.index)
        with self._mapping:  # interpreters load in parallel: the archive is read once
            if self._storages is None:
                spans = archive.records(self.spec.path)
                self._storages = (spans,) if self.device == "cpu" else \
                    archive.on_device(archive.storages(self.spec.path, spans), self.device)
        load = interpreter.global_(_INSIDE, "load")
        return load(self.spec.path, self.spec.module, self.spec.resource, *self._storages)

    def materialise(self, interpreter: Interpreter) -> None:
        """Loads the model on interpreter and warms it up (nothing if it has already);
        the first one also reads the metadata."""
        if interpreter in self._materialised:
            return
        self._calls.warm_up(interpreter)
        if self._described is None:
            self.describe(self._calls.metadata(interpreter))
        self._materialised.add(interpreter)

    def instance(self, interpreter: Interpreter) -> Obj:
        """The model loaded on interpreter (loaded now if it is not yet)."""
        return self.replicated.instance(interpreter)

    def forget(self) -> None:
        """Has each interpreter that materialised the model let go of what the process
        keeps of its package for good (multipy._inside.serving.Served.forget), before
        the model is dropped."""
        for interpreter in self._materialised:
            self._calls.forget(interpreter)

    def finish(self) -> None:
        """At the server's stop: a Triton model's ``finalize()`` in every interpreter
        that has it (``forget``: multipy._inside.served_triton), a failure logged;
        nothing for other kinds."""
        if self.spec.kind == "triton":
            try:
                self.forget()
            except Exception:
                logger.exception("model %r: finalize() failed", self.name)

    @property
    def ready(self) -> bool:
        """Whether every interpreter has materialised the model."""
        return len(self._materialised) == len(self._manager)

    # -- serving: on the event loop --

    async def healthy(self) -> bool:
        """For a model with a health check of its own (a LitAPI's, a kserve.Model's): what
        the last one that a front end ran said (the host cannot run it: the model lives
        in the interpreters), or False if none has run yet; True for other models."""
        if not (self._described or {}).get("own_health"):
            return True
        return bool(self._metrics.last_health(self.name))

    async def _run(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                   arrays: list[Any], started: Started, given: dict[str, Any],
                   request: InferRequest | None) -> tuple:
        stuck = self._metrics.all_stuck()  # (the front ends' interpreters)
        if stuck:
            raise ProtocolError(f"{stuck}; try again later", 503)
        if self._refused is not None:
            check(self._refused, self.name, names, datatypes, arrays, given)
        try:
            async with self._turns:
                with started:
                    return await self._calls.infer(names, datatypes, *arrays, **given)
        except InterpreterError as error:  # a type the host cannot re-create
            raise ModelError(f"model {self.name!r} raised {error.type_name}: "
                             f"{error.message}") from error


    async def _steps(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                     arrays: list[Any], started: Started, given: dict[str, Any],
                     request: InferRequest) -> AsyncIterator[tuple]:
        """A model that streams, from the host: its pieces made in one interpreter, whose
        turn the stream holds to its end (each step one call there)."""
        stuck = self._metrics.all_stuck()  # (the front ends' interpreters)
        if stuck:
            raise ProtocolError(f"{stuck}; try again later", 503)
        if self._refused is not None:
            check(self._refused, self.name, names, datatypes, arrays, given)
        async with self._turns:
            with await acquire_one(self._manager) as session:
                pieces = PiecesCalls(self._calls.stream(session.interpreter, names,
                                                        datatypes, *arrays, **given))
                ended = False
                try:
                    while True:
                        try:
                            with started:
                                piece = await pieces.next()
                        except BaseException:  # (a step that raised, or was cancelled,
                            ended = True  # has ended the model's stream)
                            raise
                        if piece is None:
                            ended = True
                            return
                        yield piece
                        started = started.later()
                finally:
                    if not ended:  # (closed early, between steps)
                        await pieces.close()


class PiecesCalls:
    """The host's calls of a model's answer in pieces in one interpreter (a
    multipy._inside.pieces.Pieces, through pieces, its multipy.session.Obj), each awaited
    without blocking the loop, cancelled if the awaiting task is."""

    def __init__(self, pieces: Obj) -> None:
        self._pieces = pieces

    async def next(self) -> tuple | None:
        """The next piece's outputs (as ``Served.infer``'s), or None at the end."""
        return await result(self._pieces.start_call_value("next"))

    async def close(self) -> None:
        """Ends the model's stream early (its ``finally`` runs)."""
        await result(self._pieces.start_call_value("close"))


class Turns:
    """The interpreters' turns, shared by the models of a server and every event loop
    that calls them: ``count`` calls run at once, the others wait in arrival order.

    ``async with turns:`` waits for a turn (a cancelled wait takes none); ``give``
    returns one, from any thread, handing it to the first call waiting.
    """

    def __init__(self, count: int) -> None:
        self._free = count
        self._waiting: deque[tuple[asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._lock = threading.Lock()

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
            if self._free:  # a turn is free only while no call waits: none is jumped
                self._free -= 1
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

    async def __aexit__(self, *exc_info: object) -> None:
        self.give()
