"""``triton_python_backend_utils`` for Triton Python-backend models served by ``multipy
serve`` (``import triton_python_backend_utils as pb_utils`` finds this module inside each
interpreter: ``served_triton`` registers it under that name), with no Triton install:
what a ``TritonPythonModel`` uses of it, with Triton's names and behaviour.

Tensors are numpy arrays: an input's ``as_numpy()`` is the array the request decoded
(a view of a batch's rows, when several requests run in one ``execute``); BYTES is an
array of dtype object holding bytes, as in Triton.  Everything is on the CPU.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any, Callable

import numpy as np

#: Triton's config type names -> numpy's types (TYPE_STRING: objects, holding bytes).
TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32, "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_}
#: Triton's DataType numbers, in model_config.proto's order (TYPE_INVALID is 0).
_NUMBERS = {name: number for number, name in enumerate(
    ["TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
     "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32",
     "TYPE_FP64", "TYPE_STRING"])}
#: The flag of a response sender's last send: the request's answer is complete.
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

_logger = logging.getLogger("multipy.serve")


def serialize_byte_tensor(input_tensor: Any) -> Any:
    """The elements of an array of bytes or str (dtype object or ``S``), in row-major
    order, each as its length (4 bytes, little-endian) then its bytes (str UTF-8
    encoded), as a uint8 array; None for an empty array or one of numbers."""
    array = np.asarray(input_tensor)
    if array.size == 0 or array.dtype.kind not in "OS":
        return None
    out = bytearray()
    for item in array.reshape(-1).tolist():
        data = item if isinstance(item, bytes) else str(item).encode()
        out += len(data).to_bytes(4, "little") + data
    return np.frombuffer(bytes(out), np.uint8)


def deserialize_bytes_tensor(encoded_tensor: Any) -> Any:
    """The elements that ``serialize_byte_tensor`` wrote into encoded_tensor (bytes, or
    an array of them), as a 1-D array of dtype object holding bytes."""
    data = bytes(np.asarray(encoded_tensor, np.uint8)) \
        if not isinstance(encoded_tensor, bytes) else encoded_tensor
    items = []
    offset = 0
    while offset < len(data):
        size = int.from_bytes(data[offset:offset + 4], "little")
        items.append(data[offset + 4:offset + 4 + size])
        offset += 4 + size
    found = np.empty(len(items), dtype=np.object_)
    found[:] = items
    return found


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """The numpy type of a config's data_type ("TYPE_FP32": numpy.float32); KeyError
    for another string."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of Triton's DataType number (11: numpy.float32), or None."""
    for name, number in _NUMBERS.items():
        if number == data_type:
            return TRITON_STRING_TO_NUMPY.get(name)
    return None


def numpy_to_triton_type(data_type: Any) -> int | None:
    """Triton's DataType number of a numpy type (numpy.bytes_ as TYPE_STRING), or None."""
    if data_type in (np.bytes_, np.object_):
        return _NUMBERS["TYPE_STRING"]
    for name, kind in TRITON_STRING_TO_NUMPY.items():
        if np.dtype(kind) == np.dtype(data_type):
            return _NUMBERS[name]
    return None


class TritonError:
    """An error that a response carries (``InferenceResponse(error=...)``): its message
    goes to the request's client, with the HTTP status and gRPC code of its code."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, \
        ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message


class TritonModelException(Exception):
    """What a model raises for a failure: every request of the ``execute`` call gets its
    message, as an internal error."""

    def message(self) -> str:
        return str(self)


class Tensor:
    """A named tensor: a request's input, or a response's output (over a numpy array;
    ``from_dlpack`` takes another framework's tensor without a copy)."""

    def __init__(self, name: str, numpy_array: Any) -> None:
        array = np.asarray(numpy_array)
        if array.dtype.kind == "U":
            raise TritonModelException(f"tensor {name!r}: numpy str arrays are not served: "
                                       f"use dtype object (holding bytes or str)")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Any:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype.type)

    def is_cpu(self) -> bool:
        """Always: multipy's tensors reach models in host memory."""
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the tensor's memory (``torch.utils.dlpack.from_dlpack``
        takes it without a copy)."""
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor over the memory of capsule (a DLPack capsule, or an object with
        ``__dlpack__`` such as a CPU torch tensor), without a copy."""
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        return Tensor(name, np.from_dlpack(source))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._array!r})"


