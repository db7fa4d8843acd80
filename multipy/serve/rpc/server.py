"""The gRPC face of a server: the Open Inference Protocol's
``inference.GRPCInferenceService``, with Triton's statistics and model repository
extensions, on grpcio's
asyncio server, next to the HTTP face (multipy.serve.http.app) on the same event loop.  Its
messages are generated from multipy/serve/inference.proto; each RPC is registered here
under the protocol's service name.

It only translates: a ModelInferRequest becomes the same request record as an HTTP body
(multipy.serve.request.protocol.parse_request, with its checks and limits), and the answer goes
through the same path (multipy.serve.request.inference).  Typed ``contents`` and
``raw_input_contents`` are read; outputs go back as ``raw_output_contents``, as Triton
answers.  Errors are gRPC status codes with the messages of the HTTP answers; a call to
an RPC of a restricted category without the header it requires is PERMISSION_DENIED
(multipy.serve.request.restricted).
BYTES in ``bytes_contents`` are bounded as HTTP's binary data are: no more elements
than a body of --max-request-size holds, at a 4-byte length each.

Every interpreter's front end runs one such server on the same port (``grpc.so_reuseport``):
the kernel spreads the connections over them, and each connection's calls stay with its
interpreter, as an HTTP keep-alive connection does.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from contextvars import ContextVar
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc
from google.protobuf import json_format

from ..request import repository
from ..request.contract import Server
from ..request.inference import (decode_apart, infer, ready_model, server_metadata, statistics,
                                 stream)
from ..request.protocol import InferRequest, ProtocolError, Tensor, parse_request
from ..request.restricted import GRPC_PREFIX, RPCS as CATEGORIES, Restrictions
from ..request.tensors import LENGTH_PREFIX, tensor_bytes
from . import inference_pb2 as messages

#: What grpcio gives a servicer's method with each call.
Context = grpc.aio.ServicerContext

#: The gRPC code of each HTTP status that a ProtocolError can have here (INTERNAL for
#: another, unless the error names its own code).
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.PERMISSION_DENIED,
         404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
         499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL,
         501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE}

#: The protocol's service, as its clients call it.
SERVICE = "inference.GRPCInferenceService"

#: Where each datatype's values are in typed contents (FP16 and BF16: as fp32 values).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP16": "fp32_contents", "BF16": "fp32_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


#: The service that answers the models' calls under way (ModelInfer, ModelMetadata,
#: ModelReady), as create_server's ``taking`` gave it when the server took the call up.
_taken: ContextVar[Server | None] = ContextVar("taken", default=None)


def create_server(service: Server, address: str, private: str | None = None,
                  taking: Callable[[], Server] | None = None) -> grpc.aio.Server:
    """A gRPC server, not yet started, of service (as multipy.serve.http.app.create_app
    takes it) on address ("HOST:PORT"), which other processes' and interpreters' servers
    may share (SO_REUSEPORT), and on private, an address of its own if given (see
    ``through``).  taking(), if given, runs as the server takes up each call, before its
    message is read, and gives the service that answers that call's model (service as
    it is then, say).  RuntimeError if it cannot listen."""
    server = grpc.aio.server(
        interceptors=() if taking is None else (_Taking(taking),), options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", service.max_request_size),
            ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((_Servicer(service).handler(),))
    server.add_insecure_port(address)
    if private is not None:
        server.add_insecure_port(private)
    return server


async def through(private: str, timeout: float) -> None:
    """Returns once a call of ServerLive on private, the address of a server's own, has
    been answered (its status whatever it is: PERMISSION_DENIED, where health is
    restricted): once that server has taken up every call it had received before, on
    any connection (it takes them up in the order they came).  grpc.aio.AioRpcError if
    not within timeout seconds, or if the server does not answer."""
    async with grpc.aio.insecure_channel(private) as channel:
        try:
            await channel.unary_unary(
                f"/{SERVICE}/ServerLive",
                request_serializer=messages.ServerLiveRequest.SerializeToString,
                response_deserializer=messages.ServerLiveResponse.FromString,
            )(messages.ServerLiveRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNAVAILABLE):
                raise


class _Taking(grpc.aio.ServerInterceptor):
    """Notes, in the context of each call as the server takes it up, what taking()
    gives (create_server's)."""

    def __init__(self, taking: Callable[[], Server]) -> None:
        self._taking = taking

    async def intercept_service(self, continuation: Callable,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        _taken.set(self._taking())
        return await continuation(details)


class _Servicer:
    """Each RPC of the protocol that this server answers, for a service: a method named
    after the RPC, which takes (request message, context) and raises ProtocolError for
    an error answer."""

    #: Each RPC's request and response messages.
    RPCS = {
        "ServerLive": (messages.ServerLiveRequest, messages.ServerLiveResponse),
        "ServerReady": (messages.ServerReadyRequest, messages.ServerReadyResponse),
        "ModelReady": (messages.ModelReadyRequest, messages.ModelReadyResponse),
        "ServerMetadata": (messages.ServerMetadataRequest, messages.ServerMetadataResponse),
        "ModelMetadata": (messages.ModelMetadataRequest, messages.ModelMetadataResponse),
        "ModelInfer": (messages.ModelInferRequest, messages.ModelInferResponse),
        "ModelStatistics": (messages.ModelStatisticsRequest,
                            messages.ModelStatisticsResponse),
        "RepositoryIndex": (messages.RepositoryIndexRequest, messages.RepositoryIndexResponse),
        "RepositoryModelLoad": (messages.RepositoryModelLoadRequest,
                                messages.RepositoryModelLoadResponse),
        "RepositoryModelUnload": (messages.RepositoryModelUnloadRequest,
                                  messages.RepositoryModelUnloadResponse),
    }

    def __init__(self, service: Server) -> None:
        self._service = service

    def handler(self) -> grpc.GenericRpcHandler:
        """The RPCs, as grpcio serves them under SERVICE (any other is UNIMPLEMENTED),
        each behind the restriction of its category, if the service's
        grpc_restricted restricts it (multipy.serve.request.restricted)."""
        restrictions = Restrictions(self._service.grpc_restricted, GRPC_PREFIX)

        def answering(name: str) -> Callable:
            return _answering(_restricted(getattr(self, name), restrictions, CATEGORIES[name]))

        return grpc.method_handlers_generic_handler(SERVICE, {
            **{name: grpc.unary_unary_rpc_method_handler(
                answering(name), request_deserializer=request.FromString,
                response_serializer=response.SerializeToString)
               for name, (request, response) in self.RPCS.items()},
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                answering("ModelStreamInfer"),
                request_deserializer=messages.ModelInferRequest.FromString,
                response_serializer=messages.ModelStreamInferResponse.SerializeToString)})

    async def ServerLive(self, request: messages.ServerLiveRequest,
                         context: Context) -> messages.ServerLiveResponse:
        return messages.ServerLiveResponse(live=True)

    async def ServerReady(self, request: messages.ServerReadyRequest,
                          context: Context) -> messages.ServerReadyResponse:
        service = self._service
        return messages.ServerReadyResponse(
            ready=bool(service.ready) and not service.metrics.all_stuck()
            and not repository.not_ready(service.states, service.strict_readiness))

    def _as_taken(self) -> Server:
        """The service that answers the call under way (see create_server's taking)."""
        return _taken.get() or self._service

    async def ModelReady(self, request: messages.ModelReadyRequest,
                         context: Context) -> messages.ModelReadyResponse:
        model = self._as_taken().model(request.name, request.version or None)
        ready = model is not None and model.ready and not self._service.metrics.all_stuck() \
            and await model.healthy()
        return messages.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: messages.ServerMetadataRequest,
                             context: Context) -> messages.ServerMetadataResponse:
        return json_format.ParseDict(server_metadata(), messages.ServerMetadataResponse())

    async def ModelMetadata(self, request: messages.ModelMetadataRequest,
                            context: Context) -> messages.ModelMetadataResponse:
        model = ready_model(self._as_taken(), request.name, request.version or None)
        return json_format.ParseDict(model.metadata(), messages.ModelMetadataResponse())

    async def ModelInfer(self, request: messages.ModelInferRequest,
                         context: Context) -> messages.ModelInferResponse:
        def encode(decoded: InferRequest, outputs: list[Tensor]) -> Any:
            return _encoded(request.model_name, decoded.id, outputs)

        return await infer(self._as_taken(), request.model_name, request.model_version or None,
                           lambda: self._with_deadline(request, context), encode)

    async def _with_deadline(self, request: messages.ModelInferRequest,
                             context: Context) -> InferRequest:
        """request's record, with its deadline (its call stops then: multipy._inside.
        hangups)."""
        decoded = await _decoded(self._service, request)
        remaining = context.time_remaining()
        if remaining is not None:
            decoded.deadline = time.monotonic() + remaining
        return decoded

    async def ModelStreamInfer(self, requests: AsyncIterator[messages.ModelInferRequest],
                               context: Context) -> None:
        """Triton's streaming RPC: each request of the stream answered as it comes, in
        pieces as the model makes them (several requests' at once), each a response
        with its request's id; a request's failure is an error response that ends its
        answer.  A request with the parameter triton_enable_empty_final_response true
        gets triton_final_response false in each piece, and an empty response with it
        true after the last.  A stream that the client cancels ends every answer's
        model stream (each counted as 499)."""
        writing = asyncio.Lock()  # (one write at a time)
        answers: set[asyncio.Task] = set()
        try:
            async for request in requests:
                answer = asyncio.ensure_future(self._answer_streamed(request, context, writing))
                answers.add(answer)
                answer.add_done_callback(answers.discard)  # (those answered: let go)
            await asyncio.gather(*answers)
        finally:
            for answer in answers:
                answer.cancel()

    async def _answer_streamed(self, request: messages.ModelInferRequest, context: Context,
                               writing: asyncio.Lock) -> None:
        """Answers one request of a ModelStreamInfer stream (see there)."""
        final = _parameters(request.parameters).get("triton_enable_empty_final_response") \
            is True

        def encode(decoded: InferRequest, outputs: list[Tensor]) -> Any:
            response = _encoded(request.model_name, decoded.id, outputs)
            if final:
                response.parameters["triton_final_response"].bool_param = False
            return messages.ModelStreamInferResponse(infer_response=response)

        async def write(response: messages.ModelStreamInferResponse) -> None:
            async with writing:
                await context.write(response)

        pieces = stream(self._as_taken(), request.model_name, request.model_version or None,
                        lambda: self._with_deadline(request, context), encode)
        try:
            async with contextlib.aclosing(pieces):
                async for response in pieces:
                    await write(response)
        except ProtocolError as error:
            if error.status != 499:
                await write(messages.ModelStreamInferResponse(
                    error_message=str(error), infer_response=messages.ModelInferResponse(
                        model_name=request.model_name, model_version="1", id=request.id)))
            return
        if final:
            ended = messages.ModelInferResponse(model_name=request.model_name,
                                                model_version="1", id=request.id)
            ended.parameters["triton_final_response"].bool_param = True
            await write(messages.ModelStreamInferResponse(infer_response=ended))

    async def ModelStatistics(self, request: messages.ModelStatisticsRequest,
                              context: Context) -> messages.ModelStatisticsResponse:
        found = statistics(self._service, request.name or None, request.version or None)
        return json_format.ParseDict(found, messages.ModelStatisticsResponse())

    async def RepositoryIndex(self, request: messages.RepositoryIndexRequest,
                              context: Context) -> messages.RepositoryIndexResponse:
        return json_format.ParseDict({"models": repository.index(self._service.states,
                                                                 request.ready)},
                                     messages.RepositoryIndexResponse())

    async def RepositoryModelLoad(self, request: messages.RepositoryModelLoadRequest,
                                  context: Context) -> messages.RepositoryModelLoadResponse:
        await repository.load(self._service, request.model_name,
                              _parameters(request.parameters))
        return messages.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: messages.RepositoryModelUnloadRequest,
                                    context: Context) -> messages.RepositoryModelUnloadResponse:
        await repository.unload(self._service, request.model_name)
        return messages.RepositoryModelUnloadResponse()


