"""The seams of ``multipy serve``, typed: what the request path (multipy.serve.http.app, rpc,
inference, repository) asks of the server it answers for (``Server``: the host's
multipy.serve.host.service.Service, or an interpreter's front end, multipy._inside.front_end.
FrontEnd), and the host's calls of a front end through its handle (``FrontEndCalls``),
each method named once, here, so that a rename is caught (tests/test_layers.py checks
them against FrontEnd) and found.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
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


class FrontEndCalls:
    """The host's calls of one interpreter's front end (a FrontEnd, through front, its
    multipy.session.Obj), each run in that interpreter on the calling thread."""

    def __init__(self, front: Any) -> None:
        self._front = front

    def run(self) -> None:
        """Serves until told to stop (FrontEnd.run)."""
        self._front.call_value("run")

    def wait_serving(self, timeout: float) -> bool:
        return self._front.call_value("wait_serving", (timeout,))

    def add_model(self, name: str, served: Any, described: dict) -> None:
        self._front.call_value("add_model", (name, served, described))

    def set_state(self, name: str, state: str, reason: str) -> None:
        self._front.call_value("set_state", (name, state, reason))

    def control_request(self, number: int) -> tuple | None:
        return self._front.call_value("control_request", (number,))

    def control_answer(self, number: int, status: int, message: str) -> None:
        self._front.call_value("control_answer", (number, status, message))
