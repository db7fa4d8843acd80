"""A Triton Python-backend model, inside one interpreter, run as Triton's Python backend
runs it: what ``multipy serve REPO/MODEL`` (or ``--model-repository REPO``) serves for
a model folder with a config.pbtxt and ``N/model.py`` (multipy.serve.host.triton_model).

``model.py`` is imported as a module of the model's own (multipy._inside.triton_imports:
the modules beside it that it imports are the model's own too;
``triton_python_backend_utils`` is this package's ``triton_utils``), its
``TritonPythonModel`` made with no arguments, and its ``initialize(args)``, if it has
one, called once with Triton's ``args`` (every value a string: ``model_config``, the
config as JSON, ``model_instance_kind``, ``model_instance_name``,
``model_instance_device_id``, ``model_repository``, ``model_version``, ``model_name``).
Each call gets the requests it answers, one or a batch's (``execute(requests)``, a list
of ``pb_utils.InferenceRequest``) and must return one ``InferenceResponse`` per request,
in order: each goes to its own client, its outputs or its error (a ``TritonError``,
whose code says the HTTP status and gRPC code). What ``execute`` raises goes to every
request of the call, as an internal error in Triton's words (logged, with its
traceback). ``execute`` may be ``async def``: it is awaited on the front end's event
loop. ``finalize()`` runs when the model is dropped: unloaded, or at the server's stop.

A decoupled model (``model_transaction_policy { decoupled: true }``) streams: its
``execute`` gets one request, runs on a thread of its own and returns None, and the
request's response sender (``triton_utils.InferenceResponseSender``, from that thread or
any other, during or after ``execute``) sends each response of the answer, a piece of
it (multipy._inside.pieces), then the final flag.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
import traceback
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from ..serve.request.messages import Answer, ProtocolError
from . import triton_imports, triton_utils
from .pieces import Pieces
from .serving import flat, output_array

#: (HTTP status, gRPC status name) of each TritonError code, as Triton answers them.
_STATUSES = {0: (400, "UNKNOWN"), 1: (500, "INTERNAL"), 2: (404, "NOT_FOUND"),
             3: (400, "INVALID_ARGUMENT"), 4: (503, "UNAVAILABLE"), 5: (501, "UNIMPLEMENTED"),
             6: (400, "ALREADY_EXISTS"), 7: (400, "CANCELLED")}
#: Parameters that the protocol's binary extension reads, which Triton keeps from models.
_PROTOCOL_PARAMETERS = {"binary_data_output", "binary_data_size"}
#: One request of a call, as the host gives it: (id, parameters, rows, outputs asked for).
Request = tuple[str | None, dict[str, Any], int, list[str] | None]
#: Seconds between a stream's looks at its queue of responses: where the wait blocks a
#: thread (with --timeout, the interpreter's call thread), a cancel lands between looks.
_LOOK = 0.1


def load(model_file: str, name: str, version: str, config: str, instance: int) -> ServedTriton:
    """The ``TritonPythonModel`` of model_file (of model name, at version, whose config is
    config, JSON) made and initialised as the instance-th instance (an interpreter's
    index); what importing it or ``initialize`` raises propagates."""
    triton_utils.install()
    module = triton_imports.load_module(name, model_file)
    kind = getattr(module, "TritonPythonModel", None)
    if not isinstance(kind, type):
        raise TypeError(f"{model_file} defines no class TritonPythonModel")
    parsed = json.loads(config)
    instance_kind = "GPU" if any(group["kind"] == "KIND_GPU"
                                 for group in parsed.get("instance_group", [])) else "CPU"
    model = kind()
    instance_name = f"{name}_0_{instance}"
    if callable(getattr(model, "initialize", None)):
        model.initialize({
            "model_config": config, "model_instance_kind": instance_kind,
            "model_instance_name": instance_name, "model_instance_device_id": "0",
            "model_repository": os.path.dirname(os.path.dirname(model_file)),
            "model_version": version, "model_name": name})
    return ServedTriton(model, name, version, parsed, instance_name)


def _declared(config: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The config's inputs or outputs (kind: "input", "output") as the protocol's
    metadata names them: -1 first where max_batch_size is above 0 (the batch)."""
    batch = [-1] if config.get("max_batch_size", 0) > 0 else []
    found = []
    for spec in config.get(kind, []):
        datatype = spec["data_type"].removeprefix("TYPE_")
        found.append({"name": spec["name"],
                      "datatype": "BYTES" if datatype == "STRING" else datatype,
                      "shape": batch + list(spec["dims"]),
                      **({"optional": True} if spec.get("optional") else {})})
    return found


