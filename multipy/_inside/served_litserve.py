"""A ``litserve.LitAPI`` subclass, inside one interpreter, run as LitServe 0.2's server
runs it: what ``multipy serve FILE.py:CLASS`` serves when CLASS subclasses ``LitAPI``.

The class is made with no arguments; ``pre_setup()`` and ``setup(device)`` run once,
then ``device`` is set, as LitServe's worker does.  Each request's JSON goes through the
API's own ``decode_request``, ``predict`` and ``encode_response`` (LitServe's defaults
where it does not override them), each given ``context`` (a dict per request) if it
takes one.  With ``--max-batch-size`` over 1 (else the API's own ``max_batch_size``),
the requests of a call go through ``batch``, one ``predict`` and ``unbatch``, as
LitServe's batching loop does.

Two ways in (multipy.serve.request.litserve): LitServe's own, a body per row of the
BYTES input REQUEST, answered per row with the HTTP status and the JSON body
(``HTTPException`` -> its status and ``{"detail": ...}``, as LitServe answers); or the
Open Inference Protocol's, where a request of n rows is n LitServe requests, row i of
input NAME being field NAME of request i (a number, or a list for a row of several
values), and each encoded response (a dict) gives row i of the output of each of its
keys (one that is not a dict: of output ``output``).  A request that ``decode_request``
refuses with ``HTTPException`` fails alone; an ``HTTPException`` in ``batch``,
``predict`` or ``unbatch`` fails the call's requests with its status, and any other
exception in a hook fails them all (a batch's too) with a 500, as in LitServe (logged,
with the traceback, by the request path).
"""
from __future__ import annotations

import inspect
import json
import logging
import sys
import typing
from typing import Any, Iterator

from ..serve.request.litserve import API_PATH, BODY, REQUEST, STATUS
from ..serve.request.messages import ProtocolError
from .pieces import Pieces
from .served_class import own_health
from .serving import flat, named_outputs, raise_plainly

logger = logging.getLogger("multipy.serve")

#: What an answer's JSON is written as: FastAPI's JSONResponse's
_JSON = {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":")}


def is_lit_api(kind: type) -> bool:
    """Whether kind subclasses ``litserve.LitAPI`` (false where litserve was not
    imported)."""
    module = sys.modules.get("litserve.api")
    return module is not None and issubclass(kind, module.LitAPI)


def load(kind: type, device: str, max_batch_size: int) -> ServedLitAPI:
    """An instance of kind, a ``LitAPI`` subclass, set up on device as LitServe's worker
    sets it up, batching as max_batch_size (--max-batch-size) says where it is over 1,
    else as the API's own ``max_batch_size`` and ``batch_timeout`` (its ``__init__``'s)
    say.  TypeError for what this server does not serve: a spec (OpenAISpec, say),
    streaming, enable_async."""
    instance = kind()
    described = f"{kind.__module__}.{kind.__qualname__}"
    for refused, what in ((instance.spec is not None, "a spec"),
                          (instance.stream and (max_batch_size > 1 or instance.max_batch_size > 1),
                           "streaming (stream=True) with batching"),
                          (getattr(instance, "enable_async", False), "enable_async=True")):
        if refused:
            raise TypeError(f"{described} uses {what}, which multipy serve does not serve: "
                            f"it serves LitAPIs that answer each request with one JSON value, "
                            f"or stream one request's (stream=True, without batching)")
    own = max_batch_size <= 1 and instance.max_batch_size > 1
    if not own:
        instance.max_batch_size = max_batch_size
    instance.pre_setup()
    instance.setup(device)
    instance.device = device
    return ServedLitAPI(instance, own)