def _restricted(method: Callable[[Any, Any], Awaitable[Any]], restrictions: Restrictions,
                category: str) -> Callable:
    """method, or if restrictions restrict category, method behind it: a call without
    the header (metadata) it requires raises ProtocolError (403)."""
    header = restrictions.header(category)
    if header is None:
        return method

    async def checked(request: Any, context: Any) -> Any:
        given = next((value for key, value in context.invocation_metadata() or ()
                      if key == header), None)
        refused = restrictions.refused(category, given)
        if refused:
            raise ProtocolError(refused, 403)
        return await method(request, context)

    return checked


def _answering(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable:
    """method, a ProtocolError it raises ending the RPC with the gRPC code of the
    error's status and its message.  The status is set, not raised (context.abort):
    grpcio keeps an abort's exception, whose frames hold the request, in a reference
    cycle that only the garbage collector frees (a gigabyte, for a large request)."""
    async def answer(request: Any, context: Any) -> Any:
        try:
            return await method(request, context)
        except ProtocolError as error:
            context.set_code(grpc.StatusCode[error.code] if error.code else
                             CODES.get(error.status, grpc.StatusCode.INTERNAL))
            context.set_details(str(error))
            return None  # (grpcio sends no message with a status that is not OK)
    return answer


async def _decoded(service: Server, request: messages.ModelInferRequest) -> InferRequest:
    """The request record of a ModelInferRequest to service, checked as an HTTP body's
    is: translated to the protocol's JSON form (typed contents as its data), raw
    contents as its binary data, and decoded by multipy.serve.request.inference.decode_apart
    (its size: the raw contents' bytes, and LENGTH_PREFIX for each typed value).
    ProtocolError (413) if its bytes_contents hold more elements than a body of
    service.max_request_size bytes holds as binary data, before any is read."""
    limit = service.max_request_size
    elements = sum(len(tensor.contents.bytes_contents) for tensor in request.inputs)
    if elements > limit // LENGTH_PREFIX:
        raise ProtocolError(f"the request's bytes_contents hold {elements} BYTES elements, "
                            f"which as binary data (a {LENGTH_PREFIX}-byte length each) take "
                            f"more than the {limit} bytes this server takes "
                            f"(--max-request-size)", 413)
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"the request has {len(raw)} raw_input_contents for "
                            f"{len(request.inputs)} inputs: give each input's, or none")
    inputs, values = [], 0
    for position, tensor in enumerate(request.inputs):
        spec: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype,
                                "shape": list(tensor.shape),
                                "parameters": _parameters(tensor.parameters)}
        inputs.append(spec)
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input {tensor.name!r} has both contents and "
                                    f"raw_input_contents")
            spec["parameters"]["binary_data_size"] = len(raw[position])
        else:
            spec["data"] = _contents(tensor)
            values += len(spec["data"])
    outputs = [{"name": output.name, "parameters": _parameters(output.parameters)}
               for output in request.outputs]
    translated = {"inputs": inputs, "outputs": outputs,
                  "parameters": _parameters(request.parameters)}
    if request.id:
        translated["id"] = request.id
    binary = memoryview(b"".join(raw))
    return await decode_apart(service, len(binary) + LENGTH_PREFIX * values, parse_request,
                              translated, binary)


