"""What a ``multipy serve`` process serves: its models over one manager, how they start,
whether they are ready, and inference bounded by the per-request timeout.

Start-up (``start``, on a thread of its own while the HTTP server already answers):
the interpreters start, then every interpreter materialises every model (importing torch
and loading the archive there, then running its example once), the interpreters in
parallel.  The server is ready when all of that is done.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .. import _glibc
from .._pool import capacity
from ..manager import InterpreterManager, cores
from . import archive
from .connection import Limits
from .metrics import STUCK_AFTER, Metrics
from .models import ModelSpec, ServedModel, Turns
from .progress import Progress
from .protocol import MAX_REQUEST_SIZE
from .requests import named

logger = logging.getLogger("multipy.serve")

#: Seconds a graceful stop waits for requests in flight, by default (--graceful-timeout).
GRACEFUL_TIMEOUT = 30.0


def default_interpreters() -> int:
    """The machine's cores, at most as many interpreters (that import torch) as fit in
    this process."""
    room = capacity()
    fit = min(room["free"] + room["more"], _glibc.torch_interpreters_that_fit())
    return max(1, min(cores(), fit))


@dataclass(frozen=True)
class Options:
    """What a server serves and how, as ``multipy serve``'s options say: the same for
    the server that uvicorn runs and for each replica that Ray Serve runs
    (multipy.serve.on_ray).  batch_timeout_ms: --batch-timeout-ms; torch_threads: each
    interpreter's intra-op threads (None: the manager's default, the cores divided
    among the interpreters); max_request_size: --max-request-size, in bytes; limits: what
    a connection may send (--max-header-size, --max-headers, --read-timeout);
    graceful_timeout: --graceful-timeout, seconds (None: no limit)."""

    models: tuple[ModelSpec, ...]
    interpreters: int
    max_batch_size: int = 1
    batch_timeout_ms: float = 5.0
    timeout: float | None = None
    torch_threads: int | None = None
    max_request_size: int = MAX_REQUEST_SIZE
    limits: Limits = Limits()
    graceful_timeout: float | None = GRACEFUL_TIMEOUT


class Service:
    """The models of one server (see the module's docstring), as options say.
    ArchiveError, at once, if a model's path is not a torch.package archive with its
    (module, resource)."""

    def __init__(self, options: Options) -> None:
        for spec in options.models:
            archive.check(spec.path, spec.module, spec.resource)
        self.options = options
        self.specs = {spec.name: spec for spec in options.models}
        self.interpreters = options.interpreters
        self.max_request_size = options.max_request_size
        # row 0 the host's, row k + 1 interpreter k's front end's
        self.metrics = Metrics(list(self.specs), options.interpreters,
                               rows=options.interpreters + 1,
                               stuck_after=options.timeout or STUCK_AFTER)
        self._batching = (options.max_batch_size, options.batch_timeout_ms / 1000)
        self.manager: InterpreterManager | None = None
        self.models: dict[str, ServedModel] = {}
        self.ready = False
        self.failure: BaseException | None = None

    # -- start-up: on its own thread --

    def start(self, before_ready: Callable[[], None] | None = None) -> None:
        """Starts the interpreters and materialises every model on each, with a
        progress bar and a log line per stage, then calls before_ready() and is ready;
        raises what failed."""
        n, m = self.interpreters, len(self.specs)
        progress = Progress(n + n * m, logger)
        try:
            progress.stage(f"starting {n} interpreter(s)")
            # grad off: nothing served needs it, and it saves the autograd graph's memory
            self.manager = InterpreterManager(n, torch_threads=self.options.torch_threads,
                                              grad_enabled=False)
            progress.advance(n, "interpreters started")
            max_batch_size, delay = self._batching
            turns = Turns(n)  # one call per interpreter, of whichever model
            models = [ServedModel(spec, self.manager, self.metrics, turns, max_batch_size, delay,
                                  self.options.timeout)
                      for spec in self.specs.values()]
            progress.stage(f"materialising {m} model(s) on {n} interpreter(s): torch is "
                           f"imported and each archive loaded in every interpreter "
                           f"({self.manager.torch_threads} torch thread(s) each)")
            self._materialise(models, progress)
            for model in models:
                inputs = ", ".join(f"{i['name']} {i['datatype']}{i['shape']}"
                                   for i in model.metadata()["inputs"])
                progress.stage(f"model {model.name!r} from {model.spec.path}: inputs {inputs}")
            self.models = {model.name: model for model in models}
            if before_ready is not None:
                before_ready()
            self.ready = True
        finally:
            progress.close()

    def _materialise(self, models: list[ServedModel], progress: Progress) -> None:
        errors: list[BaseException] = []

        def on(interpreter: Any) -> None:
            try:
                for model in models:
                    model.materialise(interpreter)
                    progress.advance(1, f"{model.name} on interpreter {interpreter.index}")
            except BaseException as error:  # raised on the start-up thread below
                errors.append(error)

        threads = [threading.Thread(target=on, args=(interpreter,), daemon=True,
                                    name=f"multipy-serve-load-{interpreter.index}")
                   for interpreter in self.manager.all_instances()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    # -- serving: on the event loop --

    def model(self, name: str, version: str | None = None) -> ServedModel | None:
        """The model called name (and version, if given), or None while it loads;
        ProtocolError (404) if the server has no such model or version."""
        return named(self.models, self.specs, name, version)

    async def drain(self) -> None:
        """Runs every batch still waiting and waits for it."""
        for model in self.models.values():
            await model.drain()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
