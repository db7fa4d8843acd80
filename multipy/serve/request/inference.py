"""One inference request's way through a server, whatever carries it: the model it
names, its decoding, the model's call, its encoding, and its counts and timings in the
metrics.  The HTTP face (multipy.serve.http.app) and the gRPC face (multipy.serve.rpc.server) each
only translate their wire format to and from the protocol's records
(multipy.serve.request.protocol) around ``infer``, so that validation, turns, batching, metrics
and statistics are written once.

Every failure comes out as a ProtocolError whose status is an HTTP status (the gRPC
face turns it into a gRPC code): 400 a request the protocol refuses, 404 an unknown
model or version, 413 too large, 499 the client went away, 500 the model failed (it
raised, its outputs could not be split back into a batch's requests, or it ran past
--timeout) or multipy did, 503 the model is loading or no interpreter can take a call.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import traceback
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from .batching import BatchError
from .contract import Server
from .messages import TRACEBACK_LIMIT, InferRequest, ProtocolError, Tensor, bounded
from .repository import LOADING, UNAVAILABLE
from .metrics import Timing
from .requests import ModelError, ModelRequests, ServiceTimeout

logger = logging.getLogger("multipy.serve")

Answer = TypeVar("Answer")

#: The protocol's extensions this server speaks.
EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository", "generate"]
#: A request with more bytes than this to decode is decoded on a thread (``decode_apart``).
LARGE_REQUEST = 1 << 20


def server_metadata() -> dict[str, Any]:
    """The protocol's server metadata: name, version and extensions."""
    try:
        version = importlib.metadata.version("multipy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        version = "unknown"
    return {"name": "multipy", "version": version, "extensions": EXTENSIONS}


def statistics(service: Server, name: str | None, version: str | None) -> dict[str, Any]:
    """The statistics extension's answer for model name (and version) of service, or for
    every model when name is None: its counts and durations since the server started,
    from the same counters as /metrics (multipy.serve.request.metrics.Metrics.statistics).
    ProtocolError (404) for a model or version that service does not serve."""
    if name is None:
        return service.metrics.statistics(service.metrics.names)
    service.model(name, version)  # 404 if it serves no such model or version
    return service.metrics.statistics([name])


def ready_model(service: Server, name: str, version: str | None) -> ModelRequests:
    """The model name (and version) that service serves, ready; ProtocolError: 404 if it
    serves no such model, 503 while the model loads or when it is unloaded."""
    model = service.model(name, version)
    if model is None:
        state, reason = service.states.get(name, (LOADING, ""))
        if state == UNAVAILABLE:
            raise ProtocolError(f"model {name!r} is not loaded: {reason} (POST "
                                f"/v2/repository/models/{name}/load loads it)", 503)
        raise ProtocolError(f"model {name!r} is not ready: it is still loading "
                            f"(GET /v2/models/{name}/ready says when it is)", 503)
    return model


async def infer(service: Server, name: str, version: str | None,
                decode: Callable[[], Awaitable[InferRequest]],
                encode: Callable[[InferRequest, list[Tensor]], Answer],
                gone: Callable[[], Awaitable[None]] | None = None,
                status_of: Callable[[Answer], int] | None = None) -> Answer:
    """The answer to one inference request for model name of service (see
    multipy.serve.http.app.create_app for what a service has): ``decode()`` reads and decodes
    the request, the model answers it, and ``encode(request, outputs)`` makes the
    answer.  ``gone()``, if given, returns once the client has gone away (it is awaited
    once the request is decoded): the request is then cancelled, its call too.  The
    request is counted in the model's metrics and statistics, as an answer of status
    ``status_of(answer)`` if given (a LitAPI's own error answer), else 200; a model's or
    multipy's failure is logged.  ProtocolError for every failure (see the module's
    docstring)."""
    model = ready_model(service, name, version)
    series = service.metrics.models[model.name]
    series.requests.inc()
    began = time.perf_counter_ns()
    timing = Timing()
    status = 500
    try:
        request = await decode()
        decoded = time.perf_counter_ns()
        timing.input_ns = decoded - began
        work = model.infer(request, timing)
        outputs = await (_unless_gone(work, gone) if gone and model.cancellable else work)
        encoding = time.perf_counter_ns()
        answer = encode(request, outputs)
        timing.output_ns = time.perf_counter_ns() - encoding
        status = 200 if status_of is None else status_of(answer)
        return answer
    except ProtocolError as error:
        status = error.status
        raise
    except asyncio.CancelledError:  # the client went away (a gRPC deadline, say)
        status = 499
        raise
    except Exception as error:
        raise _failure(name, error) from None
    finally:
        series.answered(status, time.perf_counter_ns() - began, timing)


async def stream(service: Server, name: str, version: str | None,
                 decode: Callable[[], Awaitable[InferRequest]],
                 encode: Callable[[InferRequest, list[Tensor]], Answer],
                 status_of: Callable[[Answer], int] | None = None) -> AsyncIterator[Answer]:
    """The answer to one inference request for model name of service in pieces, as the
    model makes them (multipy.serve.request.requests.ModelRequests.stream; one piece for
    a model that does not stream): ``decode()`` reads and decodes the request, and
    ``encode(request, outputs)`` makes each piece's answer.  The request is counted in
    the model's metrics and statistics once, as its stream ends: at its end, 200 (or
    ``status_of(its first piece's answer)``, if given: a LitAPI's own error answer); an
    error's status; or 499 if it is closed before (its client went away: the model's
    stream is ended then); each piece counts once the face has taken it (sent it).
    ProtocolError for every failure, before a piece or between two."""
    model = ready_model(service, name, version)
    series = service.metrics.models[model.name]
    series.requests.inc()
    began = time.perf_counter_ns()
    timing = Timing()
    status, ended = 499, None  # (closed early, unless it ends otherwise)
    try:
        request = await decode()
        timing.input_ns = time.perf_counter_ns() - began
        async with contextlib.aclosing(model.stream(request, timing)) as pieces:
            async for outputs in pieces:
                encoding = time.perf_counter_ns()
                answer = encode(request, outputs)
                timing.output_ns += time.perf_counter_ns() - encoding
                if ended is None:
                    ended = 200 if status_of is None else status_of(answer)
                yield answer
                model.sent()
        status = 200 if ended is None else ended
    except ProtocolError as error:
        status = error.status
        raise
    except Exception as error:
        failure = _failure(name, error)
        status = failure.status
        raise failure from None
    finally:
        series.answered(status, time.perf_counter_ns() - began, timing)


def _failure(name: str, error: Exception) -> ProtocolError:
    """The ProtocolError (500) that error, raised while model name answered a request,
    is answered with, logged: a timeout's, a model's failure (with the model's
    traceback), or multipy's own (whole: called where it is handled)."""
    if isinstance(error, ServiceTimeout):
        logger.error("%s", error)
        return ProtocolError(str(error), 500)
    if isinstance(error, (ModelError, BatchError)):
        failure = ProtocolError(str(error), 500)  # (its message bounded)
        logger.error("%s%s", failure, bounded(_model_traceback(error), TRACEBACK_LIMIT))
        return failure
    logger.exception("inference on model %r failed", name)
    return ProtocolError(f"internal error: {type(error).__name__}: {error}", 500)


async def _unless_gone(work: Awaitable[Answer],
                       gone: Callable[[], Awaitable[None]]) -> Answer:
    """work's value; if ``gone()`` returns first (the client went away), work is
    cancelled and ProtocolError (499) raised once it has ended."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(gone())
    watching.add_done_callback(lambda _: working.cancel())
    try:
        return await working
    except asyncio.CancelledError:
        if watching.done() and not watching.cancelled():  # (not this task's own cancel)
            raise ProtocolError("the client went away", 499) from None
        raise
    finally:
        watching.cancel()


async def decode_apart(service: Server, size: int, decode: Callable[..., InferRequest],
                       *args: object) -> InferRequest:
    """decode(*args): the decoding of a request with size bytes to decode, in service.
    One of more than LARGE_REQUEST bytes is decoded on a thread, so that the event loop
    goes on answering other requests (the thread gives up the interpreter's GIL every
    few milliseconds while it runs Python, though not within one call of C, such as
    json.loads), and counts in service's metrics as busy meanwhile, so that the host
    hands new connections to other front ends (multipy.serve.host.front_ends.FrontEnds.hand)."""
    if size <= LARGE_REQUEST:
        return decode(*args)
    with service.metrics.decoding():
        return await asyncio.to_thread(decode, *args)


def _model_traceback(error: BaseException) -> str:
    """The model's frames behind error, as a paragraph to log: the traceback that its
    causes bring from inside an interpreter (multipy.errors.RemoteTraceback), or, in
    the interpreter that ran the model, its cause's own; "" if it has none."""
    cause = error.__cause__
    while cause is not None:
        text = getattr(cause, "traceback_text", None)
        if isinstance(text, str):
            return "\n" + text.rstrip("\n")
        cause = cause.__cause__
    cause = error.__cause__
    if cause is None or cause.__traceback__ is None:
        return ""
    return "\n" + "".join(traceback.format_exception(cause)).rstrip("\n")
