"""The HTTP face of a server: the Open Inference Protocol's REST endpoints, Triton's
statistics extension and ``/metrics``, as a Starlette application, with inference
requests answered before it, as a plain ASGI application.  Inference requests go through
the path that every transport shares (multipy.serve.request.inference).

Every error answer is the protocol's ``{"error": "..."}``, with the status that
multipy.serve.request.inference gives it (404 also for an unknown route).  Each request is
answered on its own: a failed one changes nothing for the others.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from itertools import repeat
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..request import repository
from ..request.contract import Server
from ..request.inference import (decode_apart, infer as infer_through, ready_model,
                                 server_metadata, statistics)
from ..request.messages import (HEADER_LENGTH, InferRequest, ProtocolError, Tensor,
                                compress, error_body, json_object)
from ..request.restricted import HTTP_ROUTES, Restrictions
from .exchange import JSON, answer, departure, head_lines, read_body
from .generate import Generate
from .litserve import litserve_first
from .uvicorn_protocol import DirectExchange
from .uvicorn_server import LOGGING_CONFIG


def create_app(service: Server, on_startup: Callable[[], Any] | None = None) -> Callable:
    """The ASGI application serving service: the host's (multipy.serve.host.service.Service)
    or an interpreter's front end's (multipy._inside.front_end), each of which has
    ``ready``, ``model(name, version)`` (a multipy.serve.request.requests.ModelRequests, or None
    while it loads), ``metrics``, ``max_request_size`` and ``drain()``.  on_startup()
    runs when the server starts (the host starts loading the models there), and batches
    still waiting run at shutdown.  A Starlette application answers every request but
    inference requests, which go to the inference endpoint without it
    (``_InferenceFirst``), and LitServe's routes for the LitAPIs it serves
    (multipy.serve.http.litserve), answered before Starlette's.  A request to an
    endpoint of a category that ``service.http_restricted`` restricts is answered 403
    unless it carries the header that the category needs
    (multipy.serve.request.restricted)."""
    restrictions = Restrictions(service.http_restricted)
    endpoints = _Endpoints(service, on_startup)

    def route(path: str, endpoint: Callable, method: str) -> Route:
        return Route(path, _guarded(restrictions, path, endpoint), methods=[method])

    inference = _Inference(service)
    model_path = "/v2/models/{model}"
    version_path = "/v2/models/{model}/versions/{version}"
    routes = [
        # (under a root path: else _InferenceFirst answers these before Starlette)
        route(f"{model_path}/infer", inference, "POST"),
        route(f"{version_path}/infer", inference, "POST"),
        *(route(f"{path}/{kind}", Generate(service, streaming=kind == "generate_stream"),
                "POST") for path in (model_path, version_path)
          for kind in ("generate", "generate_stream")),
        route("/v2/health/live", endpoints.live, "GET"),
        route("/v2/health/ready", endpoints.ready, "GET"),
        route("/v2", endpoints.metadata, "GET"),
        route("/v2/models/stats", endpoints.model_statistics, "GET"),
        route(f"{model_path}/stats", endpoints.model_statistics, "GET"),
        route(f"{version_path}/stats", endpoints.model_statistics, "GET"),
        route(model_path, endpoints.model_metadata, "GET"),
        route(version_path, endpoints.model_metadata, "GET"),
        route(f"{model_path}/ready", endpoints.model_ready, "GET"),
        route(f"{version_path}/ready", endpoints.model_ready, "GET"),
        route("/v2/repository/index", endpoints.repository_index, "POST"),
        route("/v2/repository/models/{model}/load", endpoints.repository_load, "POST"),
        route("/v2/repository/models/{model}/unload", endpoints.repository_unload, "POST"),
        route("/metrics", endpoints.metrics, "GET"),
    ]
    # (the inference endpoints, each behind its restriction if any, by their last segment)
    direct = {route.path.rpartition("/")[2]: route.endpoint for route in routes
              if route.path.rpartition("/")[2] in _DIRECT}
    app = Starlette(routes=routes, exception_handlers={HTTPException: endpoints.http_error},
                    lifespan=endpoints.lifespan)
    return _InferenceFirst(direct, litserve_first(service, app),
                           inference if direct["infer"] is inference else None)


def _guarded(restrictions: Restrictions, path: str, endpoint: Callable) -> Callable:
    """The endpoint of route path, behind the restriction of its category, if it is
    restricted (a Starlette endpoint, or an ASGI application: the inference one)."""
    category = HTTP_ROUTES[path]
    header = restrictions.header(category)
    if header is None:
        return endpoint
    required = header.encode("latin-1")
    if not inspect.ismethod(endpoint):  # (the endpoints are _Endpoints's methods)
        return _Restricted(endpoint, restrictions, category, required)

    async def checked(request: Request) -> Response:
        refused = restrictions.refused(category, _header(request.scope, required))
        return _error(403, refused) if refused else await endpoint(request)

    return checked


class _Endpoints:
    """The endpoints of every route of service's but inference's (Starlette's), and the
    application's lifespan, which runs on_startup() as the server starts."""

    def __init__(self, service: Server, on_startup: Callable[[], Any] | None) -> None:
        self._service, self._on_startup = service, on_startup

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        if not self._service.ready:
            return Response(status_code=400)
        reason = self._service.metrics.all_stuck() or repository.not_ready(
            self._service.states, self._service.strict_readiness)
        return _error(400, reason) if reason else Response(status_code=200)

    async def metadata(self, request: Request) -> Response:
        return JSONResponse(server_metadata())

    async def model_metadata(self, request: Request) -> Response:
        try:
            model = ready_model(self._service, request.path_params["model"],
                                request.path_params.get("version"))
        except ProtocolError as error:
            return _error(error.status, str(error))
        return JSONResponse(model.metadata())

    async def model_statistics(self, request: Request) -> Response:
        try:
            found = statistics(self._service, request.path_params.get("model"),
                               request.path_params.get("version"))
        except ProtocolError as error:
            return _error(error.status, str(error))
        return JSONResponse(found)

    async def model_ready(self, request: Request) -> Response:
        try:
            model = self._service.model(request.path_params["model"],
                                  request.path_params.get("version"))
        except ProtocolError as error:
            return _error(error.status, str(error))
        if model is None or not model.ready or not await model.healthy():
            return Response(status_code=400)
        stuck = self._service.metrics.all_stuck()
        return _error(400, stuck) if stuck else Response(status_code=200)

    async def repository_index(self, request: Request) -> Response:
        try:
            body = await _json_body(request)
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise ProtocolError('"ready" must be true or false')
        except ProtocolError as error:
            return _error(error.status, str(error))
        return JSONResponse(repository.index(self._service.states, ready))

    async def repository_load(self, request: Request) -> Response:
        try:
            parameters = (await _json_body(request)).get("parameters") or {}
            if not isinstance(parameters, dict):
                raise ProtocolError('"parameters" must be a JSON object')
            await repository.load(self._service, request.path_params["model"], parameters)
        except ProtocolError as error:
            return _error(error.status, str(error))
        return Response(status_code=200)

    async def repository_unload(self, request: Request) -> Response:
        try:
            await _json_body(request)  # (its "parameters" say nothing to this server)
            await repository.unload(self._service, request.path_params["model"])
        except ProtocolError as error:
            return _error(error.status, str(error))
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        body, content_type = self._service.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        if error.status_code == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}")
        # with the headers the router gave (Allow, for a 405: HTTP requires it)
        return _error(error.status_code, f"{error.detail}: {request.method} {request.url.path}",
                      error.headers)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self._on_startup is not None:
            self._on_startup()
        yield
        await self._service.drain()