class _Capsule:
    """A bare DLPack capsule, as numpy.from_dlpack takes one: on the CPU."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class InferenceRequest:
    """One client's request, as ``execute`` gets it; a decoupled model's answers it
    through its ``get_response_sender()``."""

    def __init__(self, inputs: list[Tensor], request_id: str = "", correlation_id: int = 0,
                 requested_output_names: list[str] | None = None, parameters: str = "{}",
                 model_name: str = "", response_sender: InferenceResponseSender | None = None
                 ) -> None:
        self._inputs = inputs
        self._id = request_id
        self._correlation_id = correlation_id
        self._outputs = list(requested_output_names or [])
        self._parameters = parameters
        self._model_name = model_name
        self._sender = response_sender

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        """The request's id ("" if it has none)."""
        return self._id

    def correlation_id(self) -> int:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for (every output of the config, if it named none)."""
        return self._outputs

    def parameters(self) -> str:
        """The request's parameters, as a JSON object's text."""
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def flags(self) -> int:
        return 0

    def is_cancelled(self) -> bool:
        """Whether the request's answer ended before the final flag (its client went
        away): a decoupled model's request only (``InferenceResponseSender.is_cancelled``)."""
        return self._sender is not None and self._sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of the request's responses; TritonModelException unless the model
        is decoupled (a response sender in a model that returns its responses is not
        served)."""
        if self._sender is None:
            raise TritonModelException(
                "multipy serves a response sender to decoupled models only (config.pbtxt: "
                "model_transaction_policy { decoupled: true }): return one "
                "InferenceResponse per request")
        return self._sender


class InferenceResponseSender:
    """A decoupled model's way to answer one request: ``send(response)`` sends one
    response (its outputs, or its error), ``send(response=None,
    flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)`` ends the answer, with or without a
    last response; a send after that raises TritonModelException, in Triton's words.
    Each response goes to deliver(response) as it is sent, and the end to
    deliver(None); once the answer has ended otherwise (``cancel``), sends are dropped.
    Any thread may send."""

    def __init__(self, deliver: Callable[[InferenceResponse | None], None]) -> None:
        self._deliver = deliver
        self._lock = threading.Lock()
        self._closed = False
        self._cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if response is None and not flags:
            raise TritonModelException("Inference Response object must be provided when "
                                       "the response flags is set to zero.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TypeError(f"send(): response is a {type(response).__name__}, not an "
                            f"InferenceResponse")
        with self._lock:
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has "
                                           "been closed.")
            self._closed = bool(flags)
            if self._cancelled:
                return
            if response is not None:
                self._deliver(response)
            if flags:
                self._deliver(None)

    def is_cancelled(self) -> bool:
        """Whether the answer ended before the final flag: its client went away (or
        --timeout passed, or an error response ended it)."""
        return self._cancelled

    def cancel(self) -> None:
        """(The server's) The answer has ended without its last response: later sends
        are dropped, and ``is_cancelled()`` is true."""
        with self._lock:
            self._cancelled = True


class InferenceResponse:
    """The answer to one request: its output tensors, or an error (TritonError)."""

    def __init__(self, output_tensors: list[Tensor] | None = None,
                 error: TritonError | None = None, parameters: Any = None) -> None:
        if output_tensors is not None and not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        self._outputs = output_tensors or []
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input called name, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse,
                              name: str) -> Tensor | None:
    """The response's output called name, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's input called name (a dict, as in ``args["model_config"]``), or None."""
    return next((spec for spec in model_config.get("input", []) if spec["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's output called name (a dict, as in ``args["model_config"]``), or None."""
    return next((spec for spec in model_config.get("output", []) if spec["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    """Whether the config (a dict, as in ``args["model_config"]``) makes the model
    decoupled: ``model_transaction_policy { decoupled: true }``."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled"))


class Logger:
    """Triton's model logger, writing to the server's log (``multipy.serve``; to stderr
    while the interpreter's logging is not set up yet, as when ``initialize`` runs)."""

    class LogLevel:
        INFO, WARNING, ERROR, VERBOSE = range(4)

    _LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        number = Logger._LEVELS.get(level, logging.INFO)
        if _logger.hasHandlers():
            _logger.log(number, "%s", message)
        elif number >= logging.INFO:
            print(f"{logging.getLevelName(number)}:     {message}", file=sys.stderr, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.LogLevel.VERBOSE)


LogLevel = Logger.LogLevel


def parameters_text(parameters: dict[str, Any] | None) -> str:
    """A request's parameters as ``InferenceRequest.parameters()`` gives them: JSON."""
    return json.dumps(parameters or {})


def install() -> None:
    """Makes ``import triton_python_backend_utils`` find this module."""
    sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])