def _contents(tensor: messages.ModelInferRequest.InferInputTensor) -> list:
    """The values of an input given as typed contents, from the field its datatype
    uses; ProtocolError if they are in another."""
    field = _CONTENTS.get(tensor.datatype)
    given = [field.name for field, _ in tensor.contents.ListFields()]
    if field is None or (given and given != [field]):
        where = f"in {field}" if field else "as raw_input_contents"
        raise ProtocolError(f"input {tensor.name!r}: {tensor.datatype} values go {where}, "
                            f"not in {', '.join(given)}")
    return list(getattr(tensor.contents, field))


def _parameters(parameters: Mapping[str, messages.InferParameter]) -> dict[str, Any]:
    """A parameters map's values as Python values."""
    return {key: getattr(value, value.WhichOneof("parameter_choice"))
            for key, value in parameters.items() if value.WhichOneof("parameter_choice")}


def _encoded(model_name: str, request_id: str | None, outputs: list[Tensor]) -> Any:
    """The ModelInferResponse of outputs, each as raw_output_contents."""
    return messages.ModelInferResponse(
        model_name=model_name, model_version="1", id=request_id or "",
        outputs=[messages.ModelInferResponse.InferOutputTensor(
            name=tensor.name, datatype=tensor.datatype, shape=list(tensor.array.shape))
            for tensor in outputs],
        raw_output_contents=[tensor_bytes(tensor) for tensor in outputs])
