"""The Open Inference Protocol's requests and errors, as every layer of ``multipy
serve`` passes them (multipy.serve.request.protocol decodes and encodes them): with no numpy, so
that the host, which decodes no request before its models are ready, need not import
it.  Also what a body needs besides its tensors: its JSON object, its compression, the
error answer.
"""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

try:  # (the serve extra's, where it has a wheel; json reads requests otherwise)
    from orjson import loads as _orjson_loads
except ImportError:  # (CPython 3.15: no orjson wheel yet)
    _orjson_loads = None

if TYPE_CHECKING:
    import numpy as np

#: The header that says where the JSON of a body with binary data ends.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: The most bytes a request may have, by default (multipy serve --max-request-size), or
#: a compressed one expand to: 413 past it.
MAX_REQUEST_SIZE = 64 << 20
#: The first bytes of JSON's byte order marks: text that begins with none of them, and
#: has no NUL in its first four bytes, is UTF-8 (as json.detect_encoding says)
_NOT_UTF8 = (b"\xef", b"\xfe", b"\xff")
#: What json.loads reads a str with, when given no options, and its scanner (C's, where
#: json has its C part), which reads one JSON value from a given index
_DECODER = json.JSONDecoder()
_SCAN = _DECODER.scan_once
#: The most characters of a message that an error answer or a log line carries (a
#: model's exception's, say): the rest is cut, with a note of how much (``bounded``).
MESSAGE_LIMIT = 4096
#: ... and of a traceback in the log.
TRACEBACK_LIMIT = 64 << 10


def _loads(document: str) -> Any:
    """json.loads(document): the scanner's value of a document that is one JSON value
    and nothing else, as clients send it; for any other (whitespace around it, or not
    one JSON value) json.loads's own reading, or its error (JSONDecodeError;
    RecursionError for one nested deeper than the stack)."""
    try:
        found, end = _SCAN(document, 0)
    except (StopIteration, ValueError):  # (where, said by json.loads below)
        end = -1
    if end != len(document):
        return _DECODER.decode(document)
    return found


