"""LitServe's HTTP routes, beside the Open Inference Protocol's, for the
``litserve.LitAPI`` models a server serves (multipy._inside.served_litserve): ``POST``
to each API's path (``/predict`` by default), ``GET /health`` and ``GET /info``, answered
as LitServe 0.2's server answers them.

A LitServe request takes the path every inference request takes
(multipy.serve.request.inference), as multipy.serve.request.litserve carries it; its
answer is the API's JSON with the status the API gave (200, or its HTTPException's,
with ``{"detail": ...}``); an API with ``stream=True`` answers in pieces, each encoded
response's line sent as it is made.  multipy's own refusals keep their status with the message as
the detail; a model's failure is 500 ``{"detail": "Internal server error"}``, as in
LitServe, its exception and traceback in the log.  ``/health`` is 200 ``ok`` once the
server is ready and every model's ``health()`` (a LitAPI's; a kserve.Model's
``healthy()``) is true, else 503 ``not ready``; ``/info`` names each API's path.  The
routes fall under the restricted APIs' categories (health, metadata, inference).
"""
from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, Callable

from starlette.responses import JSONResponse, Response

from ..request import repository
from ..request.contract import Server
from ..request.inference import infer, stream
from ..request.litserve import API_PATH, REQUEST, answer
from ..request.messages import InferRequest, ProtocolError, Tensor
from ..request.restricted import HEALTH, INFERENCE, METADATA, Restrictions
from .exchange import departure, read_body, send_pieces

#: What LitServe answers for a model's failure.
_FAILED = "Internal server error"


def litserve_first(service: Server, app: Callable) -> Callable:
    """The ASGI application app, but LitServe's routes (see the module's docstring) are
    answered first, for service's models; a path that no LitAPI has, and every other
    request, goes to app."""
    restrictions = Restrictions(service.http_restricted)

    async def dispatch(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            method, path = scope["method"], scope["path"]
            apis = _apis(service) if method == "POST" or path == "/info" else {}
            route = (HEALTH, health) if (method, path) == ("GET", "/health") else \
                (METADATA, info) if (method, path) == ("GET", "/info") and apis else \
                (INFERENCE, predict) if method == "POST" and path in apis else \
                (INFERENCE, loading) if method == "POST" and not path.startswith("/v2/") \
                and _loading(service) else None
            if route is not None:
                category, endpoint = route
                refused = restrictions.header(category) and restrictions.refused(
                    category, _header(scope, restrictions.header(category)))
                response = _detail(403, refused) if refused else await endpoint(
                    scope, receive, send, apis)
                if response is not None:  # (None: answered, in pieces)
                    await response(scope, receive, send)
                return
        await app(scope, receive, send)

    async def health(scope: dict, receive: Callable, send: Callable,
                     apis: dict[str, str]) -> Response:
        ready = service.ready and not service.metrics.all_stuck() and not \
            repository.not_ready(service.states, service.strict_readiness)
        for name in list(service.states) if ready else ():
            model = service.model(name)
            if model is not None and not await model.healthy():
                ready = False
                break
        return Response("ok") if ready else Response("not ready", 503)

    async def info(scope: dict, receive: Callable, send: Callable,
                   apis: dict[str, str]) -> Response:
        streams = {path: getattr(service.model(name), "streams", False)
                   for path, name in apis.items()}
        return JSONResponse({"model": None, "server": {
            "stream": streams, "models": apis,
            "max_payload_size": service.max_request_size}})

    async def loading(scope: dict, receive: Callable, send: Callable,
                      apis: dict[str, str]) -> Response:  # (its path may be a LitAPI's)
        return _detail(503, "the server's models are still loading (GET /health says "
                            "when it is ready)")

    async def predict(scope: dict, receive: Callable, send: Callable,
                      apis: dict[str, str]) -> Response | None:
        length = _header(scope, "content-length")
        name = apis[scope["path"]]

        async def decode() -> InferRequest:
            import numpy  # (as the protocol's decoding: once a model serves here)

            body = await read_body(receive, length and length.decode("latin-1"),
                                   service.max_request_size)
            rows = numpy.empty(1, dtype=object)
            rows[0] = body
            request = InferRequest([Tensor(REQUEST, "BYTES", rows)], None)
            request.connection = send  # (its call watches it: multipy._inside.hangups)
            return request

        try:
            if getattr(service.model(name), "streams", False):
                return await _streamed(stream(service, name, None, decode,
                                              lambda _, outputs: answer(outputs),
                                              status_of=lambda answered: answered[0]),
                                       receive, send)
            status, body = await infer(service, name, None, decode,
                                       lambda _, outputs: answer(outputs),
                                       status_of=lambda answered: answered[0])
        except ProtocolError as error:
            if error.status == 499:
                return Response(b"", 499)
            return _detail(error.status, _FAILED if error.status == 500 else str(error))
        return Response(body, status, media_type="application/json")

    return dispatch


async def _streamed(pieces: AsyncIterator[tuple[int, bytes]], receive: Callable,
                    send: Callable) -> Response | None:
    """The answer of a LitAPI that streams (stream=True): its first piece's, if that is
    an error answer; else sent here, each piece's body as it comes (None).  An error
    after the first piece ends the answer, as LitServe's server does."""
    async with contextlib.aclosing(pieces):
        first = await anext(pieces, None)
        if first is None or first[0] != 200:
            status, body = first or (200, b"")
            await anext(pieces, None)  # (its end: the answer is counted with its status)
            return Response(body, status, media_type="application/json")
        bodies = (body async for _, body in pieces)
        async with contextlib.aclosing(bodies):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send_pieces(send, first[1], bodies, departure(receive),
                              lambda _: None)
    return None


def _apis(service: Server) -> dict[str, str]:
    """The path of each LitAPI that service serves now -> the model's name."""
    found = {}
    for name in list(service.states):
        model = service.model(name)
        described = None if model is None else model.described
        if described and described.get(API_PATH):
            found[described[API_PATH]] = name
    return found


def _loading(service: Server) -> bool:
    """Whether some model of service is still loading (its path, if it is a LitAPI, not
    known yet)."""
    return any(state == repository.LOADING for state, _ in list(service.states.values()))


def _header(scope: dict, name: str) -> bytes | None:
    """The value of the request's first header called name (in lower case), or None."""
    wanted = name.encode("latin-1")
    return next((value for key, value in scope["headers"] if key == wanted), None)


def _detail(status: int, detail: str) -> Response:
    """LitServe's (FastAPI's) error answer: ``{"detail": detail}``."""
    return Response(json.dumps({"detail": detail}, separators=(",", ":")), status,
                    media_type="application/json")