class ServedLitAPI:
    """One LitAPI in this interpreter, called as ``multipy._inside.serving.Served`` is."""

    def __init__(self, instance: Any, own_batching: bool = False) -> None:
        from starlette.exceptions import HTTPException  # (fastapi's: a subclass)

        try:
            from fastapi.encoders import jsonable_encoder
        except ImportError:  # (litserve requires fastapi; an API may still run without)
            jsonable_encoder = None
        self.instance = instance
        self.asynchronous = False
        #: whether it answers in pieces (stream=True: predict and encode_response yield)
        self.streams = bool(instance.stream)
        self._http_error = HTTPException
        self._encodable = jsonable_encoder
        self._batched = instance.max_batch_size > 1
        #: whether the API's own max_batch_size batches it (no --max-batch-size)
        self._own_batching = own_batching
        self._takes_context: dict[str, bool] = {}
        #: the pydantic model that decode_request's request is annotated with, if any
        self._request_model = _pydantic_model(instance.decode_request)

    def _hook(self, name: str, context: Any, *args: Any) -> Any:
        """The API's method name called on args, given context if it takes one."""
        method = getattr(self.instance, name)
        takes = self._takes_context.get(name)
        if takes is None:
            takes = self._takes_context[name] = \
                "context" in inspect.signature(method).parameters
        return method(*args, context=context) if takes else method(*args)

    def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
              ) -> tuple:
        """The answers to the requests the arrays hold (see the module's docstring), as
        ``Served.infer`` gives them; ProtocolError for a v2 request the API refuses (its
        HTTPException's status); what the API raised, as ``raise_plainly`` raises it."""
        try:
            return self._answers(names, arrays)
        except ProtocolError:
            raise
        except Exception as error:
            raise_plainly(error)

    def stream(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
               ) -> Pieces:
        """The pieces of the answer to the one request the arrays hold, for an API with
        stream=True, whose predict and encode_response are generators: each encoded
        response is one piece, as LitServe sends it (``format_encoded_response``: a dict
        as a line of JSON) on LitServe's route, as outputs (``infer``'s) on the
        protocol's.  A request refused before its first piece (HTTPException) is one
        piece, its error answer, on LitServe's route; after it, a ProtocolError."""
        return Pieces(self._pieces(names, arrays), lambda piece: piece)

    def _pieces(self, names: tuple[str, ...], arrays: tuple) -> Iterator[tuple]:
        own = names == (REQUEST,)
        if own:
            request = self._parsed(arrays[0][0])
        else:
            if not arrays or arrays[0].ndim == 0 or len(arrays[0]) != 1:
                raise ProtocolError(f"{type(self.instance).__qualname__} streams its answer to "
                                    f"one request at a time: give each input one row")
            request = {name: _value(array[0]) for name, array in zip(names, arrays)}
        sent = False
        try:
            context: dict = {}
            if isinstance(request, _Refused):
                raise request
            if self._request_model is not None:
                request = self._validated(request)
            x = self._hook("decode_request", context, request)
            for output in self._hook("encode_response", context,
                                     self._hook("predict", context, x)):
                yield self._piece(own, output)
                sent = True
        except (self._http_error, _Refused) as error:
            status, detail = (error.status, error.detail) if isinstance(error, _Refused) \
                else (error.status_code, error.detail)
            if sent or not own:
                raise ProtocolError(str(detail), status) from None
            yield _own_answer(status, json.dumps({"detail": detail}, **_JSON).encode())

    def _piece(self, own: bool, output: Any) -> tuple:
        """One encoded response as a piece: LitServe's line on its route, else outputs."""
        if own:
            line = self.instance.format_encoded_response(output)
            if not isinstance(line, (str, bytes)):
                line = json.dumps(self._encoded(line)) + "\n"
            return _own_answer(200, line.encode() if isinstance(line, str) else line)
        outputs = named_outputs(sys.modules.get("torch"), output if isinstance(output, dict)
                                else {"output": output}, set())
        return flat(outputs)

    def _answers(self, names: tuple[str, ...], arrays: tuple) -> tuple:
        import numpy

        if names == (REQUEST,):
            return _own_answer(*zip(*[(status, json.dumps(value, **_JSON).encode())
                                      for status, value in self._serve(
                                          [self._parsed(body) for body in arrays[0]])]))
        rows = len(arrays[0]) if arrays and arrays[0].ndim else 0
        requests = [{name: _value(array[i]) for name, array in zip(names, arrays)}
                    for i in range(rows)]
        columns: dict[str, list] = {}
        for status, value in self._serve(requests):
            if status != 200:
                raise ProtocolError(str(value["detail"]), status)
            for key, each in (value if isinstance(value, dict) else {"output": value}).items():
                columns.setdefault(str(key), []).append(each)
        outputs = named_outputs(sys.modules.get("torch"), {
            key: values if all(isinstance(v, (str, bytes)) for v in values)
            else numpy.asarray(values) for key, values in columns.items()}, set())
        return flat(outputs)

    def _parsed(self, body: bytes) -> Any:
        """The JSON value of a request's body, or the 400 answer to one that is not."""
        try:
            return json.loads(body)
        except ValueError as error:  # (JSONDecodeError, UnicodeDecodeError)
            return _Refused(400, f"malformed JSON in the request: {error}")

    def _serve(self, requests: list[Any]) -> list[tuple[int, Any]]:
        """(status, encoded response, or {"detail": ...}) for each request, through the
        API's hooks; what they raise but HTTPException, raised."""
        answers: list[tuple[int, Any] | None] = [None] * len(requests)
        decoded: dict[int, tuple[Any, dict]] = {}
        for i, request in enumerate(requests):
            if isinstance(request, _Refused):
                answers[i] = request.answer()
                continue
            context: dict = {}
            try:
                if self._request_model is not None:
                    request = self._validated(request)
                decoded[i] = (self._hook("decode_request", context, request), context)
            except self._http_error as error:
                answers[i] = _Refused(error.status_code, error.detail).answer()
            except _Refused as refused:  # (its pydantic model's)
                answers[i] = refused.answer()
        if decoded:
            inputs = [x for x, _ in decoded.values()]
            contexts = [context for _, context in decoded.values()]
            try:
                outputs = self._predict(inputs, contexts)
                for i, output, context in zip(decoded, outputs, contexts):
                    answers[i] = (200, self._encoded(
                        self._hook("encode_response", context, output)))
            except self._http_error as error:
                for i in decoded:
                    answers[i] = _Refused(error.status_code, error.detail).answer()
        return answers

    def _validated(self, request: Any) -> Any:
        """request as the pydantic model that decode_request takes; _Refused, as FastAPI
        answers a body the model refuses (422, each error located in the body)."""
        from pydantic import ValidationError

        try:
            return self._request_model.model_validate(request)
        except ValidationError as error:
            raise _Refused(422, self._encoded([
                {**each, "loc": ["body", *each["loc"]]}
                for each in error.errors(include_url=False)])) from None

    def _predict(self, inputs: list[Any], contexts: list[dict]) -> list[Any]:
        """predict's output for each input: through batch and unbatch when batching,
        else one by one.  HTTPException(500, "Batch size mismatch"), as LitServe's, if
        unbatch gives another number of outputs (logged, with the numbers)."""
        if not self._batched:
            return [self._hook("predict", context, x) for x, context in zip(inputs, contexts)]
        outputs = list(self._hook("unbatch", contexts, self._hook(
            "predict", contexts, self._hook("batch", contexts, inputs))))
        if len(outputs) != len(inputs):
            logger.error("%s: predict and unbatch gave %d outputs for a batch of %d "
                         "requests: predict must return one output per input of the batch",
                         type(self.instance).__qualname__, len(outputs), len(inputs))
            raise self._http_error(500, "Batch size mismatch")
        return outputs

    def _encoded(self, value: Any) -> Any:
        """value as FastAPI makes a response of it (pydantic models and the like: JSON)."""
        return value if self._encodable is None else self._encodable(value)

    async def healthy(self) -> bool:
        """The API's ``health()`` (awaited if async), as LitServe's /health asks it."""
        return await own_health(self.instance.health)

    def metadata(self) -> dict[str, Any]:
        """No declared inputs or outputs; a health check of its own ("own_health"); the
        path its LitServe requests come on; and its own batching ([rows, seconds]) where
        the API sets it and --max-batch-size does not."""
        own = {"batching": [self.instance.max_batch_size, self.instance.batch_timeout]} \
            if self._own_batching else {}
        streaming = {"streams": True} if self.streams else {}
        return {"inputs": [], "outputs": [], "platform": "python", "own_health": True,
                API_PATH: self.instance.api_path, **own, **streaming}

    def warm_up(self) -> None:
        """Nothing: setup() has run."""

    def forget(self) -> None:
        """Nothing is kept for good beyond the module, which stays imported."""


