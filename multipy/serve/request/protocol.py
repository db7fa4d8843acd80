"""The Open Inference Protocol (KServe's v2 protocol, which Triton speaks too) over
HTTP/REST: inference requests and responses as JSON tensors, with the binary tensor data
extension.  numpy only; nothing here knows about models or interpreters.  The requests
and errors themselves are multipy.serve.request.messages', which needs no numpy; a
tensor's data, multipy.serve.request.tensors'.

A tensor's data is a numpy array of its shape.  BF16 has no numpy dtype: its arrays hold
the bits, as uint16 (what the interpreters turn into bfloat16 tensors), and JSON carries
BF16 values as numbers, rounded to nearest even on the way in.  BYTES (text, and other
data of variable length) arrays are of dtype object, holding ``bytes``: JSON carries them
as strings (UTF-8 encoded on the way in; an answer in JSON must be UTF-8 text, else it is
a 400 that says to ask for binary data).

Binary data (Triton's "binary_tensor_data" extension): when a request has the header
``Inference-Header-Content-Length: N``, the first N bytes of its body are the JSON and the
rest are the raw bytes of the inputs that say ``"parameters": {"binary_data_size": K}``,
in order, little-endian, row-major (one byte per BOOL; for BYTES, each element as a
4-byte little-endian length followed by its bytes).  Without that header the whole
body is JSON, whatever its Content-Type.  Outputs asked for with
``"parameters": {"binary_data": true}`` (or all of them, by the request's
``"parameters": {"binary_data_output": true}``) come back the same way.
"""
from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, Iterable

import numpy as np

try:  # (the serve extra's, where it has a wheel; json's C encoder writes answers otherwise)
    from orjson import dumps as _orjson
except ImportError:  # (CPython 3.15: no orjson wheel yet)
    _orjson = None

from .messages import (HEADER_LENGTH, MAX_REQUEST_SIZE, InferRequest, ProtocolError, Tensor,
                       decompressed, json_object)
from .tensors import (BYTES, DATATYPES, DTYPES, bf16_bits_to_float32, element_count, from_json,
                      from_length_prefixed, quoted, tensor_bytes)


def _compact_json() -> Any:
    """json.dumps(value, separators=(",", ":")) as a function of value: json's C encoder,
    made once (json.dumps makes one for every call, in Python), where json has one;
    without a check for circular references, which the answers, built here, never
    hold."""
    encoder = json.JSONEncoder(separators=(",", ":"))
    if c_make_encoder is None:  # (json without its C part)
        return encoder.encode
    encode = c_make_encoder(None, encoder.default, encode_basestring_ascii, None, ":", ",",
                            False, False, True)
    return lambda value: "".join(encode(value, 0))


#: JSON without spaces, as answers are written
_compact = _compact_json()


def decode_request(body: bytes, header_length: str | None = None,
                   content_encoding: str | None = None,
                   max_size: int = MAX_REQUEST_SIZE) -> InferRequest:
    """The request in an HTTP body; header_length is the Inference-Header-Content-Length
    header's value (None when absent: then the whole body is JSON), content_encoding the
    Content-Encoding header's (gzip and deflate are read, up to max_size bytes).
    ProtocolError if it is not a well-formed inference request (413 if it expands past
    max_size)."""
    if content_encoding is not None:
        body = decompressed(body, content_encoding, max_size)
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH} must be a number of bytes, not "
                                f"{header_length!r}") from None
        if not 0 <= length <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} is {length}, but the body has "
                                f"{len(body)} bytes")
        json_part, binary = body[:length], memoryview(body)[length:]
    return parse_request(json_object(json_part), binary)


def parse_request(request: dict, binary: memoryview) -> InferRequest:
    """The request record of a request in the protocol's JSON form (as parsed), whose
    inputs with binary_data_size take their data from binary, in order: what every
    transport's request becomes (an HTTP body, or a gRPC message translated, whose
    BYTES data may be bytes, taken as they are).  ProtocolError if it is not a
    well-formed inference request."""
    if not isinstance(request, dict):
        raise ProtocolError("the request must be a JSON object")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError('the request must have "inputs": a non-empty list of tensors')
    parameters = _object(request.get("parameters"), "the request")
    offset = 0
    tensors = []
    for position, spec in enumerate(inputs):
        tensor, offset = _input(spec, position, binary, offset)
        tensors.append(tensor)
    if offset != len(binary):
        raise ProtocolError(f"the request has {len(binary) - offset} bytes of binary data "
                            f"that no input claims (binary_data_size)")
    if len(tensors) > 1:
        names = [tensor.name for tensor in tensors]
        if len(set(names)) != len(names):
            raise ProtocolError(f"input names must be unique: {names}")
    outputs = None
    if request.get("outputs"):  # absent, null or []: every output, as Triton answers
        if not isinstance(request["outputs"], list):
            raise ProtocolError('"outputs" must be a list of {"name": ...} objects')
        outputs = [_requested(spec, parameters) for spec in request["outputs"]]
        if len({name for name, _ in outputs}) != len(outputs):
            raise ProtocolError("each output may be asked for once: "
                                f"{quoted([name for name, _ in outputs])}")
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError('"id" must be a string')
    return InferRequest(tensors, outputs,
                        _flag(parameters, "binary_data_output") if parameters else False,
                        request_id, parameters)


