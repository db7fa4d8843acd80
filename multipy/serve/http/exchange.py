"""The two ends of an HTTP exchange that the endpoints of multipy.serve.http write
themselves, below Starlette: reading a request's body within a limit (``read_body``, and
its errors, which a request answered without ASGI shares: multipy.serve.http.
uvicorn_protocol.DirectExchange), sending a whole answer (``answer``; ``head_lines``),
written at once where uvicorn serves the connection, and sending one in pieces as they
are made (``send_pieces``).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Mapping

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
    raw = [_JSON_RAW] if headers == JSON else _raw(headers)
    if write_answer(send, status, _JSON_HEAD if headers == JSON else _lines(raw), body):
        return
    raw.append((b"content-length", str(len(body)).encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def check_declared(declared: str | None, limit: int) -> None:
    """ProtocolError (413) if declared, a request's Content-Length, says more than limit
    bytes."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the request has {declared} bytes, more than the {limit} this "
                            f"server takes (--max-request-size)", 413)


def too_large(limit: int) -> ProtocolError:
    """The error (413) of a request whose body has come past limit bytes."""
    return ProtocolError(f"the request has more than the {limit} bytes this server takes "
                         f"(--max-request-size)", 413)


def gone_away() -> ProtocolError:
    """The error (499) of a request whose client went away before it was answered."""
    return ProtocolError("the client went away", 499)


def head_lines(headers: Mapping[str, str]) -> bytes:
    """The header lines of headers (an answer's, but its Content-Length), each ending in
    CRLF, as ``answer`` writes them."""
    return _JSON_HEAD if headers == JSON else _lines(_raw(headers))


def _raw(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """headers as ASGI gives them: names in lower case, names and values in bytes."""
    return [(key.lower().encode("latin-1"), value.encode("latin-1"))
            for key, value in headers.items()]


def _lines(raw: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join([b"%s: %s\r\n" % pair for pair in raw])


async def read_body(receive: Callable, declared: str | None, limit: int) -> bytes:
    """The body of the request that receive (ASGI's) reads, whose Content-Length header
    says declared; ProtocolError: 413 if it has more than limit bytes, said by its
    Content-Length before any is read, or as soon as what arrives passes it; 499 if the
    client goes away first."""
    check_declared(declared, limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":  # nobody to answer
            raise gone_away()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        if not message.get("more_body", False):
            return b"".join((*chunks, chunk)) if chunks else chunk  # (most: in one piece)
        chunks.append(chunk)


def departure(receive: Callable) -> Callable[[], Awaitable[None]]:
    """``gone()`` for the request that receive (ASGI's) reads, once its body is read: it
    returns when the client has gone away (only the disconnect comes then)."""
    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return gone


async def send_pieces(send: Callable, first: bytes | None, pieces: AsyncIterator[bytes],
                      gone: Callable[[], Awaitable[None]],
                      failed: Callable[[ProtocolError], bytes | None]) -> None:
    """Sends first (if not None) and each of pieces, as it comes, as the body of an
    answer begun (its start sent), then ends it; a ProtocolError between pieces ends it
    with failed(error)'s last piece, if that gives one.  Once ``gone()`` returns (its
    client has gone: uvicorn's send then writes nothing, silently), the wait for the
    next piece is cancelled: the caller closes pieces."""
    task = asyncio.current_task()
    went = False

    def going(_: object) -> None:
        nonlocal went
        went = True
        task.cancel()

    watching = asyncio.ensure_future(gone())
    watching.add_done_callback(going)
    try:
        if first is not None:
            await send(_piece(first))
        try:
            async for piece in pieces:
                await send(_piece(piece))
        except ProtocolError as error:
            last = failed(error)
            if last is not None:
                await send(_piece(last))
        await send({"type": "http.response.body", "body": b""})
    except asyncio.CancelledError:
        if not went:
            raise
        if hasattr(task, "uncancel") and task.uncancel() > 0:  # (3.11: this cancel is
            raise  # handled; another, as the server stops, is not)
    finally:
        watching.remove_done_callback(going)
        watching.cancel()


def _piece(body: bytes) -> dict:
    """The ASGI message of one piece of an answer's body, more to come."""
    return {"type": "http.response.body", "body": body, "more_body": True}
