"""A tensor's data as the Open Inference Protocol carries it, apart from the requests and
answers that carry it (multipy.serve.request.protocol): the datatypes and their numpy
dtypes, shapes checked before anything is made of them (``element_count``), JSON data read
into arrays (``from_json``), BYTES elements length-prefixed in binary data, BF16 as its
bits, and a tensor's bytes as binary data and gRPC carry them (``tensor_bytes``).
numpy only.
"""
from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from .messages import ProtocolError, Tensor

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


def element_count(name: str, shape: object) -> int:
    """How many elements shape claims, checked in time bounded by MAX_RANK: a list of at
    most MAX_RANK sizes from 0 to MAX_ELEMENTS whose product, zeros left out, is at most
    MAX_ELEMENTS (numpy refuses an empty array whose other sizes multiply past its
    limit)."""
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not _INT.issuperset(map(type, shape))
            or (shape and not 0 <= min(shape) <= max(shape) <= MAX_ELEMENTS)):
        raise ProtocolError(f"input {name!r}: shape must be a list of at most {MAX_RANK} "
                            f"sizes (integers from 0 to {MAX_ELEMENTS}), not {quoted(shape)}")
    count = math.prod(shape)  # of at most MAX_RANK sizes that small: quick
    if count > MAX_ELEMENTS or (
            not count and math.prod(size for size in shape if size) > MAX_ELEMENTS):
        raise ProtocolError(f"input {name!r}: shape {quoted(shape)} has more than "
                            f"{MAX_ELEMENTS} elements (its sizes that are not 0 multiplied)")
    return count


def quoted(value: object, limit: int = 200) -> str:
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


def from_json(name: str, datatype: str, shape: list[int], data: object,
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


def tensor_bytes(tensor: Tensor) -> bytes:
    """A tensor's data as the binary data extension and gRPC's raw contents carry it:
    little-endian, row-major (BYTES: length-prefixed)."""
    if tensor.datatype == BYTES:
        return to_length_prefixed(tensor.array)
    return np.ascontiguousarray(tensor.array, DTYPES[tensor.datatype]).tobytes()