#: The last segment of the inference endpoints' paths: theirs are answered first.
_DIRECT = ("infer", "generate", "generate_stream")
#: The longest request target answered without ASGI (a longer one goes the ASGI way).
_DIRECT_TARGET = 1024


class _InferenceFirst:
    """app, but an inference request (POST to one of the paths of the protocol's
    inference endpoint, or of the generate extension's, with no root path) goes straight
    to its endpoint of direct (by its path's last segment), without Starlette's
    middleware, routing and request objects (and with uvicorn's own ``send``, whose
    connection a model's call watches: multipy._inside.hangups): what every other
    request, and every other method on those paths (405), meets is app's.

    ``direct(target)`` gives the connection's protocol (multipy.serve.http.
    uvicorn_protocol.guarded) the endpoint that answers an inference request without
    ASGI: inference's (unless it is restricted: then None) for the target of an
    inference path without a query or percent-encoding."""

    def __init__(self, direct: dict[str, Callable], app: Callable,
                 inference: _Inference | None) -> None:
        self._direct, self._app, self._inference = direct, app, inference
        # (remembered for the inference targets seen last: each is a partial of its own)
        self._endpoints = functools.lru_cache(maxsize=256)(self._endpoint)

    def direct(self, target: bytes) -> Callable | None:
        # (only targets that may be an inference path's, and short, are remembered: what
        # a client sends cannot fill the memory with others)
        if len(target) > _DIRECT_TARGET or not target.startswith(b"/v2/models/") \
                or not target.endswith(b"/infer"):
            return None
        return self._endpoints(target)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            found = _inference_params(scope["path"])
            if found is not None:
                scope["path_params"] = found[1]
                await self._direct[found[0]](scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _endpoint(self, target: bytes) -> Callable | None:
        if self._inference is None or not target.isascii() or b"?" in target \
                or b"%" in target or b"#" in target:
            return None
        found = _inference_params(target.decode("ascii"))
        if found is None or found[0] != "infer":
            return None
        params = found[1]
        return functools.partial(self._inference.direct, params["model"],
                                 params.get("version"))


@functools.lru_cache(maxsize=256)
def _inference_params(path: str) -> tuple[str, dict[str, str]] | None:
    """The endpoint (_DIRECT's) and path parameters of an inference path, as Starlette's
    routes give them (/v2/models/{model}/E and /v2/models/{model}/versions/{version}/E,
    each parameter one segment or more, of no "/"), or None for another path.
    (Remembered for the paths seen last: the dict is shared by their requests, which
    only read it.)"""
    head, _, endpoint = path.rpartition("/")
    if endpoint not in _DIRECT or not head.startswith("/v2/models/"):
        return None
    parts = head[len("/v2/models/"):].split("/")
    if len(parts) == 1 and parts[0]:
        return endpoint, {"model": parts[0]}
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return endpoint, {"model": parts[0], "version": parts[2]}
    return None


class _Inference:
    """The inference endpoint of service, a plain ASGI application (its request's
    ``path_params`` name the model and version): it reads the headers it needs from one
    dict of them and writes its answer itself.  The protocol's decoding and encoding
    (multipy.serve.request.protocol, and numpy with it) are imported when it first decodes a
    request: the host, which decodes one only when it serves a model itself (rare: see
    multipy.serve.main), need not import them."""

    def __init__(self, service: Server) -> None:
        self._service = service
        self._codec: tuple[Callable, Callable] | None = None  # (imported at the first decode)

    def _imported(self) -> tuple[Callable, Callable]:
        """(decode_request, encode_response) of multipy.serve.request.protocol, imported now."""
        from ..request.protocol import decode_request, encode_response  # (numpy: see the class)

        self._codec = decode_request, encode_response
        return self._codec

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        params = scope["path_params"]
        status, body, headers = await self._answer(
            params["model"], params.get("version"), scope["headers"],
            functools.partial(read_body, receive), departure(receive), send)
        await answer(send, status, body, headers)

    async def direct(self, name: str, version: str | None, exchange: DirectExchange) -> None:
        """Answers exchange, a request for model name (and version) that the connection's
        protocol gives without ASGI (multipy.serve.http.uvicorn_protocol.DirectExchange),
        as ``__call__`` answers one."""
        status, body, headers = await self._answer(name, version, exchange.headers,
                                                   exchange.body, exchange.gone,
                                                   exchange.answer)
        await exchange.answer(status, head_lines(headers), body)

    async def _answer(self, name: str, version: str | None, headers: list,
                      read: Callable[[str | None, int], Awaitable[bytes]],
                      gone: Callable[[], Awaitable[None]],
                      connection: Callable) -> tuple[int, bytes, Mapping[str, str]]:
        """(status, body, headers) of the answer to a request for model name (and
        version) with headers (ASGI's), whose body ``read(declared, limit)`` reads (as
        multipy.serve.http.exchange.read_body), whose client has gone once ``gone()``
        returns, that connection (a ``send``) answers."""
        service = self._service
        named = dict(reversed(headers)).get  # (the first of a name, as Starlette's)
        # (most requests have a Content-Length, some an Accept-Encoding, few the others)
        length, encoding, header_length, accepted = (
            named(b"content-length"), named(b"content-encoding"), named(_HEADER_LENGTH),
            named(b"accept-encoding"))
        if length is not None:
            length = length.decode("latin-1")
        if accepted is not None:
            accepted = accepted.decode("latin-1")
        if encoding is not None:
            encoding = encoding.decode("latin-1")
        if header_length is not None:
            header_length = header_length.decode("latin-1")

        async def decode() -> InferRequest:
            limit = service.max_request_size
            body = await read(length, limit)
            # (a compressed body may expand to the limit)
            decoded = await decode_apart(service, limit if encoding else len(body),
                                         (self._codec or self._imported())[0], body,
                                         header_length, encoding, limit)
            decoded.connection = connection  # (its call watches it: multipy._inside.hangups)
            return decoded

        def encode(decoded: InferRequest, outputs: list[Tensor]) -> tuple[bytes, dict]:
            if decoded.outputs is None:  # each output as the request's parameters say
                chosen = zip(outputs, repeat(decoded.binary_outputs))
            else:
                binary = dict(decoded.outputs)
                chosen = [(t, binary.get(t.name, decoded.binary_outputs)) for t in outputs]
            body, answer_headers = self._codec[1](  # (imported: decoded first)
                name, "1", decoded.id, chosen)
            return compress(body, answer_headers, accepted), answer_headers

        try:
            body, answer_headers = await infer_through(service, name, version, decode, encode,
                                                       gone)
        except ProtocolError as error:
            if error.status == 499:
                return 499, b"", {}
            return error.status, error_body(str(error)), JSON
        return 200, body, answer_headers


class _Restricted:
    """An ASGI application: app's answer to a request that carries the header (in lower
    case, as ASGI names headers) that category's restriction requires, else 403."""

    def __init__(self, app: Callable, restrictions: Restrictions, category: str,
                 header: bytes) -> None:
        self._app, self._restrictions = app, restrictions
        self._category, self._header = category, header

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        refused = self._restrictions.refused(self._category, _header(scope, self._header))
        if refused:
            await answer(send, 403, error_body(refused), JSON)
            return
        await self._app(scope, receive, send)


def _header(scope: dict, name: bytes) -> bytes | None:
    """The value of the request's first header called name (in lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


#: the request header that says where a body's JSON ends, as uvicorn names it (in lower
#: case, as every name it gives)
_HEADER_LENGTH = HEADER_LENGTH.lower().encode()


async def _json_body(request: Request) -> dict:
    """The request's body as a JSON object ({} if it is empty); ProtocolError if it is
    not one, or has more than the 64 KiB that such a request may have."""
    body = await read_body(request.receive, request.headers.get("content-length"), 1 << 16)
    return json_object(body) if body.strip() else {}


def logging_config(server_lines: bool = True) -> dict:
    """uvicorn's logging, with multipy.serve's lines formatted as uvicorn's own; without
    server_lines, only the warnings and errors of uvicorn's server (an interpreter's
    front end: the host says once what the server does)."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["multipy.serve"] = {"handlers": ["default"], "level": "INFO",
                                          "propagate": False}
    if not server_lines:
        config["loggers"]["uvicorn.error"]["level"] = "WARNING"
    return config


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(error_body(message), status_code=status, headers=headers,
                    media_type="application/json")