class _Refused(Exception):
    """A request's error answer: status and ``{"detail": detail}``, as LitServe's (raised
    for a request its pydantic model refuses)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(status, detail)
        self.status, self.detail = status, detail

    def answer(self) -> tuple[int, dict]:
        return self.status, {"detail": self.detail}


def _pydantic_model(method: Any) -> type | None:
    """The pydantic model that method's parameter ``request`` is annotated with, if it
    is one (FastAPI then validates the body against it, as LitServe registers it)."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None:
        return None
    try:
        kind = typing.get_type_hints(method).get("request")
    except Exception:  # (a forward reference that does not resolve: no model)
        return None
    return kind if inspect.isclass(kind) and issubclass(kind, pydantic.BaseModel) else None


def _own_answer(statuses: Any, bodies: Any) -> tuple:
    """The outputs of the answers on LitServe's route: each request's status (an int, or
    a sequence of them, one per request) and JSON body (bytes, or a sequence)."""
    import numpy

    if isinstance(bodies, bytes):
        statuses, bodies = (statuses,), (bodies,)
    found = numpy.empty(len(bodies), dtype=object)
    found[:] = list(bodies)
    return (STATUS, BODY), ("INT32", "BYTES"), numpy.array(statuses, dtype=numpy.int32), found


def _value(row: Any) -> Any:
    """A row of a v2 input as a JSON value: a number (or str, for BYTES), or a list."""
    value = row.tolist() if hasattr(row, "tolist") else row
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return [_value(each) for each in value] if isinstance(value, list) else value

