"""The HTTP face of a server: the Open Inference Protocol's REST endpoints and
``/metrics``, as a Starlette application.

Every error answer is the protocol's ``{"error": "..."}``: 400 for a request the
protocol refuses, 404 for an unknown model, version or route, 503 while a model loads,
500 when the model fails (it raised, its outputs could not be split back into a batch's
requests, or it ran past --timeout).  Each request is answered on its own: a failed one
changes nothing for the others.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import time
import traceback
from typing import Any, AsyncIterator, Callable, Mapping

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .batching import BatchError
from .metrics import CONTENT_TYPE
from .protocol import (HEADER_LENGTH, ProtocolError, compress, decode_request, encode_response,
                       error_body)
from .requests import ModelError, ServiceTimeout

logger = logging.getLogger("multipy.serve")

#: The protocol's extensions this server speaks.
EXTENSIONS = ["binary_tensor_data"]


def create_app(service: Any, on_startup: Callable[[], Any] | None = None) -> Starlette:
    """The application serving service: the host's (multipy.serve.service.Service) or an
    interpreter's front end's (multipy._inside.front_end), each of which has ``ready``,
    ``model(name, version)`` (a multipy.serve.requests.ModelRequests, or None while it
    loads), ``metrics``, ``max_request_size`` and ``drain()``.  on_startup() runs when
    the server starts (the host starts loading the models there), and batches still
    waiting run at shutdown."""

    async def live(request: Request) -> Response:
        return Response(status_code=200)

    async def ready(request: Request) -> Response:
        if not service.ready:
            return Response(status_code=400)
        stuck = service.metrics.all_stuck()
        return _error(400, stuck) if stuck else Response(status_code=200)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "multipy", "version": _version(),
                             "extensions": EXTENSIONS})

    async def model_metadata(request: Request) -> Response:
        try:
            model = _model(service, request)
        except ProtocolError as error:
            return _error(error.status, str(error))
        return JSONResponse(model.metadata())

    async def model_ready(request: Request) -> Response:
        try:
            model = service.model(request.path_params["model"],
                                  request.path_params.get("version"))
        except ProtocolError as error:
            return _error(error.status, str(error))
        if model is None or not model.ready:
            return Response(status_code=400)
        stuck = service.metrics.all_stuck()
        return _error(400, stuck) if stuck else Response(status_code=200)

    async def infer(request: Request) -> Response:
        try:
            model = _model(service, request)
        except ProtocolError as error:
            return _error(error.status, str(error))
        name = model.name
        series = service.metrics.models[name]
        series.requests.inc()
        started = time.perf_counter()
        status = 500
        try:
            limit = service.max_request_size
            decoded = decode_request(await _body(request, limit),
                                     request.headers.get(HEADER_LENGTH),
                                     request.headers.get("content-encoding"), limit)
            outputs = await model.infer(decoded)
            binary = dict(decoded.outputs or ())
            body, headers = encode_response(
                name, "1", decoded.id,
                [(t, binary.get(t.name, decoded.binary_outputs)) for t in outputs])
            body = compress(body, headers, request.headers.get("accept-encoding"))
            status = 200
            return Response(body, headers=headers)
        except ProtocolError as error:
            status = error.status
            return _error(status, str(error))
        except ServiceTimeout as error:
            logger.error("%s", error)
            return _error(500, str(error))
        except (ModelError, BatchError) as error:  # logged with the model's traceback
            logger.error("%s%s", error, _model_traceback(error))
            return _error(500, str(error))
        except ClientDisconnect:  # nobody to answer
            status = 499
            return Response(status_code=499)
        except Exception as error:  # multipy's own failure: logged whole
            logger.exception("inference on model %r failed", name)
            return _error(500, f"internal error: {type(error).__name__}: {error}")
        finally:
            series.latency.observe(time.perf_counter() - started)
            if status != 200:
                series.failed(status)

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        if error.status_code == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}")
        # with the headers the router gave (Allow, for a 405: HTTP requires it)
        return _error(error.status_code, f"{error.detail}: {request.method} {request.url.path}",
                      error.headers)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()
        yield
        await service.drain()

    model_path = "/v2/models/{model}"
    version_path = "/v2/models/{model}/versions/{version}"
    routes = [
        Route(f"{model_path}/infer", infer, methods=["POST"]),  # first: the busy one
        Route(f"{version_path}/infer", infer, methods=["POST"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2", server_metadata, methods=["GET"]),
        Route(model_path, model_metadata, methods=["GET"]),
        Route(version_path, model_metadata, methods=["GET"]),
        Route(f"{model_path}/ready", model_ready, methods=["GET"]),
        Route(f"{version_path}/ready", model_ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                     lifespan=lifespan)


def _model(service: Any, request: Request) -> Any:
    """The ready model a request names; ProtocolError (404 unknown, 503 loading, or no
    interpreter can take a call)."""
    name = request.path_params["model"]
    model = service.model(name, request.path_params.get("version"))
    if model is None:
        raise ProtocolError(f"model {name!r} is not ready: it is still loading "
                            f"(GET /v2/models/{name}/ready says when it is)", 503)
    return model


async def _body(request: Request, limit: int) -> bytes:
    """The request's body; ProtocolError (413) if it has more than limit bytes: said by
    its Content-Length before any is read, or as soon as what arrives passes it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the request has {declared} bytes, more than the {limit} this "
                            f"server takes (--max-request-size)", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"the request has more than the {limit} bytes this server "
                                f"takes (--max-request-size)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


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


def logging_config(server_lines: bool = True) -> dict:
    """uvicorn's logging, with multipy.serve's lines formatted as uvicorn's own; without
    server_lines, only the warnings and errors of uvicorn's server (an interpreter's
    front end: the host says once what the server does)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["multipy.serve"] = {"handlers": ["default"], "level": "INFO",
                                          "propagate": False}
    if not server_lines:
        config["loggers"]["uvicorn.error"]["level"] = "WARNING"
    return config


def _version() -> str:
    try:
        return importlib.metadata.version("multipy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(error_body(message), status_code=status, headers=headers,
                    media_type="application/json")
