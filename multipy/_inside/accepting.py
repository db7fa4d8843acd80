"""An interpreter's front end accepting connections on the server's listening socket
(``Acceptor``), with the event loop's own server: uvloop accepts in C, and no Python
runs per connection but the protocol's, as in a worker process of uvicorn's.

A front end's loop that runs a model call does not poll, so it accepts nothing
meanwhile: the kernel's wake-up reaches the free ones.  What a loop that polls cannot
see for itself, the metrics board tells it: a connection it has just accepted goes back
to the host (``give``), which hands it to a freer front end of this process, when one
that accepts, runs no call and serves fewer connections exists (lingering connections
aside; and not for a second connection while the server has more front ends than cores
and this process keeps its share of them busy:
multipy.serve.request.metrics.Metrics.freer_front_end), or, while this one runs a call
on its worker (``--timeout``), one that runs none.  So keep-alive clients spread over
the interpreters, and a front end that is in a call keeps none of the connections that
others could serve at once.  With more front ends than cores, those past their process's
share of the cores stand aside while the share's front ends keep it busy: they accept
nothing and close each kept-alive connection once they have answered on it
(multipy.serve.request.metrics.Metrics.surplus).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable

logger = logging.getLogger("multipy.serve")


class Acceptor:
    """Accepts connections on the listening socket (a descriptor of its own, copied from
    ``listener``, the host's, at once; with ``backlog`` as the host listens) while
    ``want(True)`` says so: each connection is served with the protocol that ``make()``
    gives, unless ``freer()``, when its descriptor goes to ``give`` (which owns it from
    then on)."""

    def __init__(self, listener: int, backlog: int, make: Callable[[], asyncio.Protocol],
                 freer: Callable[[], bool], give: Callable[[int], None]) -> None:
        self._listener, self._backlog = os.dup(listener), backlog
        self._make, self._freer, self._give = make, freer, give
        self._server: asyncio.AbstractServer | None = None
        self._wanted = False
        self._changed = asyncio.Event()
        self._following = asyncio.get_running_loop().create_task(self._follow())

    @property
    def accepting(self) -> bool:
        """Whether its server accepts now."""
        return self._server is not None

    def want(self, on: bool) -> None:
        """Accepts from now on (on), or stops accepting (the connections waiting stay in
        the socket's queue, for the others)."""
        if on != self._wanted:
            self._wanted = on
            self._changed.set()

    async def close(self) -> None:
        """Stops accepting for good."""
        self._following.cancel()
        try:
            await self._following
        except asyncio.CancelledError:
            pass
        if self._server is not None:
            self._server.close()
            self._server = None
        os.close(self._listener)

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._wanted and self._server is None:
                # (a server closes the socket it was given: it gets a copy of its own)
                own = socket.socket(fileno=os.dup(self._listener))
                try:
                    self._server = await loop.create_server(self._protocol, sock=own,
                                                            backlog=self._backlog)
                except OSError as error:  # (out of file descriptors, say: the host
                    own.close()  # takes the connections this one leaves)
                    logger.error("an interpreter's front end could not accept "
                                 "connections: %s", error)
            elif not self._wanted and self._server is not None:
                self._server.close()
                self._server = None

    def _protocol(self) -> asyncio.Protocol:
        return _GivenBack(self._give) if self._freer() else self._make()


class _GivenBack(asyncio.Protocol):
    """A connection that this front end does not serve: its descriptor (a copy) goes to
    ``give`` before a byte of it is read, and the transport lets its own go."""

    def __init__(self, give: Callable[[int], None]) -> None:
        self._give = give

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        copy = os.dup(transport.get_extra_info("socket").fileno())
        transport.abort()  # (the copy keeps the connection open)
        self._give(copy)
