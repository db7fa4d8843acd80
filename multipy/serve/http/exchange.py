"""The two ends of an HTTP exchange that the endpoints of multipy.serve.http write
themselves, below Starlette: reading a request's body within a limit (``read_body``),
and sending a whole answer (``answer``), written at once where uvicorn serves the
connection.
"""
from __future__ import annotations

from typing import Callable, Mapping

from ..request.messages import ProtocolError
from .uvicorn_server import write_answer

#: the headers of a JSON answer, the one of them as ASGI gives it, and as its line
JSON = {"Content-Type": "application/json"}
_JSON_RAW = (b"content-type", b"application/json")
_JSON_HEAD = b"content-type: application/json\r\n"


async def answer(send: Callable, status: int, body: bytes, headers: Mapping[str, str]) -> None:
    """Sends an answer of status with body and headers (and its Content-Length), as a
    Starlette Response sends it: written at once where uvicorn serves the connection
    (multipy.serve.http.uvicorn_server.write_answer), else as the two ASGI messages."""
    raw = [_JSON_RAW] if headers == JSON else [
        (key.lower().encode("latin-1"), value.encode("latin-1")) for key, value in headers.items()]
    if write_answer(send, status, _JSON_HEAD if headers == JSON else
                    b"".join([b"%s: %s\r\n" % pair for pair in raw]), body):
        return
    raw.append((b"content-length", str(len(body)).encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Callable, declared: str | None, limit: int) -> bytes:
    """The body of the request that receive (ASGI's) reads, whose Content-Length header
    says declared; ProtocolError: 413 if it has more than limit bytes, said by its
    Content-Length before any is read, or as soon as what arrives passes it; 499 if the
    client goes away first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the request has {declared} bytes, more than the {limit} this "
                            f"server takes (--max-request-size)", 413)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # nobody to answer
            raise ProtocolError("the client went away", 499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"the request has more than the {limit} bytes this server "
                                f"takes (--max-request-size)", 413)
        if not message.get("more_body", False):
            return b"".join((*chunks, chunk)) if chunks else chunk  # (most: in one piece)
        chunks.append(chunk)
