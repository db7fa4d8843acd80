"""A ``kserve.Model`` subclass, inside one interpreter, run as KServe's own model server
runs it for the v2 protocol (KServe 0.21's ``ModelServer`` and ``DataPlane.infer``):
what ``multipy serve FILE.py:CLASS`` serves when CLASS subclasses ``kserve.Model``.

The class is made with the model's served name, its ``load()`` (or an ``async`` one)
runs once, and it must leave ``ready`` true, as KServe refuses a model that is not ready;
then its ``start()`` runs.  Afterwards the model is ready while its ``healthy()`` (sync or
async; KServe's returns ``ready``) returns true, as KServe's model readiness says.
Each request becomes a ``kserve.InferRequest`` (the model's name, one ``InferInput`` per
input over its numpy array, BYTES as an array of dtype object holding bytes; the
request's id and parameters, but under ``--max-batch-size``, where a call may hold
several requests) and goes through the model's own ``__call__``, as KServe's data plane
calls it: ``preprocess`` -> ``validate`` -> ``predict`` ->
``postprocess``, each sync or async, with headers ``{}``.  What it returns, an
``InferResponse`` or a dict in the protocol's shape (``{"outputs": [{"name", "datatype",
"shape", "data"}]}``), becomes the outputs, of the datatypes it names.  KServe's
``InvalidInput`` is a 400 with its message, as in KServe; anything else a 500.  The
metadata names the inputs and outputs of ``get_input_types()`` and
``get_output_types()``; as in KServe, requests are not checked against them.

kserve is never imported here: a class that subclasses ``kserve.Model`` has imported it.
"""
from __future__ import annotations

import asyncio
import inspect
import sys
from typing import Any

from ..serve.request.messages import InvalidInput
from .served_class import ServedClass, own_health
from .serving import declaration


def is_kserve_model(kind: type) -> bool:
    """Whether kind subclasses ``kserve.Model`` (false where kserve was not imported)."""
    module = sys.modules.get("kserve.model")
    return module is not None and issubclass(kind, module.Model)


def load(kind: type, name: str) -> ServedKServeModel:
    """An instance of kind, a ``kserve.Model`` subclass, named name, loaded and started
    as ``kserve.ModelServer`` takes it; RuntimeError if ``load()`` left it not ready."""
    instance = kind(name)
    _run(instance.load())
    if not instance.ready:
        raise RuntimeError(f"{kind.__module__}.{kind.__qualname__}.load() left the model not "
                           f"ready: set self.ready = True once it is loaded (KServe's "
                           f"ModelServer refuses it too)")
    instance.start()
    where = f"{kind.__module__}.{kind.__qualname__}.get_input_types() and get_output_types()"
    declared = {"inputs": _run(instance.get_input_types()) or [],
                "outputs": _run(instance.get_output_types()) or []}
    return ServedKServeModel(instance, declaration(declared, where))


def _run(value: Any) -> Any:
    """value, or what it returns if it is a coroutine (an async method's call), run on
    an event loop of its own (none runs while models load)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class ServedKServeModel(ServedClass):
    """One ``kserve.Model`` in this interpreter, served as ServedClass serves a class
    (its calls always async, as KServe's ``Model.__call__`` is)."""

    def __init__(self, instance: Any, declared: dict[str, list[dict]]) -> None:
        super().__init__(instance, None)
        from kserve.errors import InvalidInput as KServeInvalidInput
        from kserve.protocol import infer_type

        self.types = infer_type
        self.invalid = KServeInvalidInput
        self.declared = declared
        self.asynchronous = True
        self.streams = False  # (a predict that yields KServe's streamed answer: not served)

    def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any,
              request: tuple[str | None, dict[str, Any]] | None = None) -> tuple:
        """infer_async's, run to its end on an event loop of its own (on a thread where
        none runs)."""
        return asyncio.run(self.infer_async(names, datatypes, *arrays, request=request))

    async def infer_async(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                          *arrays: Any, request: tuple[str | None, dict[str, Any]] | None = None
                          ) -> tuple:
        """The outputs (as ``Served.infer`` gives them) of the model's ``__call__`` on an
        InferRequest of the arrays, named names, of the datatypes, with request's (id,
        parameters) when the call holds one request (none for a batch's)."""
        outputs = await self._guarded(self._call(names, datatypes, arrays, request))
        return self._answer(lambda: outputs)

    async def _call(self, names: tuple[str, ...], datatypes: tuple[str, ...], arrays: tuple,
                    request: tuple[str | None, dict[str, Any]] | None) -> dict[str, Any]:
        types = self.types
        request_id, parameters = request or (None, None)
        payload = types.InferRequest(
            self.instance.name,
            [types.InferInput(name, list(array.shape), datatype, data=array)
             for name, datatype, array in zip(names, datatypes, arrays)],
            request_id=request_id, parameters=parameters)
        try:
            response, _ = await self.instance(payload, headers={})
            if isinstance(response, dict):
                if not isinstance(response.get("outputs"), list):
                    raise TypeError(f"model {self.instance.name!r} answered a dict without a "
                                    f'list "outputs": the v2 protocol\'s response, or an '
                                    f"InferResponse")
                response = types.InferResponse.from_rest(response)
            if not isinstance(response, types.InferResponse):
                raise TypeError(f"model {self.instance.name!r} answered a "
                                f"{type(response).__name__}, not an InferResponse or a dict")
            return {output.name: output.as_numpy() for output in response.outputs}
        except self.invalid as error:  # the client's fault, as KServe says
            raise InvalidInput(str(error)) from None

    async def healthy(self) -> bool:
        """The model's ``healthy()`` (sync or async), as KServe's model readiness asks it."""
        return await own_health(self.instance.healthy)

    def metadata(self) -> dict[str, Any]:
        """The inputs and outputs the model's get_input_types() and get_output_types()
        give (not checked against requests, as in KServe); each call gets its request's
        id and parameters; it has a health check of its own ("own_health")."""
        return {**self.declared, "platform": "python", "wants_request": True,
                "own_health": True}
