"""Triton's generate extension over HTTP: ``POST /v2/models/NAME[/versions/V]/generate``
answers one JSON object, and ``.../generate_stream`` answers Server-Sent Events
(``text/event-stream``), one ``data: {...}`` event per piece of the model's answer, each
written as the model makes it (multipy.serve.request.inference.stream).  The request and
answer objects are multipy.serve.request.generate's.

An error before the first piece is an error answer as every endpoint's (``{"error":
...}`` with its status); one after it, an event ``data: {"error": "..."}`` that ends
the stream.  A client that goes away mid-stream ends the model's stream at its next
step (during a step, the front end's watch of the connection cancels it): its
``finally`` runs, and the request counts as 499.
"""
from __future__ import annotations

import contextlib
import json
from typing import Callable

from ..request.contract import Server
from ..request.inference import decode_apart, infer, ready_model, stream
from ..request.messages import InferRequest, ProtocolError, Tensor, error_body
from .exchange import JSON, answer, departure, read_body, send_pieces

#: the headers of an event stream's answer, as ASGI takes them
_EVENTS = [(b"content-type", b"text/event-stream; charset=utf-8"),
           (b"cache-control", b"no-cache")]


class Generate:
    """The generate endpoint (streaming: generate_stream's) of service, an ASGI
    application whose request's ``path_params`` name the model and version."""

    def __init__(self, service: Server, streaming: bool) -> None:
        self._service, self._streaming = service, streaming

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        service = self._service
        params = scope["path_params"]
        name, version = params["model"], params.get("version")
        length = dict(scope["headers"]).get(b"content-length")

        async def decode() -> InferRequest:
            # (numpy with it: imported once a model answers here, as the protocol's
            # decoding is, not by the host of front ends that answer)
            from ..request.generate import generate_request

            limit = service.max_request_size
            body = await read_body(receive, length and length.decode("latin-1"), limit)
            described = ready_model(service, name, version).described or {}
            decoded = await decode_apart(service, len(body), generate_request, body,
                                         described.get("inputs"))
            decoded.connection = send  # (a step's call watches it: multipy._inside.hangups)
            return decoded

        def encode(decoded: InferRequest, outputs: list[Tensor]) -> bytes:
            from ..request.generate import generate_answer  # (imported: decoded first)

            answered = generate_answer(name, decoded.id, outputs)
            return _event(answered) if self._streaming else answered

        gone = departure(receive)
        try:
            if not self._streaming:  # (ModelRequests.infer: a stream's one piece)
                await answer(send, 200, await infer(service, name, version, decode, encode,
                                                    gone), JSON)
                return
            pieces = stream(service, name, version, decode, encode)
            async with contextlib.aclosing(pieces):
                first = await anext(pieces, None)
                await send({"type": "http.response.start", "status": 200, "headers": _EVENTS})
                await send_pieces(send, first, pieces, gone, _error_event)
        except ProtocolError as error:  # (before the answer began)
            if error.status != 499:  # (no one to answer)
                await answer(send, error.status, error_body(str(error)), JSON)


def _event(data: bytes) -> bytes:
    """An event whose data is data (JSON: one line)."""
    return b"data: " + data + b"\n\n"


def _error_event(error: ProtocolError) -> bytes | None:
    """The event that ends a stream with error (none for a client gone)."""
    return None if error.status == 499 else _event(json.dumps({"error": str(error)}).encode())
