"""Triton's generate extension, as records: its request object, which becomes the same
request record as the protocol's (multipy.serve.request.protocol.parse_request, with its
checks), and its answer object, one per piece of a streamed answer.

A request is a JSON object whose keys are inputs by name, each a scalar or a list (of
lists: its shape is theirs; a scalar's is [1]), besides "id" (a string) and
"parameters" (an object).  An input the model describes (declares, or its example
shows) takes its datatype (and its shape's leading dimensions, as 1, where it has
more); another, its values': a string is BYTES, true or false BOOL, an integer INT64, a number FP32 (FP64
where a value does not fit FP32's range).  An answer is a JSON object: the model's
name and version, the request's id if it has one, and each output by name, a scalar
where it has one element (BYTES as text), else a list of its values, row-major.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .messages import InferRequest, ProtocolError, Tensor, json_object
from .protocol import parse_request, texts, written
from .tensors import BYTES, bf16_bits_to_float32

#: The largest finite FP32.
_FP32_MAX = float(np.finfo(np.float32).max)


def generate_request(body: bytes, described: list[dict] | None) -> InferRequest:
    """The request record of a generate request's body, for a model whose inputs are
    described (each {"name", "datatype", "shape"}), or not (None).  ProtocolError (400)
    if it is not a well-formed generate request, or its values do not fit."""
    found = json_object(body)
    request_id = found.pop("id", None)
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError('"id" must be a string')
    parameters = found.pop("parameters", {})
    if not found:
        raise ProtocolError("the request names no input: give each as a key of the object "
                            '(besides "id" and "parameters")')
    specs = {spec["name"]: spec for spec in described or ()}
    inputs = [_input(name, value, specs.get(name)) for name, value in found.items()]
    translated: dict[str, Any] = {"inputs": inputs, "parameters": parameters}
    if request_id is not None:
        translated["id"] = request_id
    return parse_request(translated, memoryview(b""))


def _input(name: str, value: Any, spec: dict | None) -> dict[str, Any]:
    """The protocol's JSON form of input name given as value (described as spec, if it
    is)."""
    shape = [1] if not isinstance(value, list) else list(np.shape(np.array(value, dtype=object)))
    values = [value] if not isinstance(value, list) else _flat(value)
    if len(values) != math.prod(shape):
        raise ProtocolError(f"input {name!r}: its lists must all be of one length at each "
                            f"depth (a tensor's shape)")
    if spec is not None:
        datatype, wanted = spec["datatype"], spec["shape"]
        shape = [1] * max(0, len(wanted) - len(shape)) + shape
    else:
        datatype = _datatype(name, values)
    return {"name": name, "datatype": datatype, "shape": shape, "data": values}


def _flat(value: list) -> list:
    """value's leaves, row-major."""
    leaves: list = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            leaves.append(item)
    return leaves


def _datatype(name: str, values: list) -> str:
    """The datatype of undeclared input name, from its values; ProtocolError if they
    are of kinds that no one datatype holds."""
    kinds = {type(value) for value in values}
    if kinds <= {str}:
        return BYTES
    if kinds <= {bool}:
        return "BOOL"
    if kinds <= {int}:
        return "INT64"
    if kinds <= {int, float}:
        return "FP64" if any(abs(value) > _FP32_MAX for value in values
                             if math.isfinite(value)) else "FP32"
    raise ProtocolError(f"input {name!r} mixes values of kinds "
                        f"{', '.join(sorted(kind.__name__ for kind in kinds))}: give strings, "
                        f"booleans or numbers")


def generate_answer(model_name: str, request_id: str | None,
                    outputs: list[Tensor]) -> bytes:
    """The JSON of one answer (or piece of one) to a generate request.  ProtocolError
    (500) if a BYTES output holds bytes that are not UTF-8 text."""
    answer: dict[str, Any] = {"model_name": model_name, "model_version": "1"}
    if request_id is not None:
        answer["id"] = request_id
    for tensor in outputs:
        array = tensor.array
        if tensor.datatype == BYTES:
            values: list = texts(tensor.name, array)
        else:
            if tensor.datatype == "BF16":
                array = bf16_bits_to_float32(array)
            values = array.reshape(-1).tolist()
        answer[tensor.name] = values[0] if len(values) == 1 else values
    return written(answer)