class ServedTriton:
    """One Triton Python model in this interpreter, called as ``multipy._inside.serving.
    Served`` is, but per request: ``infer`` answers each request of the call on its own,
    ``stream`` a decoupled model's one request in pieces."""

    def __init__(self, model: Any, name: str, version: str, config: dict[str, Any],
                 instance_name: str) -> None:
        self.model = model
        self.name = name
        self.version = version
        self.config = config
        #: the instance's name, as Triton's errors name it (MODEL_0_N)
        self.instance_name = instance_name
        #: whether execute is a coroutine function: awaited, on the front end's loop
        self.asynchronous = inspect.iscoroutinefunction(model.execute)
        #: whether the model is decoupled: it answers in pieces, through response senders
        self.streams = triton_utils.using_decoupled_model_transaction_policy(config)
        self._finalized = False

    def infer(self, names: tuple[str, ...], datatypes: tuple[str, ...], *arrays: Any,
              requests: list[Request]) -> tuple:
        """Runs ``execute`` once on the requests whose inputs arrays hold (named names,
        of the datatypes; a batch's requests one after the other along the first
        dimension, each of its rows); returns (answers, *output arrays): one answer per
        request (a multipy.serve.request.messages.Answer, as a plain tuple), then the
        arrays of the outputs that each names, in order.  What execute raises, or a
        return that is not one InferenceResponse per request, is every request's error
        (500), in Triton's words.  An ``async def execute`` runs to its end here, on an
        event loop of its own."""
        run = self.infer_async(names, datatypes, *arrays, requests=requests)
        return asyncio.run(run) if self.asynchronous else _finished(run)

    async def infer_async(self, names: tuple[str, ...], datatypes: tuple[str, ...],
                          *arrays: Any, requests: list[Request]) -> tuple:
        """infer's, awaiting an ``async def execute`` on the running loop (the front
        end's)."""
        calls = self._requests(names, arrays, requests)
        try:
            responses = self.model.execute(calls)
            if self.asynchronous:
                responses = await responses
            return self._answers(calls, responses)
        except Exception as error:
            message = self._failure(error)
        return ((tuple(Answer(status=500, code="INTERNAL", message=message)),) * len(calls),)

    def stream(self, names: tuple[str, ...], datatypes: tuple[str, ...], *arrays: Any,
               requests: list[Request]) -> Pieces:
        """A decoupled model's answer to the one request of requests (see infer), in
        pieces: each step waits for the next response its sender sends, and gives its
        outputs (those the request asks for), as ``Served.infer`` gives them.  The first
        step starts ``execute`` on a thread of its own.  A response with an error ends the
        answer with it (ProtocolError, with its code's status), and so does what execute
        raises, or returns other than None, in Triton's words; the final flag ends it.
        Closed before then (its client went away), the request is cancelled."""
        return Pieces(self._responses(names, arrays, requests), flat)

    async def _responses(self, names: tuple[str, ...], arrays: tuple,
                         requests: list[Request]) -> AsyncIterator[list[tuple[str, str, Any]]]:
        """stream's source: each response's outputs, as the sender delivers them."""
        loop = asyncio.get_running_loop()
        delivered: asyncio.Queue = asyncio.Queue()

        def deliver(response: triton_utils.InferenceResponse | None) -> None:
            try:
                loop.call_soon_threadsafe(delivered.put_nowait, response)
            except RuntimeError:  # the loop has closed: the stream has ended with it
                pass

        sender = triton_utils.InferenceResponseSender(deliver)
        [call] = self._requests(names, arrays, requests, sender)
        threading.Thread(target=self._execute, args=(call, sender), daemon=True,
                         name=f"{self.instance_name} execute").start()
        ended = False
        try:
            while (response := await _next(delivered)) is not None:
                if response.has_error():
                    refused = _refused(response.error())
                    raise ProtocolError(refused.message, refused.status, refused.code)
                yield _outputs(call, response)
            ended = True
        finally:
            if not ended:
                sender.cancel()

    def _execute(self, call: triton_utils.InferenceRequest,
                 sender: triton_utils.InferenceResponseSender) -> None:
        """Runs a decoupled model's execute on call (an ``async def execute`` on an event
        loop of its own); what it raises, or returns other than None, ends the answer with
        an internal error, unless it has ended."""
        try:
            returned = self.model.execute([call])
            if inspect.iscoroutine(returned):
                returned = asyncio.run(returned)
            if returned is not None:
                raise _Returned(f"Python model '{self.name}' is using the decoupled mode and "
                                f"the execute function must return None.")
        except Exception as error:
            failed = triton_utils.InferenceResponse(error=triton_utils.TritonError(
                self._failure(error)))
            try:
                sender.send(failed, triton_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except triton_utils.TritonModelException:  # (its answer had ended)
                pass

    def _failure(self, error: Exception) -> str:
        """What a call of execute that raised error (or returned wrong: _Returned) answers,
        in Triton's words; logged, with the traceback of what execute raised."""
        if isinstance(error, _Returned):
            reason, where = str(error), ""
        else:
            reason = f"{type(error).__name__}: {error}"
            where = "\n" + "".join(traceback.format_exception(error)).rstrip()
        message = (f"Failed to process the request(s) for model instance "
                   f"'{self.instance_name}', message: {reason}")
        triton_utils.Logger.log_error(message + where)
        return message

    def _requests(self, names: tuple[str, ...], arrays: tuple, requests: list[Request],
                  sender: triton_utils.InferenceResponseSender | None = None
                  ) -> list[triton_utils.InferenceRequest]:
        """The InferenceRequests that execute gets for requests (see infer); sender: the
        one request's response sender (a decoupled model's)."""
        calls = []
        start = 0
        for request_id, parameters, rows, outputs in requests:
            inputs = [triton_utils.Tensor(name, array if len(requests) == 1 else
                                          array[start:start + rows])
                      for name, array in zip(names, arrays)]
            start += rows
            asked = outputs or [spec["name"] for spec in self.config.get("output", [])]
            own = {key: value for key, value in (parameters or {}).items()
                   if key not in _PROTOCOL_PARAMETERS}
            calls.append(triton_utils.InferenceRequest(
                inputs, request_id or "", 0, asked, triton_utils.parameters_text(own),
                self.name, sender))
        return calls

    def _answers(self, calls: list[triton_utils.InferenceRequest], responses: Any) -> tuple:
        """infer's answers, from execute's responses to calls, each response's outputs
        those its request asks for (the others dropped, as Triton does); _Returned
        unless responses is a list of one InferenceResponse per request."""
        _check_returned(calls, responses)
        answers: list[tuple] = []
        arrays: list[Any] = []
        for call, response in zip(calls, responses):
            if response.has_error():
                answers.append(tuple(_refused(response.error())))
                continue
            found = _outputs(call, response)
            answers.append(tuple(Answer(tuple(name for name, _, _ in found),
                                        tuple(datatype for _, datatype, _ in found))))
            arrays.extend(array for _, _, array in found)
        return (tuple(answers), *arrays)

    def metadata(self) -> dict[str, Any]:
        """The config's inputs and outputs (requests are checked against the inputs),
        the version served, and how requests are batched: [rows, seconds] with
        ``dynamic_batching`` (its largest preferred_batch_size, else max_batch_size;
        max_queue_delay_microseconds), else None, each request a call of its own; and
        the most rows a request may have (max_batch_size, as Triton checks it), or None."""
        config = self.config
        dynamic = config.get("dynamic_batching")
        batching = None
        if dynamic is not None and config.get("max_batch_size", 0) > 1:
            rows = max(dynamic.get("preferred_batch_size") or [config["max_batch_size"]])
            batching = [max(2, min(rows, config["max_batch_size"])),
                        dynamic.get("max_queue_delay_microseconds", 0) / 1e6]
        return {"inputs": _declared(config, "input"), "outputs": _declared(config, "output"),
                "declared": True, "platform": "python", "versions": [self.version],
                "per_request": True, "batching": batching,
                "max_rows": config.get("max_batch_size", 0) or None,
                **({"streams": True} if self.streams else {})}

    def warm_up(self) -> None:
        """Nothing: initialize has run."""

    def forget(self) -> None:
        """Runs the model's ``finalize()``, once, if it has one."""
        if not self._finalized:
            self._finalized = True
            if callable(getattr(self.model, "finalize", None)):
                self.model.finalize()


class _Returned(Exception):
    """What execute returned is not what Triton takes (its message is Triton's)."""


def _check_returned(calls: list[triton_utils.InferenceRequest], responses: Any) -> None:
    """_Returned, in Triton's words, unless responses is a list of one InferenceResponse
    per request of calls."""
    if not isinstance(responses, list):
        raise _Returned(f"Expected a list in the execute return, found type "
                        f"'{type(responses)}'.")
    if len(responses) != len(calls):
        raise _Returned(f"Number of InferenceResponse objects do not match the number of "
                        f"InferenceRequest objects. InferenceRequest(s) size is:{len(calls)}, "
                        f"and InferenceResponse(s) size is:{len(responses)}")
    for response in responses:
        if not isinstance(response, triton_utils.InferenceResponse):
            raise _Returned(f"Expected an 'InferenceResponse' object in the execute "
                            f"function return list, found type '{type(response)}'.")


def _refused(error: triton_utils.TritonError) -> Answer:
    """The answer of a response with error: the HTTP status and gRPC code of its code."""
    status, code = _STATUSES.get(error.code(), (500, "INTERNAL"))
    return Answer(status=status, code=code, message=str(error.message()))


def _outputs(call: triton_utils.InferenceRequest, response: triton_utils.InferenceResponse
             ) -> list[tuple[str, str, Any]]:
    """response's outputs that call asks for (the others dropped, as Triton does), each
    (name, datatype, array)."""
    asked = set(call.requested_output_names())
    return [(tensor.name(), *output_array(None, tensor.name(), tensor.as_numpy(), set()))
            for tensor in response.output_tensors() if tensor.name() in asked]


async def _next(delivered: asyncio.Queue) -> Any:
    """The next item of delivered, looked for every _LOOK seconds."""
    while True:
        try:
            return await asyncio.wait_for(delivered.get(), _LOOK)
        except asyncio.TimeoutError:
            continue


def _finished(run: Coroutine[Any, Any, tuple]) -> tuple:
    """What run (infer_async's, for an execute that is not async: it never waits)
    returns, run to its end here."""
    try:
        run.send(None)
    except StopIteration as done:
        return done.value
    run.close()
    raise RuntimeError("execute waited, but is not an async def")
