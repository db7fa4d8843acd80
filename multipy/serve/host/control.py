"""The host's side of the model repository's requests that the interpreters' front ends
receive (multipy.serve.request.repository): a front end cannot load a model into the other
interpreters, so it asks the host, through a control pipe of its own (the int32
messages of multipy.serve.http.inbox, each a request's number), and waits for the answer.

``Control`` reads the pipes on a thread of its own, fetches each request from its front
end, has the service do it (multipy.serve.host.service.Service.load_now, unload_now: one at a
time) and answers; as the service's watcher, it tells every front end what changed.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
from typing import TYPE_CHECKING, Callable, Protocol

from ..._parallel import on_each
from ..http.inbox import receive
from ..request.contract import FrontEndCalls
from ..request.messages import ProtocolError

if TYPE_CHECKING:
    from ...session import Interpreter
    from .models import ServedModel
    from .service import Service

logger = logging.getLogger("multipy.serve")

#: The most characters of a repository request's answer (it may quote a path).
MESSAGE_CHARACTERS = 10_000
#: The most seconds a request waits for the server to become ready (its front ends
#: serve while the last of them start).
_READY_WAIT = 60.0


class Watcher(Protocol):
    """Told of the model repository's changes (Service.watch)."""

    def added(self, name: str, model: ServedModel) -> None:
        """Model name is loaded on every interpreter, as model."""

    def changed(self, name: str, state: str, reason: str) -> None:
        """Model name is no longer ready (state, for reason)."""


class Repository(Protocol):
    """What does the model repository's requests: the service itself, or in a process of
    --processes every process (multipy.serve.processes.supervised.Supervised)."""

    def load_now(self, name: str, archive: dict[str, str]) -> None:
        """Loads model name (Service.load_now); ProtocolError as it fails."""

    def unload_now(self, name: str) -> None:
        """Unloads model name (Service.unload_now); ProtocolError as it fails."""


def do(repository: Repository, what: str, name: str, archive: dict[str, str] | None = None
       ) -> tuple[int, str]:
    """(status, message) of having repository load model name (what "load", from
    archive) or unload it: (200, "") done; a ProtocolError's status and message; 500 for
    multipy's own failure, which is logged whole.  The message has at most
    MESSAGE_CHARACTERS characters."""
    try:
        if what == "load":
            repository.load_now(name, archive or {})
        else:
            repository.unload_now(name)
        return 200, ""
    except ProtocolError as error:
        return error.status, str(error)[:MESSAGE_CHARACTERS]
    except Exception as error:
        logger.exception("the model repository's request failed")
        return 500, f"internal error: {type(error).__name__}: {error}"[:MESSAGE_CHARACTERS]


class Control:
    """The control pipes (pipes: (read end, write end) of each) of fronts (the FrontEnd
    objects, each in its interpreter of interpreters) for service.  ``start`` reads them
    on a thread until ``close``, which closes them.  The requests are done by
    repository's ``load_now`` and ``unload_now``: the service's own (the default), or,
    in a process of --processes, every process's (multipy.serve.processes.supervised)."""

    def __init__(self, service: Service, fronts: list[FrontEndCalls],
                 interpreters: list[Interpreter], pipes: list[tuple[int, int]],
                 repository: Repository | None = None) -> None:
        self._service, self._fronts, self._interpreters = service, fronts, interpreters
        self._repository = service if repository is None else repository
        self._pipes = pipes
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="multipy-serve-control",
                                        daemon=True)
        service.watch(self)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops reading (a request being done is finished first) and closes the pipes."""
        os.write(self._wake_write, b"x")
        self._thread.join()
        for fd in (self._wake_read, self._wake_write,
                   *(end for pipe in self._pipes for end in pipe)):
            os.close(fd)

    # -- the service's watcher --

    def added(self, name: str, model: ServedModel) -> None:
        described = model.described
        for k, interpreter in enumerate(self._interpreters):
            self._tell(k, lambda front: front.add_model(name, model.instance(interpreter),
                                                        described))

    def changed(self, name: str, state: str, reason: str) -> None:
        """Tells every front end at once, and waits for them: each answers the model's
        requests it has received first (FrontEnd.set_state)."""
        on_each(range(len(self._fronts)), lambda k: self._tell(
            k, lambda front: front.set_state(name, state, reason)), "multipy-serve-tell")

    def _tell(self, k: int, call: Callable[[FrontEndCalls], None]) -> None:
        """call(front end k); logs its failure (a front end that has ended serves
        nothing), which the others do not share."""
        try:
            call(self._fronts[k])
        except Exception as error:
            logger.error("interpreter %d's front end could not be told of a model "
                         "repository change: %s: %s", k, type(error).__name__, error)

    # -- on its thread --

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:  # (no limit on the fds' numbers)
            selector.register(self._wake_read, selectors.EVENT_READ, None)
            for k, (read, _) in enumerate(self._pipes):
                selector.register(read, selectors.EVENT_READ, k)
            while True:
                for key, _ in selector.select():
                    if key.data is None:
                        return
                    for number in receive(key.fd):
                        self._do(key.data, number)

    def _do(self, k: int, number: int) -> None:
        """Does the request that front end k asked under number, and answers it.  (The
        front ends serve just before the server is ready: a request that comes between
        waits for it.)"""
        front = self._fronts[k]
        self._service.wait_ready(_READY_WAIT)
        try:
            request = front.control_request(number)
            if request is None:  # its client went away
                return
            op, name, *archive = request
            status, message = do(self._repository, op, name, *archive)
        except Exception as error:  # that front end has ended: no one waits
            logger.error("interpreter %d's front end's request could not be read: %s", k,
                         error)
            return
        try:
            front.control_answer(number, status, message)
        except Exception as error:  # that front end has ended: no one waits
            logger.error("interpreter %d's front end could not be answered: %s", k, error)
