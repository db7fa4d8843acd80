"""One model's inference requests, from decoded request to outputs: the path that every
front end of a server shares, in each interpreter (``multipy._inside.front_end``) and in
the host (Ray Serve's replicas, and connections that arrive while the interpreters
start: ``multipy.serve.host.models``).  Each side says only how the model runs there.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Awaitable, Collection, Mapping, TypeVar

from .batching import Batcher, Outcomes, batch_rows
from .messages import Answer, InferRequest, ProtocolError, Tensor
from .metrics import Count, ModelSeries, Timing

Result = TypeVar("Result")


class ModelError(Exception):
    """The model failed on a request (its fault, not the client's): answered with 500."""


def _text(error: BaseException) -> str:
    """str(error), or what says that it has none (its __str__ raised)."""
    try:
        return str(error)
    except Exception as failure:
        return f"(its message cannot be shown: str() raised {type(failure).__name__})"


class ServiceTimeout(Exception):
    """A request ran past --timeout; its call was cancelled."""


def named(models: Mapping[str, Any], served: Collection[str], name: str,
          version: str | None = None) -> Any:
    """The model called name (and version, if given) in models, or None while it loads;
    ProtocolError (404) if served (the names of the models the server serves) has no
    such model, or it no such version."""
    if name not in served:
        raise ProtocolError(f"unknown model {name!r}; this server serves "
                            f"{', '.join(map(repr, served))}", 404)
    model = models.get(name)
    versions = ("1",) if model is None else model.versions
    if version not in (None, "", *versions):
        raise ProtocolError(f"model {name!r} has no version {version!r}; its only "
                            f"version is {versions[0]!r}", 404)
    return model


class ModelRequests(abc.ABC):
    """The requests of one model: ``infer(request)`` answers one, through the batcher
    when batching is on (max_batch_size > 1) and within ``timeout`` seconds when one is
    given.  Subclasses define ``_run``, which runs the model once."""

    def __init__(self, name: str, series: ModelSeries, max_batch_size: int = 1,
                 batch_delay: float = 0.0, timeout: float | None = None) -> None:
        self.name = name
        self._series = series
        self._timeout = timeout
        self._described: dict[str, list[dict]] | None = None
        self._declared: dict[str, dict] | None = None  # name -> input, if declared
        self._parameters: frozenset[str] = frozenset()
        self._platform = "pytorch_torch_package"  # "python": a class, given inputs by name
        #: whether a call of one request also gets its id and parameters (``request=``)
        self._wants_request = False
        #: whether the model answers each request of a call on its own (``requests=``)
        self._per_request = False
        #: the versions it serves (the first is the one that answers)
        self.versions: tuple[str, ...] = ("1",)
        self._batcher = Batcher(self._call, max_batch_size, batch_delay) \
            if max_batch_size > 1 else None
        #: whether the model answers in pieces (``stream``; multipy._inside.pieces)
        self.streams = False

    def describe(self, described: dict[str, Any]) -> None:
        """Sets the model's inputs and outputs, as ``multipy._inside.serving.Served.metadata``
        gives them; requests are checked against inputs it says are declared.  A model
        that answers each request on its own ("per_request": multipy._inside.
        served_triton) says its versions and its own batching ([rows, seconds], or None
        for none), which replace the server's."""
        self._described = described
        self._parameters = frozenset(spec["name"] for spec in described["inputs"])
        self._declared = {spec["name"]: spec for spec in described["inputs"]} \
            if described.get("declared") else None
        self._platform = described.get("platform", "pytorch_torch_package")
        self._wants_request = bool(described.get("wants_request"))
        self._per_request = bool(described.get("per_request"))
        #: the most rows a request may have (a Triton model's max_batch_size), or None
        self._max_rows = described.get("max_rows")
        self.versions = tuple(described.get("versions", ("1",)))
        if "batching" in described:
            batching = described["batching"]
            self._batcher = None if batching is None else Batcher(self._call, *batching)
        self.streams = bool(described.get("streams"))
        if self.streams:  # (each request's pieces are its own: no batches)
            self._batcher = None

    @property
    def ready(self) -> bool:
        """Whether the model answers (the host's may still load on some interpreters)."""
        return True

    async def healthy(self) -> bool:
        """The model's own word on its health, where it has one (a kserve.Model's
        ``healthy()``, a LitAPI's ``health()``): while false, it is not ready."""
        return True

    @property
    def described(self) -> dict[str, Any] | None:
        """What ``describe`` was given (for another front end's copy of the model)."""
        return self._described

    @property
    def cancellable(self) -> bool:
        """Whether cancelling ``infer`` can stop a request before its call ends: its call
        does not hold the event loop's thread, or it may wait for its batch."""
        return True

    def metadata(self) -> dict[str, Any]:
        """The protocol's model metadata: inputs named after forward's parameters, or
        those the model declares."""
        described = self._described or {"inputs": [], "outputs": []}
        return {"name": self.name, "versions": list(self.versions), "platform": self._platform,
                "inputs": [{key: spec[key] for key in ("name", "datatype", "shape")}
                           for spec in described["inputs"]],
                "outputs": described["outputs"]}

    @abc.abstractmethod
    async def _run(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                   arrays: list[Any], started: Started, given: dict[str, Any],
                   request: InferRequest | None) -> tuple:
        """Runs the model once, entering ``started`` as the call begins, given the keyword
        arguments given (``request``: (id, parameters), to a model that wants them), for
        request (None: a batch's); returns what ``Served.infer`` returns.  Cancelling it
        cancels the call."""

    async def infer(self, request: InferRequest, timing: Timing) -> list[Tensor]:
        """The outputs for request, as the request selects them, with the time it waited
        and its call took in timing; ProtocolError for an output it names that the model
        does not give, or inputs that are not those the model declares, ModelError if the
        model fails, BatchError if a batch's outputs cannot be split, ServiceTimeout past
        the timeout (the call is cancelled).  A model that streams answers with its one
        piece (ProtocolError, 400, if it makes more: see ``only_piece``)."""
        if self.streams:
            return await self.only_piece(request, timing)
        if self._declared is not None:
            self._check(request.inputs)
        place = _Place(self._series.queued, request, timing)
        try:
            work = self._call(request.inputs, [place], request) if self._batcher is None \
                else self._batcher.submit(request.inputs, place)
            outputs = await self._within(work, self._deadline())
        finally:
            place.leave()
        if isinstance(outputs, Outcomes):
            outputs = outputs.only()
        return outputs if request.outputs is None else self._select(outputs, request)

    async def stream(self, request: InferRequest, timing: Timing
                     ) -> AsyncIterator[list[Tensor]]:
        """The answer to request in pieces, each as ``infer`` gives outputs, as the model
        makes them: one step of the model per piece (multipy._inside.pieces), in which
        its interpreter is busy; other requests run between steps.  A model that does not
        stream gives its one answer.  --timeout bounds the whole stream; errors as
        ``infer``'s.  Closed early (its client went away), the model's stream ends at
        once: its ``finally`` runs.  Each piece sent is counted (``sent``)."""
        if not self.streams:
            yield await self.infer(request, timing)
            return
        if self._declared is not None:
            self._check(request.inputs)
        deadline = self._deadline()
        place = _Place(self._series.queued, request, timing)
        steps = None
        try:
            names, datatypes, arrays = zip(*request.inputs)
            steps = self._steps(self._names(names), datatypes, list(arrays),
                                Started(self._series, [place]), self._given([place], request),
                                request)
            while True:
                try:
                    piece = await self._within(self._model_call(anext(steps)), deadline)
                except StopAsyncIteration:
                    return
                outputs = list(map(Tensor, piece[0], piece[1], piece[2:]))
                yield outputs if request.outputs is None else self._select(outputs, request)
        finally:
            place.leave()
            if steps is not None:
                await steps.aclose()

    def sent(self) -> None:
        """One piece of a streamed answer of the model's has gone to its client."""
        self._series.streamed()

    async def only_piece(self, request: InferRequest, timing: Timing) -> list[Tensor]:
        """The one piece of ``stream``'s answer to request; ProtocolError: 500 if the model
        made none, 400 if it makes a second (its stream is then ended): such a model's
        answers are asked for where they can come in pieces."""
        async with contextlib.aclosing(self.stream(request, timing)) as pieces:
            first = await anext(pieces, None)
            if first is None:
                raise ProtocolError(f"model {self.name!r} ended its stream without an answer",
                                    500)
            if await anext(pieces, None) is not None:
                raise ProtocolError(
                    f"model {self.name!r} answers in pieces: ask with POST /v2/models/"
                    f"{self.name}/generate_stream, or gRPC's ModelStreamInfer")
            self.sent()
            return first

    def _deadline(self) -> float | None:
        """When a request that arrives now passes --timeout (time.monotonic), if set."""
        return None if self._timeout is None else time.monotonic() + self._timeout

    async def _within(self, work: Awaitable[Result], deadline: float | None) -> Result:
        """work's result; ServiceTimeout if deadline passes first (work is cancelled)."""
        if deadline is None:
            return await work
        try:
            return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise ServiceTimeout(f"model {self.name!r} did not answer within {self._timeout} "
                                 f"s (--timeout); the call was cancelled") from None

    @abc.abstractmethod
    def _steps(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
               arrays: list[Any], started: Started, given: dict[str, Any],
               request: InferRequest) -> AsyncIterator[tuple]:
        """Runs a model that streams, for request, one step per piece, the first step
        within started (a later one within ``started.later()``); yields what
        ``Served.infer`` returns, for each piece.  Closing it ends the model's stream."""

    async def _call(self, inputs: list[Tensor], places: list[_Place],
                    request: InferRequest | None = None) -> list[Tensor] | Outcomes:
        """One call of the model, with inputs that hold the requests at places (request:
        the one request, when the call is not a batch's); what the model raises,
        SystemExit or KeyboardInterrupt included, is a ModelError.  Outcomes, request
        by request, for a model that answers each on its own."""
        names, datatypes, arrays = zip(*inputs)
        outputs = await self._model_call(self._run(
            self._names(names), datatypes, list(arrays), Started(self._series, places),
            self._given(places, request), request))
        if self._per_request:
            return _outcomes(*outputs)
        output_names, output_datatypes, *arrays = outputs
        return list(map(Tensor, output_names, output_datatypes, arrays))

    def _given(self, places: list[_Place], request: InferRequest | None) -> dict[str, Any]:
        """The keyword arguments that a call of the requests at places gets (request:
        the one request, when the call is not a batch's): each request's own, for a
        model that answers each on its own; its id and parameters, for one that wants
        them; else none."""
        if self._per_request:
            return {"requests": [_asked(place.request) for place in places]}
        if self._wants_request and request is not None:
            return {"request": (request.id, request.parameters)}
        return {}

    async def _model_call(self, work: Awaitable[Result]) -> Result:
        """work's result, where work is a call of the model: what the model raises,
        SystemExit or KeyboardInterrupt included, is a ModelError."""
        try:
            return await work
        except (ModelError, ProtocolError, StopAsyncIteration):  # said already, or ended
            raise
        except asyncio.CancelledError:  # the caller's end, not the model's
            raise
        except BaseException as error:  # GeneratorExit too: asyncio cancels, never closes
            raise ModelError(f"model {self.name!r} raised {type(error).__name__}: "
                             f"{_text(error)}") from error

    def _names(self, names: tuple[str, ...]) -> tuple[str, ...] | None:
        """The inputs' names when every one names one of forward's parameters (they are
        given by name), or always for a class's predict (it gets a dict), else None (by
        position in request order)."""
        if self._platform == "python" or (self._parameters
                                          and self._parameters.issuperset(names)):
            return names
        return None

    def _check(self, inputs: list[Tensor]) -> None:
        """ProtocolError (400) unless inputs are the declared ones: each by its name, of
        its datatype and of its shape (-1: any size), none missing unless optional."""
        declared = self._declared
        for tensor in inputs:
            spec = declared.get(tensor.name)
            if spec is None:
                raise ProtocolError(f"model {self.name!r} has no input {tensor.name!r}; its "
                                    f"inputs are {', '.join(map(repr, declared))}")
            if tensor.datatype != spec["datatype"]:
                raise ProtocolError(f"model {self.name!r}: input {tensor.name!r} is "
                                    f"{tensor.datatype}, not {spec['datatype']}")
            shape, wanted = list(tensor.array.shape), spec["shape"]
            if len(shape) != len(wanted) or any(w not in (-1, s) for w, s in zip(wanted, shape)):
                raise ProtocolError(f"model {self.name!r}: input {tensor.name!r} has shape "
                                    f"{shape}, not {wanted} (-1: any size)")
        rows = self._max_rows
        if rows and any(t.array.ndim and t.array.shape[0] > rows for t in inputs):
            raise ProtocolError(f"inference request batch-size must be <= {rows} for "
                                f"{self.name!r}")
        given = {tensor.name for tensor in inputs}
        missing = [name for name, spec in declared.items()
                   if name not in given and not spec.get("optional")]
        if missing:
            raise ProtocolError(f"model {self.name!r}: input {missing[0]!r} is missing "
                                f"({declared[missing[0]]['datatype']} "
                                f"{declared[missing[0]]['shape']})")

    def _select(self, outputs: list[Tensor], request: InferRequest) -> list[Tensor]:
        """The outputs that request names, in its order; ProtocolError for one that the
        model does not give."""
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


def _asked(request: InferRequest) -> tuple:
    """What a model that answers each request on its own gets of one: (id, parameters,
    rows, the outputs asked for by name or None)."""
    outputs = None if request.outputs is None else [name for name, _ in request.outputs]
    return (request.id, request.parameters, batch_rows(request.inputs) or 0, outputs)


def _outcomes(answers: tuple, *arrays: object) -> Outcomes:
    """The Outcomes of a call of a model that answers each request on its own, from
    what it returns (multipy._inside.served_triton.ServedTriton.infer: each request's
    Answer, as a plain tuple, then the outputs' arrays): its outputs, or a ProtocolError
    with its status, gRPC code and message."""
    found = Outcomes()
    start = 0
    for answer in map(Answer._make, answers):
        if answer.status:
            found.append(ProtocolError(answer.message, answer.status, answer.code))
            continue
        names = answer.names
        found.append(list(map(Tensor, names, answer.datatypes,
                              arrays[start:start + len(names)])))
        start += len(names)
    return found


#: How a crash report names the one request of a call, when it has no id.
NO_ID = "request (no id)"


class Started:
    """A call as it begins, in the metrics (``with started:`` around the call): its
    requests leave the queue, the model has one more call and one more busy interpreter
    while it runs, and the call's request count is observed.  ``digest``: its one
    request's (multipy.serve.request.poison), which ``pin`` notes from the thread that runs it."""

    __slots__ = ("_series", "_places", "_began", "digest", "_requests")

    def __init__(self, series: ModelSeries, places: list[_Place],
                 requests: int | None = None) -> None:
        self._series, self._places = series, places
        self._began = 0
        self.digest = 0
        self._requests = len(places) if requests is None else requests

    def later(self) -> Started:
        """The next step of the same streamed answer: its interpreter busy again, but
        not one more call (its request's is counted)."""
        step = Started(self._series, self._places, 0)
        step.digest = self.digest
        return step

    @property
    def one(self) -> bool:
        """Whether the call answers one request (not a batch of several)."""
        return len(self._places) == 1

    def requests(self) -> str:
        """The requests the call answers, as a crash report names them (NO_ID itself for
        one request without an id)."""
        if len(self._places) == 1:
            place = self._places[0]
            return NO_ID if place.id is None else f"request {place.id!r}"
        names = [f"{place.id!r}" if place.id is not None else "(no id)"
                 for place in self._places]
        return f"a batch of {len(names)} requests: {', '.join(names)}"

    def __enter__(self) -> None:
        self._began = time.perf_counter_ns()
        for place in self._places:
            place.leave(self._began)
        self._series.call_began(self._requests)

    def __exit__(self, *exc_info: object) -> None:
        self._series.call_ended()
        took = time.perf_counter_ns() - self._began
        for place in self._places:
            place.timing.infer_ns += took

    def pin(self, running: bool) -> None:
        """Notes the call's digest in its row as it runs (running), or that it has
        ended: from the thread that runs it, so that a crash there is pinned on it."""
        if self.digest:
            self._series.running(self.digest if running else 0)


class _Place:
    """A request's place in its model's queue, which it leaves once, when its call
    starts (at ``now``, from time.perf_counter_ns, which timing records) or, failing
    that, when it is answered; id: the request's, if it has one."""

    __slots__ = ("_gauge", "request", "id", "timing", "_since")

    def __init__(self, gauge: Count, request: InferRequest, timing: Timing) -> None:
        gauge.inc()
        self._gauge = gauge
        self.request = request
        self.id = request.id
        self.timing = timing
        self._since = time.perf_counter_ns()

    def leave(self, now: int | None = None) -> None:
        if self._gauge is not None:
            self._gauge.dec()
            self._gauge = None
            if now is not None:
                self.timing.queue_ns = now - self._since
