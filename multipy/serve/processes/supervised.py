"""A server process's side of ``multipy serve --processes`` (multipy.serve.processes.supervisor):
its link to the supervisor, read on the process's event loop.

The supervisor says when its front ends accept connections on the server's listening
socket themselves, hands it the connections that no front end took in time (served as a
single server serves those it accepts; each is acknowledged as it arrives, before
anything reads it, on the metrics board, where the supervisor reads it even after this
process has died), checks its
health (answered from its event loop) and has it do the model repository's requests; it
tells the supervisor when its models are loaded, and asks it to have every process do
the repository requests that its own front ends receive (``load_now`` and
``unload_now``, which multipy.serve.host.control calls as it would the service's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import socket
from typing import Callable

from ..host.control import Watcher, do
from ..host.service import Service
from ..request.messages import ProtocolError
from .link import (Accepting, Answer, Ask, Connection, Do, Done, Link, Message, Ping, Pong,
                   Prepared, Ready, RepositoryRequest, Returned, TooLarge)
from .tasks import Tasks

logger = logging.getLogger("multipy.serve")


class Supervised:
    """This process's link to the supervisor, for service (multipy.serve.host.service.Service)."""

    def __init__(self, link: Link, service: Service) -> None:
        self._link, self._service = link, service
        self._asked: dict[int, concurrent.futures.Future] = {}
        self._numbers = itertools.count(1)
        self._reading = False
        self._tasks = Tasks()

    # -- on the event loop --

    def listen(self, hand: Callable[[socket.socket], None], gone: Callable[[], None],
               accepting: Callable[[bool], None]) -> None:
        """Reads the link from now on: hand(connection) for each connection handed to
        this process; gone() once the supervisor has gone (the process should stop);
        accepting(on) when the supervisor says whether its front ends accept."""
        self._hand, self._gone, self._accepting = hand, gone, accepting
        asyncio.get_running_loop().add_reader(self._link.fileno(), self._read)
        self._reading = True

    def stop_listening(self) -> None:
        """Takes no more connections: those handed already are handed on first; a
        repository request still asked of the supervisor gets 503."""
        if self._reading:
            asyncio.get_running_loop().remove_reader(self._link.fileno())
            self._reading = False
            self._read()
        self._fail_asked()

    def prepared(self) -> None:
        """Tells the supervisor that this process has checked its models as it does
        before listening (Service.prepare): it takes connections from now on."""
        self._tell(Prepared())

    def ready(self) -> None:
        """Tells the supervisor that this process's models are loaded."""
        self._tell(Ready())

    def give_back(self, connection: socket.socket) -> bool:
        """Gives connection (not read from) to the supervisor, for another process;
        False if it could not (it is gone: the caller serves it)."""
        try:
            self._link.send(Returned(), (connection.fileno(),))
        except OSError:
            return False
        connection.close()
        return True

    def _tell(self, message: Message) -> None:
        try:
            self._link.send(message)
        except OSError:  # it has gone: the link's end says so
            pass

    def _read(self) -> None:
        messages = self._link.receive()
        if messages is None:
            if self._reading:
                asyncio.get_running_loop().remove_reader(self._link.fileno())
                self._reading = False
            self._fail_asked()
            logger.error("the supervisor has gone: this server process stops")
            self._gone()
            return
        connections = []
        for message, fds in messages:
            match message:
                case Connection(number) if fds:
                    connections.append((number, fds.pop(0)))
                case Accepting(on):
                    self._accepting(on)
                case Ping():
                    self._tell(Pong(**self._service.metrics.health()))
                case Do():
                    self._tasks.start(self._do(message), "a model repository request")
                case Answer(number, status, text):
                    future = self._asked.pop(number, None)
                    if future is not None and not future.done():
                        future.set_result((status, text))
            for fd in fds:
                os.close(fd)
        if connections:  # this process owns them before it reads a byte of one
            self._service.metrics.took(connections[-1][0])
            for _, fd in connections:
                self._hand(socket.socket(fileno=fd))

    def _fail_asked(self) -> None:
        for future in list(self._asked.values()):
            if not future.done():
                future.set_result((503, "the server is stopping"))

    async def _do(self, message: Do) -> None:
        """Does a repository request for the supervisor, and says how it went."""
        request = message.request
        status, text = await asyncio.to_thread(do, self._service, request.what, request.name,
                                               request.archive)
        self._tell(Done(message.number, status, text))

    # -- what multipy.serve.host.control calls, on its thread --

    def watch(self, watcher: Watcher) -> None:
        self._service.watch(watcher)

    def load_now(self, name: str, archive: dict[str, str]) -> None:
        """Has every process load model name (Service.load_now); ProtocolError as the
        first that fails does."""
        self._ask("load", name, archive)

    def unload_now(self, name: str) -> None:
        """Has every process unload model name (Service.unload_now); ProtocolError as
        the first that fails does."""
        self._ask("unload", name, {})

    def _ask(self, what: str, name: str, archive: dict[str, str]) -> None:
        number = next(self._numbers)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._asked[number] = future
        try:
            self._link.send(Ask(number, RepositoryRequest(what, name, archive)))
        except TooLarge as error:  # (multipy.serve.request.repository bounds what a request says)
            self._asked.pop(number, None)
            raise ProtocolError(f"the request is too large: {error}") from None
        except OSError:
            self._asked.pop(number, None)
            raise ProtocolError("the server is stopping", 503) from None
        status, message = future.result()
        if status != 200:
            raise ProtocolError(message, status)
