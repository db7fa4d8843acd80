"""The seams of ``multipy serve``, typed: what the request path (multipy.serve.http.app, rpc,
inference, repository) asks of the server it answers for (``Server``: the host's
multipy.serve.host.service.Service, or an interpreter's front end, multipy._inside.front_end.
FrontEnd), what the host tells a front end as it makes it (``FrontEndSettings``), the
host's calls of a front end through its handle (``FrontEndCalls``) and of a model loaded
in every interpreter (``ServedCalls``), each method named once, here, so that a rename
is caught (tests/test_layers.py checks them against the classes inside) and found.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol

if TYPE_CHECKING:
    from ...replicated import ReplicatedObj
    from ...session import Interpreter, Obj
    from ..http.connection import Limits
    from .metrics import Metrics
    from .requests import ModelRequests


class Server(Protocol):
    """What a server gives the request path."""

    #: whether it answers (its models are loaded)
    ready: bool
    #: each model's (state, reason), multipy.serve.request.repository's
    states: Mapping[str, tuple[str, str]]
    metrics: Metrics
    #: --max-request-size, bytes
    max_request_size: int
    #: --model-control
    model_control: str
    #: --strict-readiness (multipy.serve.request.repository.not_ready)
    strict_readiness: bool
    #: --http-restricted-api and --grpc-restricted-protocol: (category, KEY, VALUE) of
    #: each restricted category (multipy.serve.request.restricted)
    http_restricted: tuple[tuple[str, str, str], ...]
    grpc_restricted: tuple[tuple[str, str, str], ...]

    def model(self, name: str, version: str | None = None) -> ModelRequests | None:
        """The model called name, None while it loads; ProtocolError (404) if unknown."""

    async def load(self, name: str, archive: dict[str, str]) -> None:
        """Loads model name (multipy.serve.request.repository.load)."""

    async def unload(self, name: str) -> None:
        """Unloads model name (multipy.serve.request.repository.unload)."""

    async def drain(self) -> None:
        """Runs what waits in the batchers, and waits for it (at shutdown)."""


@dataclass(frozen=True)
class FrontEndSettings:
    """What one interpreter's front end is made with (it crosses into the interpreter
    pickled): the server's options, where its metrics and pipes are, and its models."""

    names: tuple[str, ...]  #: every model, in the server's order
    described: dict[str, dict]  #: name -> the model's metadata
    #: each model's (state, reason), multipy.serve.request.repository's
    states: dict[str, tuple[str, str]]
    interpreters: int  #: of this process
    board: int  #: the address of the metrics board (multipy.serve.request.metrics)
    rows: int  #: the board's rows
    first: int  #: this process's first row
    processes: int  #: how many processes serve (--processes)
    cores: int | None  #: the cores the server's processes may run on (Metrics.cores)
    slots: int  #: the metrics' room for models
    stuck_after: float  #: seconds (multipy.serve.request.metrics.Metrics.stuck)
    max_batch_size: int
    batch_delay: float  #: seconds
    timeout: float | None  #: --timeout, seconds
    max_request_size: int  #: bytes
    limits: Limits  #: what a connection may send
    graceful_timeout: float | None  #: seconds
    grpc: str | None  #: the "HOST:PORT" its gRPC server shares with the others', if any
    model_control: str
    strict_readiness: bool
    #: as ``Server`` has them
    http_restricted: tuple[tuple[str, str, str], ...]
    grpc_restricted: tuple[tuple[str, str, str], ...]
    refused: int | None  #: the address of the table of refused inputs, if any
    row: int = 0  #: this front end's row of the board (its interpreter's, from 1)
    inbox: int = -1  #: the read end of its inbox (multipy.serve.http.inbox), the host's
    control: int = -1  #: the write end of its control pipe (multipy.serve.host.control)
    #: the server's listening socket, on which it accepts connections itself (-1: none;
    #: they come through its inbox), from the start if accepting, else once told (ACCEPT)
    listener: int = -1
    accepting: bool = True
    #: the write end of the host's pipe for the connections it gives back (the inbox's
    #: messages: multipy.serve.http.inbox)
    given_back: int = -1


class FrontEndCalls:
    """The host's calls of one interpreter's front end (a FrontEnd, through front, its
    multipy.session.Obj), each run in that interpreter on the calling thread."""

    def __init__(self, front: Obj) -> None:
        self._front = front

    def run(self) -> None:
        """Serves until told to stop (FrontEnd.run)."""
        self._front.call_value("run")

    def wait_serving(self, timeout: float) -> bool:
        return self._front.call_value("wait_serving", (timeout,))

    def add_model(self, name: str, served: Obj, described: dict) -> None:
        self._front.call_value("add_model", (name, served, described))

    def set_state(self, name: str, state: str, reason: str) -> None:
        self._front.call_value("set_state", (name, state, reason))

    def control_request(self, number: int) -> tuple | None:
        return self._front.call_value("control_request", (number,))

    def control_answer(self, number: int, status: int, message: str) -> None:
        self._front.call_value("control_answer", (number, status, message))


class ServedCalls:
    """The host's calls of one model as each interpreter has loaded it (a
    multipy._inside.serving.Served, or a class's: multipy._inside.served_class and its
    kinds), through replicated, the multipy.replicated.ReplicatedObj of them."""

    def __init__(self, replicated: ReplicatedObj) -> None:
        self._replicated = replicated

    def warm_up(self, interpreter: Interpreter) -> None:
        """Runs the model once in interpreter, if it has an example to run."""
        self._replicated.instance(interpreter).call_value("warm_up")

    def metadata(self, interpreter: Interpreter) -> dict:
        """The model's inputs and outputs, as interpreter has loaded it."""
        return self._replicated.instance(interpreter).call_value("metadata")

    def forget(self, interpreter: Interpreter) -> None:
        """Has interpreter let go of what the process keeps of the model for good."""
        self._replicated.instance(interpreter).call_value("forget")

    async def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                    *arrays: object, **given: object) -> tuple:
        """The model's outputs for arrays, in a free interpreter (``Served.infer``)."""
        return await self._replicated.acall_method("infer", names, datatypes, *arrays,
                                                   **given)

    def stream(self, interpreter: Interpreter, names: tuple[str, ...] | None,
               datatypes: tuple[str, ...], *arrays: object, **given: object) -> Obj:
        """The model's answer for arrays in pieces (a multipy._inside.pieces.Pieces), to be
        made in interpreter, which the caller holds (``Served.stream``: none of the
        model's code has run yet); the host steps it through
        multipy.serve.host.models.PiecesCalls."""
        return self._replicated.instance(interpreter).attr("stream")(
            names, datatypes, *arrays, **given)
