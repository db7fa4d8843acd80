"""What a ``multipy serve`` process serves: its models over one manager, how they start,
whether they are ready, and inference bounded by the per-request timeout.

Start-up (``start``, on a thread of its own while the HTTP server already answers):
the interpreters start, then every interpreter materialises every model (importing torch
and loading the archive there, then running its example once), the interpreters in
parallel.  The server is ready when all of that is done.  A model written as a class is
loaded on the first interpreter before the server listens (``prepare``), so that an
error in its code stops the server before anything connects.  Then, with
``--model-control explicit``, the model repository's requests load and unload models
(``load``, ``unload``: multipy.serve.request.repository), one at a time, and tell the front ends.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ... import _glibc, _runtime
from ..._parallel import on_each
from ..._pool import capacity
from ...manager import InterpreterManager, cores
from ..http.connection import Limits
from ..request.messages import MAX_REQUEST_SIZE, ProtocolError
from ..request.metrics import STUCK_AFTER, Metrics
from ..request.poison import Table
from ..request.repository import LOADING, READY, REASON_CHARACTERS, UNAVAILABLE, UNLOADED
from ..request.requests import named
from . import archive, model_class
from .control import Watcher
from .models import ModelSpec, ServedModel, Turns
from .progress import Progress

if TYPE_CHECKING:
    from ...session import Interpreter

logger = logging.getLogger("multipy.serve")

#: Seconds a graceful stop waits for requests in flight, by default (--graceful-timeout).
GRACEFUL_TIMEOUT = 30.0
#: Models that a server with --model-control explicit can load beyond those it starts
#: with (each new name takes a slot of the metrics for good).
MORE_MODELS = 32
#: The most rounds of calls that an unload makes to have what a model held given back.
_RELEASE_ROUNDS = 5


def default_interpreters(processes: int = 1) -> int:
    """The machine's cores divided among processes, at most as many interpreters (that
    import torch) as fit in one process."""
    room = capacity()
    fit = min(room["free"] + room["more"], _glibc.torch_interpreters_that_fit())
    return max(1, min(cores() // processes, fit))


@dataclass(frozen=True)
class Options:
    """What a server serves and how, as ``multipy serve``'s options say: the same for
    the server that uvicorn runs and for each replica that Ray Serve runs
    (multipy.serve.on_ray).  batch_timeout_ms: --batch-timeout-ms; torch_threads: each
    interpreter's intra-op threads (None: the manager's default, the cores divided
    among the interpreters); max_request_size: --max-request-size, in bytes; limits: what
    a connection may send (--max-header-size, --max-headers, --read-timeout);
    graceful_timeout: --graceful-timeout, seconds (None: no limit); model_control:
    --model-control (multipy.serve.request.repository.MODEL_CONTROLS); model_repository: the
    directories (real paths) whose archives the repository's loads may read
    (--model-repository; none: only the archives the server started with); device: where
    the archives' models run (--device: "cpu", "cuda", "cuda:N"); http_restricted,
    grpc_restricted: --http-restricted-api and --grpc-restricted-protocol, as
    multipy.serve.request.restricted.parse gives them; strict_readiness:
    --strict-readiness (multipy.serve.request.repository.not_ready)."""

    models: tuple[ModelSpec, ...]
    interpreters: int
    max_batch_size: int = 1
    batch_timeout_ms: float = 5.0
    timeout: float | None = None
    torch_threads: int | None = None
    max_request_size: int = MAX_REQUEST_SIZE
    limits: Limits = Limits()
    graceful_timeout: float | None = GRACEFUL_TIMEOUT
    model_control: str = "none"
    model_repository: tuple[str, ...] = ()
    device: str = "cpu"
    http_restricted: tuple[tuple[str, str, str], ...] = ()
    grpc_restricted: tuple[tuple[str, str, str], ...] = ()
    strict_readiness: bool = True

    @property
    def slots(self) -> int:
        """The models whose metrics the server has room for: those it starts with, and
        MORE_MODELS more with --model-control explicit (every process's board agrees)."""
        return len(self.models) + (MORE_MODELS if self.model_control == "explicit" else 0)


@dataclass(frozen=True)
class Place:
    """Where a server stands among ``multipy serve --processes``'s (multipy.serve.
    supervisor): one of ``processes``, counting in slot ``index`` of the ``slots`` of the
    shared metrics board mapped from the file descriptor ``board`` (None: a board of its
    own, one process), refusing the inputs that the table mapped from ``refused`` names
    (multipy.serve.request.poison; None: none)."""

    index: int = 0
    processes: int = 1
    board: int | None = None
    slots: int = 1
    refused: int | None = None


class Service:
    """The models of one server (see the module's docstring), as options say, as the
    process at place.  ArchiveError (or model_class.ClassError), at once, if a model's
    path is not a torch.package archive with its (module, resource) (or its class is
    not to be found)."""

    def __init__(self, options: Options, place: Place = Place()) -> None:
        for spec in options.models:
            spec.check()
        self.options = options
        self.specs = {spec.name: spec for spec in options.models}
        self.interpreters = options.interpreters
        self.max_request_size = options.max_request_size
        self.model_control = options.model_control
        self.http_restricted = options.http_restricted
        self.grpc_restricted = options.grpc_restricted
        self.strict_readiness = options.strict_readiness
        #: each model's (state, reason), as the repository's index says them
        self.states = {name: (LOADING, "") for name in self.specs}
        # row 0 the host's, row k + 1 interpreter k's front end's (of each process)
        rows = options.interpreters + 1
        self.metrics = Metrics(list(self.specs), options.interpreters,
                               rows=rows * place.slots,
                               stuck_after=options.timeout or STUCK_AFTER,
                               slots=options.slots, fd=place.board,
                               first=place.index * rows, processes=place.processes,
                               cores=cores())
        #: the inputs refused for having crashed processes (multipy.serve.request.poison)
        self.refused = None if place.refused is None else Table(fd=place.refused)
        if options.torch_threads is None and place.processes > 1:  # the cores, shared
            options = dataclasses.replace(options, torch_threads=max(
                1, cores() // (place.processes * options.interpreters)))
            self.options = options
        self._batching = (options.max_batch_size, options.batch_timeout_ms / 1000)
        self.manager: InterpreterManager | None = None
        self.models: dict[str, ServedModel] = {}
        self.ready = False
        self._readied = threading.Event()  # set with ready
        self.failure: BaseException | None = None
        self._turns: Turns | None = None
        self._loading: list[ServedModel] = []  # the models that start makes ready, until then
        self._watchers: list[Watcher] = []
        self._changing = threading.Lock()  # one load or unload at a time

    # -- start-up: on its own thread --

    def prepare(self) -> None:
        """Before the server listens, if it serves a model written as a class: starts
        the interpreters and loads each such model on the first, so that what the
        class's own code raises (importing its module, making the instance, its
        ``load()``; no ``predict``) stops the server before it listens, as
        model_class.ClassError with the interpreter's traceback; so do two LitAPIs on
        one path (model_class.check_paths).  Nothing for archives,
        whose checks need no interpreter (``Service()``'s); ``start`` does the rest."""
        classes = [spec for spec in self.specs.values() if spec.has_code]
        if not classes:
            return
        logger.info("starting %d interpreter(s), and loading %s on the first before "
                    "listening", self.interpreters, ", ".join(map(str, classes)))
        self._start_interpreters()
        for model in self._loading:
            if model.spec.has_code:
                try:
                    model.materialise(self.manager[0])
                except Exception as error:
                    raise model_class.failed(str(model.spec), error) from error
        model_class.check_paths([(str(model.spec), model.described) for model in self._loading])

    def start(self, before_ready: Callable[[], None] | None = None) -> None:
        """Starts the interpreters (unless ``prepare`` has) and materialises every model
        on each, with a progress bar and a log line per stage, then calls before_ready()
        and is ready; raises what failed."""
        n, m = self.interpreters, len(self.specs)
        progress = Progress(n + n * m, logger)
        try:
            if self.manager is None:
                progress.stage(f"starting {n} interpreter(s)")
                self._start_interpreters()
            progress.advance(n, "interpreters started")
            models, self._loading = self._loading, []  # (self.models holds them from now on)
            loading = "; ".join(dict.fromkeys(model.spec.loading for model in models))
            progress.stage(f"materialising {m} model(s) on {n} interpreter(s), in each: "
                           f"{loading} ({self.manager.torch_threads} torch thread(s))")
            self._materialise(models, progress)
            for model in models:
                inputs = ", ".join(f"{i['name']} {i['datatype']}{i['shape']}"
                                   for i in model.metadata()["inputs"])
                progress.stage(f"model {model.name!r} from {model.spec}: inputs "
                               f"{inputs or '(not declared)'}")
            self.models = {model.name: model for model in models}
            self.states = {name: (READY, "") for name in self.specs}
            if before_ready is not None:
                before_ready()
            self.ready = True
            self._readied.set()
        finally:
            progress.close()

    def _start_interpreters(self) -> None:
        """The manager, the interpreters' turns, and the models to load on them."""
        # grad off: nothing served needs it, and it saves the autograd graph's memory
        self.manager = InterpreterManager(self.interpreters,
                                          torch_threads=self.options.torch_threads,
                                          grad_enabled=False)
        self._turns = Turns(self.interpreters)  # one call per interpreter, of whichever model
        self._loading = [self._served(spec) for spec in self.specs.values()]

    def _served(self, spec: ModelSpec) -> ServedModel:
        max_batch_size, delay = self._batching
        return ServedModel(spec, self.manager, self.metrics, self._turns, max_batch_size, delay,
                           self.options.timeout, self.options.device, self.refused)

    def _materialise(self, models: list[ServedModel], progress: Progress | None) -> None:
        def on(interpreter: Interpreter) -> None:
            for model in models:
                model.materialise(interpreter)
                if progress is not None:
                    progress.advance(1, f"{model.name} on interpreter {interpreter.index}")

        on_each(self.manager.all_instances(), on, "multipy-serve-load")

    # -- serving: on the event loop --

    def model(self, name: str, version: str | None = None) -> ServedModel | None:
        """The model called name (and version, if given), or None while it loads (or is
        unloaded); ProtocolError (404) if the server has no such model or version."""
        return named(self.models, self.specs, name, version)

    # -- the model repository: each on a thread of its own --

    def watch(self, watcher: Watcher) -> None:
        """Has watcher told as models change: ``watcher.added(name, model)`` once model
        is on every interpreter, ``watcher.changed(name, state, reason)`` when it is no
        longer ready (the front ends forget it then)."""
        self._watchers.append(watcher)

    async def load(self, name: str, archive: dict[str, str]) -> None:
        """load_now, on a thread."""
        await asyncio.to_thread(self.load_now, name, archive)

    async def unload(self, name: str) -> None:
        """unload_now, on a thread."""
        await asyncio.to_thread(self.unload_now, name)

    def load_now(self, name: str, archive_of: dict[str, str]) -> None:
        """Loads model name on every interpreter, from the archive that archive_of names
        (multipy.serve.request.repository.archive; see _spec for where it may be), else from the
        one it was served from; a model loaded from that archive already stays as it is.
        A model loaded from another archive serves on while the new one loads, and is
        replaced only once it has loaded.  ProtocolError: 503 while the server starts,
        404 for an archive it may not read or a model it does not know, 400 for an
        archive that is not one (or no room for another model's metrics), 500 if loading
        it fails (a model that was not loaded is UNAVAILABLE then, with the reason; one
        that was serves on)."""
        self._started()
        with self._changing:
            spec = self._spec(name, archive_of)
            if name in self.models and self.models[name].spec == spec:
                return
            try:
                spec.check()
                self.metrics.add(name)
            except (archive.ArchiveError, ValueError) as error:
                raise ProtocolError(f"model {name!r} cannot be loaded: {error}") from None
            replaced = [self.models[name]] if name in self.models else []
            if not replaced:
                self.specs[name] = spec
                self._change(name, LOADING, f"loading {spec}")
            model = self._served(spec)
            try:
                self._materialise([model], None)
            except Exception as error:
                reason = f"loading {spec} failed: {type(error).__name__}: {error}"
                reason = reason[:REASON_CHARACTERS]
                if not replaced:
                    self._change(name, UNAVAILABLE, reason)
                failed = [model]
                del model
                self._release(failed)  # what the interpreters that loaded it hold
                also = "; the model loaded before serves on" if replaced else ""
                raise ProtocolError(f"model {name!r}: {reason}{also}", 500) from None
            self.specs[name] = spec
            self.models = {**self.models, name: model}
            self.states = {**self.states, name: (READY, "")}
            for watcher in self._watchers:
                watcher.added(name, model)
            if replaced:
                self._release(replaced)
        logger.info("model %r loaded from %s", name, spec)

    def unload_now(self, name: str) -> None:
        """Unloads model name from every interpreter: its requests are refused from now on
        (those in flight are answered), its readiness is false, and what it held is given
        back once they are; its state is UNAVAILABLE, UNLOADED.  A model whose load
        failed is only marked so (the server's readiness no longer counts it); nothing
        for one already unloaded.  ProtocolError: 503 while the server starts, 404 for
        a model it does not know."""
        self._started()
        with self._changing:
            named(self.models, self.specs, name)  # 404 for a model it does not know
            if name not in self.models:
                if self.states.get(name, (READY, ""))[1] != UNLOADED:  # (a failed load)
                    self._change(name, UNAVAILABLE, UNLOADED)
                return
            self._drop(name, UNAVAILABLE, UNLOADED)
        logger.info("model %r unloaded", name)

    def wait_ready(self, timeout: float) -> bool:
        """Waits (at most timeout seconds) until the server is ready; whether it is."""
        return self._readied.wait(timeout)

    def _started(self) -> None:
        if not self.ready:
            raise ProtocolError("the server is still starting: its models load and unload "
                                "once it is ready", 503)

    def _spec(self, name: str, archive_of: dict[str, str]) -> ModelSpec:
        """The archive that a load of model name reads.  With --model-repository: the
        "path" that archive_of names, relative to one of its directories and inside it,
        else NAME.pt there, else the archive the model was served from.  Without: only
        the archive the model was served from.  ProtocolError: 404 for any other, alike
        whether it exists or not; 400 for a path without --model-repository."""
        directories = self.options.model_repository
        module = archive_of.get("module", "model")
        resource = archive_of.get("resource", "model.pkl")
        if "path" in archive_of and not directories:
            raise ProtocolError(
                "this server loads only the archives it was started with: start it with "
                "--model-repository DIR to load archives from DIR")
        relative = archive_of.get("path", f"{name}.pt")
        found = archive.find(directories, relative) if directories else None
        if found is not None:
            return ModelSpec(name, found, module, resource)
        if "path" not in archive_of and name in self.specs:
            return self.specs[name]
        if "path" in archive_of:
            raise ProtocolError(f"model {name!r}: the model repository has no archive "
                                f"{relative!r}", 404)
        where = (f"it has no {name}.pt" if directories else
                 "to load a new model, start the server with --model-repository DIR")
        raise ProtocolError(f"unknown model {name!r}: {where}", 404)

    def _change(self, name: str, state: str, reason: str) -> None:
        # (models and states are replaced, not changed: the event loop reads them)
        self.states = {**self.states, name: (state, reason)}
        for watcher in self._watchers:
            watcher.changed(name, state, reason)

    def _drop(self, name: str, state: str, reason: str) -> None:
        """Under _changing: no front end serves model name any more, and what the
        interpreters held of it is given back."""
        self._change(name, state, reason)
        dropped = [self.models[name]]
        self.models = {other: each for other, each in self.models.items() if other != name}
        self._release(dropped)

    def _release(self, dropped: list[ServedModel]) -> None:
        """Gives back what the interpreters hold of the model in dropped (its only
        reference, which this takes), which nothing serves any more."""
        dropped[0].forget()
        dropped.clear()
        # Releases travel with calls: the host's handles of it go in with a call, the
        # interpreters' releases of the weights they aliased come back with a later
        # reply.  Calls until what the host has lent them stops shrinking.
        lent = -1
        for _ in range(_RELEASE_ROUNDS):
            gc.collect()
            for interpreter in self.manager.all_instances():
                interpreter.global_("gc", "collect")()
            gc.collect()
            if len(_runtime.exports.objects) == lent:
                break
            lent = len(_runtime.exports.objects)

    async def drain(self) -> None:
        """Runs every batch still waiting and waits for it."""
        for model in self.models.values():
            await model.drain()

    def close(self) -> None:
        """Has each model finish (ServedModel.finish), then stops the interpreters."""
        if self.manager is not None:
            for model in self.models.values():
                model.finish()
            self.manager.close()