def bounded(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """text, or its first limit characters and a note of how many more were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"


#: Every status other than 200 that ``multipy serve`` answers a request with over HTTP,
#: and when (a gRPC call's code is its status's: multipy.serve.rpc.server.CODES).  The
#: documentation's table of errors is made from it, and a test fails where the code
#: answers a status that it does not name.  Markdown.
ANSWERS: dict[int, str] = {
    400: "malformed JSON; not an inference request; unknown datatype, or one that is not "
         "a string; values that do not fit the datatype (BYTES: strings that are not "
         "Unicode text); a shape that does not match the data (or `binary_data_size`), or "
         "past the limits; binary data that no input claims or that is missing; BYTES "
         "binary data whose lengths do not match it (an element or its length cut short "
         "by `binary_data_size`, or more or fewer elements than the shape); an output the "
         "model does not give, or one asked for twice; a model's own refusal "
         "(`InvalidInput`, or a Triton model's `INVALID_ARG`, `UNKNOWN`, "
         "`ALREADY_EXISTS` or `CANCELLED`); a model repository request the server does "
         "not take (`--model-control none`, a bad name or parameter); a request that "
         "the server cannot parse as HTTP/1.1; `GET /v2/health/ready` while the server "
         "is not ready",
    403: "an endpoint of an API that `--http-restricted-api` restricts, without its "
         "header and value",
    404: "unknown model, version or route; a model repository load of an archive that "
         "the repository does not have; a Triton model's `NOT_FOUND`",
    405: "a method that the route does not take (the answer's `Allow` header names "
         "those it does)",
    408: "a request that did not arrive whole within `--read-timeout` of its first byte",
    413: "a body, or a compressed body expanded, of more than `--max-request-size` bytes "
         "(64 MiB)",
    422: "(LitServe APIs) a body that the API's pydantic request model refuses",
    431: "a request's head of more than `--max-header-size` bytes, or with more than "
         "`--max-headers` header fields",
    499: "never sent: the client went away (closed its connection; a gRPC deadline "
         "passed, or the call was cancelled); its call is cancelled, and the metrics "
         "count the request under this status",
    500: "the model raised, any `BaseException` included (`SystemExit`, "
         "`KeyboardInterrupt`, `GeneratorExit`): the answer names the exception and its "
         "message, cut at 4,096 characters; the log has its traceback from inside the "
         "interpreter; a batch's outputs cannot be split; a model that crashed its "
         "process on an identical request within the hour; no answer within `--timeout`; "
         "a model's load that failed",
    501: "a `Transfer-Encoding` other than `chunked` alone; a Triton model's "
         "`UNSUPPORTED`",
    503: "the model is still loading, or was unloaded; every interpreter that could take "
         "the call still runs one that its request gave up on; the server is starting or "
         "stopping, or too many model repository requests wait",
}

class ProtocolError(Exception):
    """A request that the protocol refuses: answered with {"error": message} and status
    (400, the client's fault, unless said otherwise); message bounded (``bounded``).
    code: the gRPC status's name where it is not the one of status (a model's own)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(bounded(message))
        self.status = status
        self.code = code


class InvalidInput(ProtocolError):
    """Raised by a model's own code for a request it cannot take: answered with status
    400 and the message (``from multipy.serve import InvalidInput``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


class Tensor(NamedTuple):
    """A named tensor of the protocol: its datatype and its data as an array of its shape
    (a tuple: ``zip(*tensors)`` gives their names, datatypes and arrays)."""

    name: str
    datatype: str
    array: np.ndarray


class Answer(NamedTuple):
    """One request's answer, from a model inside that answers each request of a call on
    its own (multipy._inside.served_triton): its outputs' names and datatypes (their
    arrays follow the call's answers, in order), or its error (status: the HTTP status,
    not 0; code: the gRPC status's name; message).  It crosses from the interpreter as a
    plain tuple (``tuple(answer)``), which the call's fast paths carry as they are, and
    is read back with ``Answer._make``."""

    names: tuple[str, ...] = ()
    datatypes: tuple[str, ...] = ()
    status: int = 0
    code: str = ""
    message: str = ""


@dataclass
class InferRequest:
    """A decoded inference request."""

    inputs: list[Tensor]
    #: The outputs asked for, in order, each with whether it goes back as binary data;
    #: None: every output the model gives.
    outputs: list[tuple[str, bool]] | None
    #: Whether outputs not asked for by name go back as binary data.
    binary_outputs: bool = False
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Where its client is, for a call that holds its event loop to watch
    #: (multipy._inside.hangups): what gives the connection it came on (the HTTP face's
    #: ``send``: multipy.serve.http.uvicorn_server.connection_of), and the time
    #: (time.monotonic) past which its client waits no more (a gRPC deadline).
    connection: Callable | None = None
    deadline: float | None = None


def json_object(text: bytes) -> dict:
    """The JSON object that text holds; ProtocolError if it is not well-formed JSON, or
    not an object.  orjson reads it, where it is installed (a request of 30 floats at a
    seventh of json's cost), and json where orjson refuses what json reads (NaN and
    Infinity, a lone surrogate, UTF-16 or UTF-32, a number past a double's range,
    nesting deeper than 1,024): the value is json's, but for an integer literal past 64
    bits (below -2**63 or over 2**64 - 1) within a double's range, which orjson reads as
    the nearest double."""
    if _orjson_loads is not None:
        try:
            found = _orjson_loads(text)
        except ValueError:  # (orjson.JSONDecodeError: json's reading below decides)
            found = _json_loads(text)
    else:
        found = _json_loads(text)
    if not isinstance(found, dict):
        raise ProtocolError("the request must be a JSON object")
    return found


def _json_loads(text: bytes) -> Any:
    """json.loads(text); ProtocolError if it is not well-formed JSON."""
    head = text[:4]
    try:  # (UTF-8, as json.loads finds it, decoded here without its search)
        return _loads(text.decode("utf-8", "surrogatepass")) \
            if 0 not in head and head[:1] not in _NOT_UTF8 else json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError,
        # an integer literal over Python's digit limit, nesting deeper than the stack
        raise ProtocolError(f"malformed JSON in the request: {error}") from None


def decompressed(body: bytes, encoding: str | None, max_size: int) -> bytes:
    """body, expanded in a stream that stops past max_size bytes (413): a small body may
    expand to gigabytes."""
    kind = (encoding or "identity").strip().lower()
    if kind == "identity":
        return body
    if kind not in ("gzip", "deflate"):
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    stream = zlib.decompressobj(zlib.MAX_WBITS | 16 if kind == "gzip" else zlib.MAX_WBITS)
    try:
        expanded = stream.decompress(body, max_size + 1)
    except zlib.error as error:
        raise ProtocolError(f"the body is not valid {kind} data: {error}") from None
    if len(expanded) > max_size:
        raise ProtocolError(f"the body expands to more than {max_size} bytes, the most this "
                            f"server takes (--max-request-size)", 413)
    if not stream.eof:
        raise ProtocolError(f"the body is not valid {kind} data: it ends early")
    return expanded


def compress(body: bytes, headers: dict[str, str], accept_encoding: str | None) -> bytes:
    """body compressed as the client accepts (gzip or deflate, as tritonclient asks for
    with response_compression_algorithm); headers gets Content-Encoding then."""
    named = (accept_encoding or "").lower()
    if "gzip" not in named and "deflate" not in named:  # (none, or identity: at once)
        return body
    accepted = {part.split(";")[0].strip() for part in named.split(",")}
    if "gzip" in accepted:
        headers["Content-Encoding"] = "gzip"
        return gzip.compress(body, compresslevel=1)
    if "deflate" in accepted:
        headers["Content-Encoding"] = "deflate"
        return zlib.compress(body, 1)
    return body


def error_body(message: str) -> bytes:
    """The protocol's error answer: {"error": message}."""
    return json.dumps({"error": message}).encode()
