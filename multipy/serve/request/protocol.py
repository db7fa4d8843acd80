"""The Open Inference Protocol (KServe's v2 protocol, which Triton speaks too) over
HTTP/REST: inference requests and responses as JSON tensors, with the binary tensor data
extension.  numpy only; nothing here knows about models or interpreters.  The requests
and errors themselves are multipy.serve.request.messages', which needs no numpy.

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
import math
import struct
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any, Iterable

import numpy as np

try:  # (the serve extra's, where it has a wheel; json's C encoder writes answers otherwise)
    from orjson import dumps as _orjson
except ImportError:  # (CPython 3.15: no orjson wheel yet)
    _orjson = None

from .messages import (HEADER_LENGTH, MAX_REQUEST_SIZE, InferRequest, ProtocolError, Tensor,
                       decompressed, json_object)

#: The most dimensions a tensor may have (numpy's own limit, and other servers').
MAX_RANK = 64
#: The most elements a tensor may claim: more than any body could carry (2**48).
MAX_ELEMENTS = 1 << 48

#: Each numeric datatype's numpy dtype (little-endian; BF16: its bits).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"), "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"), "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
#: The datatype of elements of variable length (text, or any bytes): its arrays are of
#: dtype object, holding ``bytes``.
BYTES = "BYTES"
#: Every datatype this server takes and gives.
DATATYPES = (*DTYPES, BYTES)
#: The bytes of a BYTES element's length, in binary data (little-endian).
LENGTH_PREFIX = 4
_LENGTH = struct.Struct("<I")


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


def parse_request(request: Any, binary: memoryview) -> InferRequest:
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
                                f"{_short([name for name, _ in outputs])}")
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
                            f"{_short(datatype)}")
    if datatype not in DATATYPES:
        raise ProtocolError(f"input {name!r}: unknown datatype {_short(datatype)}; "
                            f"the datatypes are {', '.join(DATATYPES)}")
    shape = spec.get("shape")
    count = _count(name, shape)
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


def from_length_prefixed(name: str, shape: list[int], data: memoryview) -> np.ndarray:
    """The BYTES array of shape (of input name) in its binary data: each element a 4-byte
    little-endian length, then that many bytes, row-major; ProtocolError if a length or
    an element is cut short by the data's end, or the data holds more or fewer elements
    than the shape.  A shape that claims more elements than the data has lengths for is
    refused before any is read."""
    count = math.prod(shape)
    size = len(data)
    if count > size // LENGTH_PREFIX:
        raise ProtocolError(f"input {name!r}: shape {shape} of BYTES has {count} elements, "
                            f"which need at least {count * LENGTH_PREFIX} bytes (a "
                            f"{LENGTH_PREFIX}-byte length each), but binary_data_size is "
                            f"{size}")
    raw = data.tobytes()  # slices of bytes are quicker to take than of a memoryview
    elements: list[bytes] = []
    position = 0
    for index in range(count):
        if size - position < LENGTH_PREFIX:
            if position == size:
                raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, "
                                    f"but its binary data holds {index}")
            raise ProtocolError(f"input {name!r}: BYTES element {index} is cut short: its "
                                f"{LENGTH_PREFIX}-byte length at byte {position} has only "
                                f"{size - position} bytes before the data's end "
                                f"(binary_data_size {size})")
        (length,) = _LENGTH.unpack_from(raw, position)
        start = position + LENGTH_PREFIX
        position = start + length
        if position > size:
            raise ProtocolError(f"input {name!r}: BYTES element {index} is cut short: its "
                                f"length says {length} bytes, but only {size - start} are "
                                f"left (binary_data_size {size})")
        elements.append(raw[start:position])
    if position != size:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, but "
                            f"{size - position} bytes of its binary data are left after them "
                            f"(binary_data_size {size})")
    return bytes_array(elements, shape)


def to_length_prefixed(array: np.ndarray) -> bytes:
    """The binary data of a BYTES array (of bytes objects): each element's 4-byte
    little-endian length, then its bytes, row-major."""
    parts = []
    for element in array.reshape(-1):
        parts.append(_LENGTH.pack(len(element)))
        parts.append(element)
    return b"".join(parts)


def bytes_array(elements: list[bytes], shape: list[int]) -> np.ndarray:
    """An array of dtype object of shape, holding elements (row-major)."""
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


#: The type of a size in a shape (bool is not one).
_INT = frozenset({int})


def _count(name: str, shape: Any) -> int:
    """How many elements shape claims, checked in time bounded by MAX_RANK: a list of at
    most MAX_RANK sizes from 0 to MAX_ELEMENTS whose product, zeros left out, is at most
    MAX_ELEMENTS (numpy refuses an empty array whose other sizes multiply past its
    limit)."""
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not _INT.issuperset(map(type, shape))
            or (shape and not 0 <= min(shape) <= max(shape) <= MAX_ELEMENTS)):
        raise ProtocolError(f"input {name!r}: shape must be a list of at most {MAX_RANK} "
                            f"sizes (integers from 0 to {MAX_ELEMENTS}), not {_short(shape)}")
    count = math.prod(shape)  # of at most MAX_RANK sizes that small: quick
    if count > MAX_ELEMENTS or (
            not count and math.prod(size for size in shape if size) > MAX_ELEMENTS):
        raise ProtocolError(f"input {name!r}: shape {_short(shape)} has more than "
                            f"{MAX_ELEMENTS} elements (its sizes that are not 0 multiplied)")
    return count


def _short(value: Any, limit: int = 200) -> str:
    """repr(value), cut to about limit characters: error messages quote what clients sent."""
    text = repr(value) if not isinstance(value, list) or len(value) <= 64 else \
        repr(value[:64])[:-1] + f", ... ({len(value)} in all)]"
    return text if len(text) <= limit else text[:limit] + "..."


def _leaf_types(data: Any, limit: int) -> set[type] | None:
    """The types of the values of nested lists data (lists of lists, or of values), or
    None if they hold more than limit values: a walk of the lists that builds nothing."""
    if type(data) is list and (not data or type(data[0]) is not list):  # flat: at once
        return set(map(type, data)) if len(data) <= limit else None
    types: set[type] = set()
    pending, seen = [data], 0
    while pending:
        items = pending.pop()
        if not isinstance(items, list):
            types.add(type(items))
            seen += 1
        elif items and type(items[0]) is list:
            pending.extend(items)
            continue
        else:
            types.update(map(type, items))
            seen += len(items)
        if seen > limit:
            return None
    return types


#: The Python types of JSON values that numeric data may hold.
_NUMBERS = frozenset({int, float, bool})
_FLOAT = frozenset({float})
#: The datatypes of numpy's floats (BF16's arrays hold its bits).
_FLOATS = frozenset({"FP16", "FP32", "FP64"})
#: Each numeric datatype's kinds of numpy arrays that its JSON data may be read as, and
#: what an error calls them.
_ALLOWED = {datatype: ("b", "true or false") if datatype == "BOOL" else
            ("iu", "integers") if dtype.kind in "iu" and datatype != "BF16" else
            ("iuf", "numbers") for datatype, dtype in DTYPES.items()}


def from_json(name: str, datatype: str, shape: list[int], data: Any,
              count: int | None = None) -> np.ndarray:
    """The array of JSON tensor data (flat or nested, row-major) of a datatype and shape
    (of count elements, if given); ProtocolError if the values do not fit the datatype
    or their count the shape.  The values' types and count are checked before any array
    is built.  BYTES data are strings, UTF-8 encoded into the array's bytes, or bytes
    (gRPC's bytes_contents), the array's as they are."""
    if datatype == BYTES:
        return _bytes_from_json(name, shape, data)
    if count is None:
        count = math.prod(shape)
    dtype = DTYPES[datatype]
    allowed, wanted = _ALLOWED[datatype]
    types = _leaf_types(data, count)
    if types is None:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, but "
                            f"the data has more")
    if not types <= _NUMBERS:
        wrong = sorted(t.__name__ for t in types - _NUMBERS)[0]
        raise ProtocolError(f"input {name!r}: {datatype} data must be {wanted}; got a {wrong}")
    # floats for a float datatype: read as its dtype at once, as astype would give them
    exact = datatype in _FLOATS and types <= _FLOAT
    try:
        values = np.array(data if isinstance(data, list) else [data],
                          dtype=dtype if exact else None)
    except (ValueError, TypeError, OverflowError):
        raise ProtocolError(f"input {name!r}: data must be a (nested) list of "
                            f"numbers of one shape") from None
    if values.size != count:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, but "
                            f"the data has {values.size}")
    kind = values.dtype.kind
    if count == 0:
        kind = dtype.kind  # an empty list has no values to check
    if allowed == "iu" and kind in "fO":  # big integers that numpy could not type alike
        return _exact_integers(name, datatype, data).reshape(shape)
    if kind not in allowed:
        raise ProtocolError(f"input {name!r}: {datatype} data must be {wanted}; "
                            f"got {_sample(values)}")
    if datatype == "BF16":
        return to_bf16_bits(values.astype(np.float32)).reshape(shape)
    if allowed == "iu" and count:
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise ProtocolError(f"input {name!r}: a value is out of {datatype}'s range "
                                f"[{info.min}, {info.max}]")
    return (values if exact else values.astype(dtype, copy=False)).reshape(shape)


def _bytes_from_json(name: str, shape: list[int], data: Any) -> np.ndarray:
    """from_json for BYTES: strings, or bytes, in nested lists of one shape (or one)."""
    count = math.prod(shape)
    types = _leaf_types(data, count)
    if types is None:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, but "
                            f"the data has more")
    ragged = ProtocolError(f"input {name!r}: data must be a (nested) list of strings of "
                           f"one shape")
    if list in types:  # lists beside strings
        raise ragged
    if not (types <= {str} or types <= {bytes}):
        wrong = sorted(t.__name__ for t in types - {str})[0]
        raise ProtocolError(f"input {name!r}: BYTES data must be strings; got a {wrong}")
    level = data if isinstance(data, list) else [data]
    while level and type(level[0]) is list:  # one depth of the lists at a time
        if any(type(item) is not list or len(item) != len(level[0]) for item in level):
            raise ragged
        level = [value for item in level for value in item]
    if len(level) != count:
        raise ProtocolError(f"input {name!r}: shape {shape} has {count} elements, but "
                            f"the data has {len(level)}")
    if types <= {bytes}:
        return bytes_array(level, shape)
    elements = []
    for position, text in enumerate(level):
        try:
            elements.append(text.encode())
        except UnicodeEncodeError:  # a lone surrogate, which JSON's \u escapes can write
            raise ProtocolError(f"input {name!r}: string {position} is not Unicode text "
                                f"(it holds a lone surrogate, {text[:40]!r})") from None
    return bytes_array(elements, shape)


def _exact_integers(name: str, datatype: str, data: Any) -> np.ndarray:
    """The values of an integer datatype that numpy read as floats or objects (0 and
    2**64 - 1 together read as float64, say), checked one by one as Python ints."""
    try:
        flat = np.array(data if isinstance(data, list) else [data], dtype=object).reshape(-1)
    except ValueError:
        flat = np.array([None], dtype=object)
    wrong = [v for v in flat if type(v) is not int][:1]
    if wrong:
        wrong = wrong[0]
        raise ProtocolError(f"input {name!r}: {datatype} data must be integers; got {wrong!r}")
    info = np.iinfo(DTYPES[datatype])
    if flat.size and (min(flat) < info.min or max(flat) > info.max):
        raise ProtocolError(f"input {name!r}: a value is out of {datatype}'s range "
                            f"[{info.min}, {info.max}]")
    return np.array(flat.tolist(), dtype=DTYPES[datatype])


def _sample(values: np.ndarray) -> str:
    flat = values.reshape(-1)
    return repr(flat[0].item() if flat.dtype != object else flat[0]) if flat.size else "nothing"


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) of float32 values, rounded to nearest even (NaN stays NaN)."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of BF16 bits (uint16): exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


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
            entry["data"] = _texts(tensor.name, array)
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
    header = _written(answer)
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return header + b"".join(chunks), {"Content-Type": "application/octet-stream",
                                       HEADER_LENGTH: str(len(header))}


def _written(answer: dict[str, Any]) -> bytes:
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
            if b"null" not in written:  # (no value here is None: a number was not finite,
                return written  # or a string holds the word, which json writes as well)
    return _compact(answer).encode()


def _texts(name: str, array: np.ndarray) -> list[str]:
    """The strings of a BYTES output's elements, row-major, decoded as UTF-8."""
    texts = []
    for position, element in enumerate(array.reshape(-1)):
        try:
            texts.append(element.decode())
        except UnicodeDecodeError as error:
            raise ProtocolError(
                f"output {name!r}: element {position} is not UTF-8 text ({error.reason} at "
                f"byte {error.start}), which JSON cannot carry: ask for the output as "
                f'binary data ("parameters": {{"binary_data": true}})') from None
    return texts


def tensor_bytes(tensor: Tensor) -> bytes:
    """A tensor's data as the binary data extension and gRPC's raw contents carry it:
    little-endian, row-major (BYTES: length-prefixed)."""
    if tensor.datatype == BYTES:
        return to_length_prefixed(tensor.array)
    return np.ascontiguousarray(tensor.array, DTYPES[tensor.datatype]).tobytes()