def _object(value: Any, owner: str, name: str | None = None) -> dict:
    """value, the "parameters" of owner (the request, or input or output name): {} if
    None; ProtocolError unless it is a JSON object."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        owner = owner if name is None else f"{owner} {name!r}"
        raise ProtocolError(f"{owner}'s parameters must be a JSON object")
    return value


def _flag(parameters: dict, name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise ProtocolError(f'parameter "{name}" must be true or false')
    return value


def _requested(spec: Any, request_parameters: dict) -> tuple[str, bool]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ProtocolError('each requested output must be an object with a "name"')
    parameters = _object(spec.get("parameters"), "output", spec["name"])
    if "classification" in parameters:
        raise ProtocolError("the classification extension is not supported")
    binary = _flag(parameters, "binary_data") if "binary_data" in parameters else \
        _flag(request_parameters, "binary_data_output")
    return spec["name"], binary


def _input(spec: Any, position: int, binary: memoryview, offset: int) -> tuple[Tensor, int]:
    """The tensor of one input, and the offset in binary past its data."""
    if not isinstance(spec, dict):
        raise ProtocolError(f"input {position} must be a JSON object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f'input {position} must have a "name"')
    datatype = spec.get("datatype")
    if not isinstance(datatype, str):
        raise ProtocolError(f'input {name!r}: "datatype" must be a string, not '
                            f"{quoted(datatype)}")
    if datatype not in DATATYPES:
        raise ProtocolError(f"input {name!r}: unknown datatype {quoted(datatype)}; "
                            f"the datatypes are {', '.join(DATATYPES)}")
    shape = spec.get("shape")
    count = element_count(name, shape)
    parameters = spec.get("parameters")
    if parameters is None:  # (most inputs: their data in the JSON)
        if "data" not in spec:
            raise ProtocolError(f'input {name!r} has no "data" (nor binary_data_size)')
        return Tensor(name, datatype, from_json(name, datatype, shape, spec["data"], count)), \
            offset
    parameters = _object(parameters, "input", name)
    if "shared_memory_region" in parameters:
        raise ProtocolError(f"input {name!r}: the shared-memory extension is not supported")
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise ProtocolError(f"input {name!r}: binary_data_size must be a number of bytes")
        if "data" in spec:
            raise ProtocolError(f'input {name!r} has both "data" and binary_data_size')
        if datatype != BYTES and size != count * DTYPES[datatype].itemsize:
            raise ProtocolError(f"input {name!r}: shape {shape} of {datatype} needs "
                                f"{count * DTYPES[datatype].itemsize} bytes, but "
                                f"binary_data_size is {size}")
        if offset + size > len(binary):
            raise ProtocolError(f"input {name!r}: binary_data_size is {size}, but only "
                                f"{len(binary) - offset} bytes of binary data are left")
        if datatype == BYTES:
            array = from_length_prefixed(name, shape, binary[offset:offset + size])
            return Tensor(name, datatype, array), offset + size
        array = np.frombuffer(binary, DTYPES[datatype], count, offset).reshape(shape).copy()
        return Tensor(name, datatype, array), offset + size
    if "data" not in spec:
        raise ProtocolError(f'input {name!r} has no "data" (nor binary_data_size)')
    return Tensor(name, datatype, from_json(name, datatype, shape, spec["data"], count)), offset



def encode_response(model_name: str, model_version: str | None, request_id: str | None,
                    outputs: Iterable[tuple[Tensor, bool]]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the answer to an inference request: outputs, each with
    whether it goes as binary data (then the body is the JSON, then their bytes, and the
    headers say where the JSON ends).  ProtocolError if a BYTES output to go as JSON
    holds bytes that are not UTF-8 text: JSON cannot carry them, binary data can."""
    described, chunks = [], []
    for tensor, binary in outputs:
        array = tensor.array
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                 "shape": list(array.shape)}
        if binary:
            raw = tensor_bytes(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif tensor.datatype == BYTES:
            entry["data"] = texts(tensor.name, array)
        else:
            if tensor.datatype == "BF16":
                array = bf16_bits_to_float32(array)
            entry["data"] = array.reshape(-1).tolist()
        described.append(entry)
    answer: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        answer["model_version"] = model_version
    if request_id is not None:
        answer["id"] = request_id
    answer["outputs"] = described
    header = written(answer)
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return header + b"".join(chunks), {"Content-Type": "application/octet-stream",
                                       HEADER_LENGTH: str(len(header))}


def written(answer: dict[str, Any]) -> bytes:
    """answer as JSON without spaces, in UTF-8: orjson's, where it is installed (each
    float in the fewest digits that read back as the same double, as json writes it, at
    a tenth of json's cost); json's where orjson cannot write the answer as json does: a
    number that is not finite (json writes NaN and Infinity, orjson null) or a string
    that UTF-8 cannot hold (a lone surrogate, which a request's id may have)."""
    if _orjson is not None:
        try:
            written = _orjson(answer)
        except TypeError:  # (orjson.JSONEncodeError: the lone surrogate)
            pass
        else:
            if written.find(b"null") < 0:  # (no value here is None: a number was not
                return written  # finite, or a string holds the word, which json writes)
    return _compact(answer).encode()


def texts(name: str, array: np.ndarray) -> list[str]:
    """The strings of a BYTES output's elements, row-major, decoded as UTF-8."""
    found = []
    for position, element in enumerate(array.reshape(-1)):
        try:
            found.append(element.decode())
        except UnicodeDecodeError as error:
            raise ProtocolError(
                f"output {name!r}: element {position} is not UTF-8 text ({error.reason} at "
                f"byte {error.start}), which JSON cannot carry: ask for the output as "
                f'binary data ("parameters": {{"binary_data": true}})') from None
    return found
