"""An interpreter's front end for ``multipy serve``: HTTP, the protocol and the model
calls, all in this interpreter, on its own GIL.

Each front end accepts connections on the server's listening socket itself
(multipy._inside.accepting), while it runs no call, and gives one back to the host when
another front end is freer.  The host takes what no front end has taken within a few
milliseconds (every front end in a call: health checks are answered at once all the
same; multipy.serve.main), and hands such a connection, or one given back, to the front
end of the interpreter with the fewest open ones by writing its socket's file
descriptor into the front end's inbox, a pipe whose read end the front end's event loop
watches (the host never waits for this interpreter's GIL); a stop comes the same way,
after every connection handed before it.  From then on, every request on a connection is parsed,
decoded, checked, run and answered here, by uvicorn and the same Starlette application
as the host's (multipy.serve.http.app), on an event loop that runs on the host thread
that called ``run``.
A model runs on that thread, blocking the loop: one call at a time in this interpreter,
as in one worker process of other servers; a thread of this interpreter watches the
call's client meanwhile, and cancels the call if the client goes (multipy._inside.
hangups).  With a per-request timeout, calls run one at
a time on a thread of this interpreter instead, where a call whose request has waited
too long, or whose client went away, is cancelled as the host cancels one
(``_multipy_bootstrap.call`` and ``cancel``: the cancel reaches that call only); while
such a call does not stop, this interpreter is stuck, and moves its clients to the
others: its HTTP answers close their connections, and its gRPC server stops until the
call ends.  With gRPC (``multipy serve --grpc-port``), the same loop also runs this
interpreter's gRPC server (multipy.serve.rpc.server) on the port that every interpreter's
shares.  Counts go to this interpreter's row of the server's metrics board
(multipy.serve.request.metrics), which ``/metrics`` sums, whichever front end answers it.  The
model repository's load and unload requests go to the host, which does them
(multipy.serve.host.service), through this front end's control pipe: the front end writes the
request's number there and waits; the host reads the request (``control_request``),
tells every front end what changed (``add_model``, ``set_state``) and answers
(``control_answer``).

Imports uvicorn's server without its command line (multipy.serve.http.uvicorn_server),
Starlette and numpy (the ``serve`` extra; prometheus_client once ``/metrics`` is
answered here; grpcio and protobuf with gRPC), and of multipy only what host and
interpreters share of ``multipy.serve`` (the request path: messages, protocol, batching,
metrics, requests, repository, inference, app and rpc; and the inbox).
"""
from __future__ import annotations

import array
import asyncio
import fcntl
import functools
import itertools
import logging.config
import queue
import socket
import termios
import threading
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import _multipy_bootstrap

from ..serve.http.app import create_app, logging_config
from ..serve.http.connection import BACKLOG
from ..serve.http.inbox import ACCEPT, FORCE, PAUSE, receive, send
from ..serve.http.uvicorn_protocol import guarded
from ..serve.http.uvicorn_server import Config, Server
from ..serve.request.contract import FrontEndSettings
from ..serve.request.messages import InferRequest, ProtocolError
from ..serve.request.metrics import SATURATED_EVERY, Metrics
from ..serve.request.poison import Table, check
from ..serve.request.repository import READY
from ..serve.request.requests import NO_ID, ModelRequests, Started, named
from .accepting import Acceptor
from .hangups import Hangups, serials
from .pieces import Pieces
from .serving import Served


logger = logging.getLogger("multipy.serve")

#: A graceful stop's limit (seconds) when --graceful-timeout sets none.
_NO_LIMIT = 365 * 24 * 3600.0
#: The most seconds a model being unloaded waits for the requests received before.
_LEAVE_WAIT = 30.0
#: What a crash report names while a front end runs no model call.
_SERVING = (b"serving", b"the HTTP requests of multipy serve")
#: Seconds within which a cancelled call that stops (Python code stops at its next
#: bytecode; C, when it returns) does not make its interpreter stuck.
_STOPS_WITHIN = 0.5


class FrontEnd:
    """This interpreter's front end for the models it has loaded (name -> Served), as
    settings (multipy.serve.request.contract.FrontEndSettings) say.

    The host calls ``run`` on a thread of its own; it returns once a STOP or FORCE from
    the inbox has stopped the server."""

    def __init__(self, models: dict[str, Served], settings: FrontEndSettings) -> None:
        logging.config.dictConfig(logging_config(server_lines=False))
        self.metrics = Metrics(list(settings.names), settings.interpreters, rows=settings.rows,
                               row=settings.row, address=settings.board,
                               stuck_after=settings.stuck_after, slots=settings.slots,
                               first=settings.first, processes=settings.processes,
                               cores=settings.cores)
        self.states: dict[str, tuple[str, str]] = dict(settings.states)
        self.model_control = settings.model_control
        self.strict_readiness = settings.strict_readiness
        self.http_restricted = settings.http_restricted
        self.grpc_restricted = settings.grpc_restricted
        self._control = settings.control
        self._asked: dict[int, tuple[tuple, asyncio.Future]] = {}  # number -> (request, answer)
        self._numbers = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()  # (asyncio keeps only weak references)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_request_size = settings.max_request_size
        self._limits = settings.limits
        self._graceful_timeout = settings.graceful_timeout
        self.ready = True
        self._worker = None if settings.timeout is None else _Worker(self._stuck_changed)
        #: the watch of calls on the loop (without a worker) for their clients' going
        self._hangups = Hangups() if self._worker is None else None
        self._refused = None if settings.refused is None else Table(address=settings.refused)
        self._settings = settings
        self.models: dict[str, _Model] = {}
        for name, served in models.items():
            self.add_model(name, served, settings.described[name])
        self._app = create_app(self) if self._worker is None else \
            _ClosingWhileStuck(create_app(self), self._worker)
        self._inbox = settings.inbox
        self._grpc_address = settings.grpc
        self._grpc: Any = None  # the gRPC server serving here, if one does
        self._grpc_private = ""  # its address of its own (see _grpc_through)
        self._grpc_stops: dict[Any, asyncio.Future] = {}  # server stopped -> its stop
        self._server: _Server | None = None
        self._connecting: set[asyncio.Task] = set()
        self._acceptor: Acceptor | None = None  # (with a listening socket)
        self._may_accept = settings.accepting  # (ACCEPT and PAUSE from its inbox)
        self._serving = threading.Event()  # set once it serves, or has ended
        self._running = False
        self._protocol: Callable[[], asyncio.Protocol] | None = None
        self._stopping = False

    # -- what the application asks (see multipy.serve.http.app.create_app) --

    def model(self, name: str, version: str | None = None) -> _Model | None:
        return named(self.models, self.states, name, version)

    async def load(self, name: str, archive: dict[str, str]) -> None:
        await self._ask("load", name, archive)

    async def unload(self, name: str) -> None:
        await self._ask("unload", name)

    async def _ask(self, *request: Any) -> None:
        """Has the host do request, and waits for it; ProtocolError as it answers."""
        number = next(self._numbers)
        answer = asyncio.get_running_loop().create_future()
        self._asked[number] = (request, answer)
        try:
            try:
                send(self._control, number)
            except BlockingIOError:
                raise ProtocolError("too many model repository requests wait for the host; "
                                    "try again later", 503) from None
            status, message = await answer
        finally:
            del self._asked[number]
        if status != 200:
            raise ProtocolError(message, status)

    # -- what the host calls for the model repository --

    def control_request(self, number: int) -> tuple | None:
        """The request asked under number: ("load", name, archive) or ("unload", name);
        None if it is no longer asked (its client went away)."""
        asked = self._asked.get(number)
        return None if asked is None else asked[0]

    def control_answer(self, number: int, status: int, message: str) -> None:
        """Answers the request asked under number (200, or an error's status)."""
        if number in self._asked:  # (not if its request was cancelled meanwhile)
            answer = self._asked[number][1]
            self._loop.call_soon_threadsafe(
                lambda: answer.done() or answer.set_result((status, message)))

    def add_model(self, name: str, served: Served, described: dict) -> None:
        """Serves model name, loaded here as served (metadata: described).  (This and
        set_state replace ``models`` and ``states`` rather than change them: the host
        calls them from a thread of its own while the loop reads them.)"""
        self.metrics.add(name)
        settings = self._settings
        model = _Model(name, served, self.metrics.models[name], self._worker, self._hangups,
                       settings.max_batch_size, settings.batch_delay, settings.timeout,
                       self._refused)
        model.describe(described)
        self.models = {**self.models, name: model}
        self.states = {**self.states, name: (READY, "")}

    def set_state(self, name: str, state: str, reason: str) -> None:
        """Model name is not ready (state, for reason): its new requests are refused.
        Those received before are answered: the requests being answered, and those that
        wait, unread or pipelined, on this front end's connections (HTTP), which it
        reads first (waiting for that, at most _LEAVE_WAIT seconds: a call in progress
        here ends first).  A model new to this server takes its slot of the metrics
        here, in the order the host gave it one."""
        self.metrics.add(name)
        if name not in self.models or self._loop is None or self._server is None:
            self._leave(name, state, reason)
            return
        waiting = self._waiting()
        left = threading.Event()

        async def leave() -> None:
            deadline = asyncio.get_running_loop().time() + _LEAVE_WAIT
            await _read_and_answered(waiting, deadline)
            if self._grpc is not None:  # the gRPC calls received before are taken up
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    await self._grpc_through(max(0.0, remaining))
                except Exception as error:  # (past the deadline, say: it serves on)
                    logger.warning("model %r is unloaded while gRPC calls received before "
                                   "may wait: %s", name, error)
            for _ in range(2):  # turns in which the requests read look their model up
                await asyncio.sleep(0)
            self._leave(name, state, reason)
            left.set()

        try:
            self._loop.call_soon_threadsafe(self._keep, leave())
        except RuntimeError:  # the loop has closed
            self._leave(name, state, reason)
            return
        left.wait(_LEAVE_WAIT)

    def _leave(self, name: str, state: str, reason: str) -> None:
        self.models = {other: model for other, model in self.models.items() if other != name}
        self.states = {**self.states, name: (state, reason)}

    def _waiting(self) -> dict[Any, int]:
        """The connections with requests that wait to be read or answered in turn (HTTP
        pipelining): each connection's protocol -> the bytes it will have read once it
        has read what waits now."""
        waiting = {}
        count = array.array("i", [0])
        for protocol in list(self._server.server_state.connections):
            sock = protocol.transport.get_extra_info("socket")
            try:
                fcntl.ioctl(sock.fileno(), termios.FIONREAD, count, True)
            except (OSError, ValueError, AttributeError):  # closed meanwhile (fileno -1)
                continue
            if count[0] or protocol.pipeline:
                waiting[protocol] = protocol.received + count[0]
        return waiting

    async def drain(self) -> None:
        for model in list(self.models.values()):
            await model.drain()

    # -- what the host calls --

    def run(self) -> None:
        """Serves the connections handed to it until told to stop: every request it
        has received is answered, then its connections close."""
        _multipy_bootstrap.note(*_SERVING)
        config = Config(self._app, lifespan="off", access_log=False, log_config=None,
                        proxy_headers=False,  # nothing here reads the client's address
                        ws="none",  # (nor speaks WebSocket: websockets is not imported)
                        timeout_graceful_shutdown=self._graceful_timeout)
        self._server = _Server(config, self._started, self._finish)
        if self._hangups is not None:
            self._hangups.start()
        try:
            self._server.run(sockets=[])
        finally:
            self.metrics.watching(False)  # (ended, or failed: it accepts no more)
            self._running = False
            self._serving.set()
            if self._worker is not None:
                self._worker.stop()
            if self._hangups is not None:
                self._hangups.stop()

    def wait_serving(self, timeout: float) -> bool:
        """Waits (at most timeout seconds) until ``run`` serves, gRPC included, or has
        ended; whether it serves."""
        self._serving.wait(timeout)
        return self._running

    # -- on the loop --

    async def _started(self, server: Server) -> None:
        # (each connection's protocol, made by one C call)
        self._protocol = functools.partial(
            guarded(server.config.http_protocol_class, self._limits,
                    self.metrics.closed_connection, on_linger=self.metrics.lingering,
                    crowded=self.metrics.crowded if self.metrics.sheds else None,
                    direct=self._app.direct),
            config=server.config, server_state=server.server_state,
            app_state=server.lifespan.state)
        if self._grpc_address is not None:
            await self._serve_grpc()
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(self._inbox, self._read_inbox)
        self._read_inbox()  # what came before the loop ran
        if self._settings.listener >= 0 and not self._stopping:
            self._acceptor = Acceptor(self._settings.listener, BACKLOG, self._accepted,
                                      self._freer, self._give_back)
            self._accept_when_free()
            if self.metrics.may_be_surplus:
                self._look_again()
        self._running = True
        self._serving.set()

    def _read_inbox(self) -> None:
        for value in receive(self._inbox):
            if value >= 0:
                self._connect(socket.socket(fileno=value))
                continue
            if value in (ACCEPT, PAUSE):
                self._may_accept = value == ACCEPT
                self._accept_when_free()
                continue
            if value == FORCE:
                self._server.force_exit = True
                for server in [self._grpc, *self._grpc_stops]:  # their calls end now
                    if server is not None:
                        self._keep(server.stop(0))
            if not self._stopping:
                self._stopping = True
                self._keep(self._stop())

    def _keep(self, work: Any) -> None:
        """Runs the coroutine work as a task of the loop, kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _connect(self, connection: socket.socket) -> None:
        """Serves connection, which the host handed it."""
        self.metrics.opened_connection(received=True)
        task = asyncio.get_running_loop().create_task(self._serve(connection))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    def _accept_when_free(self) -> None:
        """Accepts on the listening socket while it may: it has one, is not stopping,
        has not been told to PAUSE, (with a worker) is not stuck, and does not stand
        aside (Metrics.surplus)."""
        acceptor = self._acceptor
        if acceptor is not None:
            worker = self._worker
            wanted = self._may_accept and not self._stopping and (
                worker is None or worker.stuck is None) and not self.metrics.surplus()
            acceptor.want(wanted)
            self.metrics.watching(wanted)

    def _look_again(self) -> None:
        """A front end that may stand aside (Metrics.may_be_surplus) looks again at
        whether it does, every SATURATED_EVERY seconds until it stops."""
        if not self._stopping:
            self._accept_when_free()
            self._loop.call_later(SATURATED_EVERY, self._look_again)

    def _accepted(self) -> Any:
        """The protocol of a connection it accepted itself, and serves."""
        self.metrics.opened_connection(received=False)
        return self._protocol()

    def _freer(self) -> bool:
        """Counts a connection it has just accepted, and says whether another front end
        would serve it sooner (multipy._inside.accepting)."""
        self.metrics.accepted_connection()
        worker = self._worker
        return self.metrics.freer_front_end(busy=worker is not None and worker.calls > 0)

    def _give_back(self, fd: int) -> None:
        try:
            send(self._settings.given_back, fd)
        except OSError as error:  # (the host's pipe is full: thousands wait there)
            logger.error("a connection could not be given back to the host: %s", error)
            socket.socket(fileno=fd).close()

    async def _serve(self, connection: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._protocol,
                                                                     connection)
        except OSError:  # closed by the client meanwhile
            connection.close()
            self.metrics.closed_connection()

    async def _stop(self) -> None:
        """Once every connection handed before has been set up and has read what its
        client sent, the server stops: uvicorn answers each request it has received and
        closes each connection that has none.  It accepts no more connections."""
        if self._acceptor is not None:
            self._accept_when_free()  # (stopping: it wants none)
            await self._acceptor.close()
        if self._grpc is not None:  # no new calls; those running end within the limit
            grace = self._graceful_timeout  # (None: none; grpc's None would be at once)
            self._stop_grpc(_NO_LIMIT if grace is None else grace)
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
        for _ in range(2):  # turns of the loop, which read what the new sockets hold
            await asyncio.sleep(0)
        self._server.should_exit = True

    async def _finish(self) -> None:
        """Once the HTTP server has stopped: the gRPC calls end, then the batches still
        waiting run."""
        await asyncio.gather(*self._grpc_stops.values())
        await self.drain()

    # -- gRPC while this interpreter is stuck --

    async def _serve_grpc(self) -> None:
        """Starts a gRPC server here (multipy.serve.rpc.server), unless the front end stops."""
        from ..serve.rpc.server import create_server

        if not self._stopping:
            # (abstract names are the network namespace's, which others may share)
            self._grpc_private = f"unix-abstract:multipy-serve-{uuid.uuid4().hex}"
            self._grpc = create_server(self, self._grpc_address, self._grpc_private,
                                       lambda: _Taken(self, self.models, self.states))
            await self._grpc.start()

    async def _grpc_through(self, timeout: float) -> None:
        """Returns once the gRPC server has taken up every call it had received."""
        from ..serve.rpc.server import through

        await through(self._grpc_private, timeout)

    def _stop_grpc(self, grace: float) -> None:
        """Stops the gRPC server: no new calls (GOAWAY: its clients' channels connect
        again, to the servers that listen), those running end within grace seconds."""
        server, self._grpc = self._grpc, None
        self._grpc_stops[server] = asyncio.ensure_future(server.stop(grace))

    def _stuck_changed(self) -> None:
        """The worker is stuck, or free again (on the loop): a stuck interpreter's gRPC
        server stops while another interpreter of the server (of any of its processes)
        is not stuck, so that the gRPC channels held here go there (HTTP's connections
        are closed as they are answered: _ClosingWhileStuck); a new one starts once it
        is free again.  It accepts no connection while stuck."""
        self._accept_when_free()
        if self._grpc_address is None or self._stopping:
            return
        if self._worker.stuck is None:
            if self._grpc is None:
                self._keep(self._restart_grpc())
            return
        if self._grpc is not None and self.metrics.free_elsewhere(self._settings.row):
            self._stop_grpc(self._settings.timeout)  # (every call here ends within it)

    async def _restart_grpc(self) -> None:
        try:
            await self._serve_grpc()
        except Exception as error:  # (the port could not be bound again, say)
            self._grpc = None
            logger.error("an interpreter's gRPC server could not start again (the others "
                         "serve gRPC): %s: %s", type(error).__name__, error)


class _Taken:
    """A front end as a gRPC call found it when its server took the call up: with the
    models it had then, so that a call taken up before an unload is answered, as HTTP's
    are; the rest is the front end's own."""

    def __init__(self, front: FrontEnd, models: Mapping[str, _Model],
                 states: Mapping[str, tuple[str, str]]) -> None:
        self._front, self._models, self._states = front, models, states

    def model(self, name: str, version: str | None = None) -> _Model | None:
        return named(self._models, self._states, name, version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)


class _Server(Server):
    """A front end's uvicorn server: no socket of its own; ``await started(self)`` on
    its loop once it runs, and ``await finish()`` once it has stopped."""

    def __init__(self, config: Config, started: Callable[[Server], Any],
                 finish: Callable[[], Any]) -> None:
        super().__init__(config)
        self._started_hook, self._finish = started, finish

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        await self._started_hook(self)

    async def shutdown(self, sockets: list | None = None) -> None:
        await super().shutdown(sockets)
        await self._finish()


async def _read_and_answered(waiting: dict[Any, int], deadline: float) -> None:
    """Returns once each connection of waiting (its protocol -> the bytes it will have
    read) has read that many, has no request left in its pipeline, or is closing; or
    at deadline (the loop's time)."""
    loop = asyncio.get_running_loop()
    progress = asyncio.Event()  # (set by a protocol that reads, answers or ends)
    for protocol in waiting:
        protocol.progress = progress
    try:
        while any(not protocol.transport.is_closing() and
                  (protocol.received < target or protocol.pipeline)
                  for protocol, target in waiting.items()):
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return
    finally:
        for protocol in waiting:
            protocol.progress = None


class _ClosingWhileStuck:
    """The ASGI application app, but an answer it gives while worker is stuck closes its
    connection (Connection: close): the client's next request comes on a new connection,
    which the host hands to an interpreter that is not stuck.  So does an answer of its
    endpoints that answer without ASGI (``direct``: see multipy.serve.http.app)."""

    def __init__(self, app: Any, worker: _Worker) -> None:
        self._app, self._worker = app, worker

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start" and self._stuck():
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
            await send(message)

        await self._app(scope, receive, sending)

    def _stuck(self) -> bool:
        return self._worker.stuck is not None

    def direct(self, target: bytes) -> Callable | None:
        endpoint = self._app.direct(target)
        return None if endpoint is None else functools.partial(self._closing, endpoint)

    async def _closing(self, endpoint: Callable, exchange: Any) -> None:
        exchange.closing = self._stuck  # (asked as it answers)
        await endpoint(exchange)


class _Model(ModelRequests):
    """A model loaded in this interpreter; see ModelRequests."""

    def __init__(self, name: str, served: Served, series: Any, worker: _Worker | None,
                 hangups: Hangups | None, max_batch_size: int, batch_delay: float,
                 timeout: float | None, refused: Table | None) -> None:
        super().__init__(name, series, max_batch_size, batch_delay, timeout)
        self._served, self._worker = served, worker
        self._hangups = hangups
        self._refused = refused  # with --processes: the inputs that crashed processes
        self._asynchronous = getattr(served, "asynchronous", False)  # a class's async predict
        self._noted = f"model {name!r}, "  # what a crash report names, before the requests
        #: the crash report's note while a call of one request without an id runs (most)
        self._anonymous = (b"inference", (self._noted + NO_ID).encode())

    async def healthy(self) -> bool:  # (one that raises is not healthy, as in LitServe)
        """The model's own health check's answer (True if it has none), published on the
        board, where the host reads it when it answers for the model (ServedModel)."""
        healthy = getattr(self._served, "healthy", None)
        if healthy is None:
            return True
        try:
            said = bool(await healthy())
        except Exception:
            logger.exception("the health check of model %r raised", self.name)
            said = False
        self._series.health_said(said)
        return said

    @property
    def cancellable(self) -> bool:  # (an async predict gives the loop its turns)
        return self._worker is not None or self._batcher is not None or self._asynchronous

    async def _run(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                   arrays: list[Any], started: Started, given: dict[str, Any],
                   request: InferRequest | None) -> tuple:
        self._check_refused(names, datatypes, arrays, given, started)
        served = self._served
        return await self._calling(
            lambda: served.infer(names, datatypes, *arrays, **given),
            (lambda: served.infer_async(names, datatypes, *arrays, **given))
            if self._asynchronous else None, started, request)

    async def _steps(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                     arrays: list[Any], started: Started, given: dict[str, Any],
                     request: InferRequest) -> AsyncIterator[tuple]:
        pieces = self._served.stream(names, datatypes, *arrays, **given)
        # (steps awaited on the loop may interleave with others': their crash not pinned)
        self._check_refused(names, datatypes, arrays, given, started,
                            pinned=not (pieces.asynchronous and self._worker is None))
        try:
            while True:
                piece = await self._calling(
                    pieces.next, pieces.anext if pieces.asynchronous else None,
                    started, request)
                if piece is None:
                    return
                yield piece
                started = started.later()
                # (a turn of the loop between steps: the other requests and streams of
                # this interpreter, and the connections handed to it, go on meanwhile)
                await asyncio.sleep(0)
        finally:
            await self._close(pieces)

    async def _close(self, pieces: Pieces) -> None:
        """Ends a model's stream (its ``finally`` runs) where its steps ran: here, or on
        the worker's thread, after the step it may still run (not waited for).  What
        that raises is logged: the answer is what it is by then."""
        if self._worker is not None:
            self._worker.then(pieces.close, f"model {self.name!r}: ending its stream")
            return
        try:
            if pieces.asynchronous:
                await pieces.aclose()
            else:
                pieces.close()
        except Exception:
            logger.exception("model %r: ending its stream raised", self.name)

    def _check_refused(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...],
                       arrays: list[Any], given: dict[str, Any], started: Started,
                       pinned: bool = True) -> None:
        """With --processes: ProtocolError if these inputs crashed a process before
        (multipy.serve.request.poison); else, if pinned, the call's digest is noted in
        started, so that a crash in it is pinned on its request."""
        if self._refused is not None:
            digest = check(self._refused, self.name, names, datatypes, arrays, given)
            if pinned and started.one and not self._asynchronous:  # (async calls may
                started.digest = digest  # run together: not pinned)

    async def _calling(self, call: Callable[[], Any],
                       acall: Callable[[], Awaitable[Any]] | None, started: Started,
                       request: InferRequest | None) -> Any:
        """A call of the model, within started: acall() awaited on the loop if given
        (an async predict), else call() blocking the loop (cancelled if request's client
        goes: hangups), or, with a worker (--timeout), on its thread."""
        if self._worker is None:  # here, blocking the loop
            # what a crash report names while it runs (kept alive until then)
            requests = started.requests()
            running = self._anonymous if requests is NO_ID else \
                (b"inference", (self._noted + requests).encode())
            _multipy_bootstrap.note(*running)
            started.pin(True)
            try:
                with started:
                    if acall is not None:
                        return await acall()
                    hangups = self._hangups
                    if hangups is None or request is None or self._batcher is not None:
                        return call()  # (a batch's call answers several clients: none
                        # is cancelled for one)
                    serial = next(serials)  # (cancelled if its client goes: hangups)
                    hangups.running = (serial, request)
                    try:
                        return _multipy_bootstrap.call(serial, call)
                    except _multipy_bootstrap.CallCancelled:
                        gone = hangups.gone(serial, request)
                        if gone is None:
                            raise
                        raise gone from None
                    finally:
                        hangups.running = None
            finally:
                started.pin(False)
                _multipy_bootstrap.note(*_SERVING)
        stuck = self._worker.stuck
        if stuck is not None:
            raise ProtocolError(f"this interpreter still runs a call of model {stuck!r} that "
                                f"its request gave up on (it passed --timeout, or its client "
                                f"went away), and takes no other call until that one ends; "
                                f"try again later", 503)
        return await self._worker.run(call, started, self._series, self.name)


class _Worker:
    """This interpreter's thread for model calls that may be cancelled: they run there
    one at a time, in order.  A call whose caller is cancelled (the timeout, or the
    client went away) never runs if it has not started, and has CallCancelled raised in
    it at its next bytecode if it has; the cancel reaches that call only, never the
    worker's bookkeeping or its next call.  Whatever a call raises, BaseException
    included, is its caller's.  ``stuck_changed()`` is called on the caller's loop when
    ``stuck`` changes."""

    def __init__(self, stuck_changed: Callable[[], None]) -> None:
        #: the model whose call, given up on by its request, still runs here, or None
        self.stuck: str | None = None
        self.calls = 0  #: calls asked of it that have not been answered or given up on
        self._stuck_changed = stuck_changed
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="multipy-serve-call",
                                        daemon=True)
        self._thread.start()

    async def run(self, call: Callable[[], tuple], started: Started, series: Any,
                  name: str) -> tuple:
        """call()'s value (or exception), the call (of model name, counted in series) run
        on the worker thread within ``started`` (entered and left on the caller's
        loop).  Cancelled once running, the cancel goes on once the call has ended, or
        has made the worker ``stuck`` (see _abandoned)."""
        job = _Job(call, started, asyncio.get_running_loop())
        self._jobs.put(job)
        self.calls += 1
        try:
            return await job.answer
        except asyncio.CancelledError:
            if job.abandon():  # (shielded: a second cancel does not skip the bookkeeping)
                await asyncio.shield(self._abandoned(job, name, series))
            raise
        finally:
            self.calls -= 1

    async def _abandoned(self, job: _Job, name: str, series: Any) -> None:
        """Waits for job, whose call was cancelled, to end: if it has not within
        _STOPS_WITHIN seconds, the worker is stuck until it does, and what
        stuck_changed() then starts (a gRPC server's stop) has begun on return."""
        if not (await asyncio.wait({job.ended}, timeout=_STOPS_WITHIN))[0]:
            self._set_stuck(name, series)
            job.ended.add_done_callback(lambda _: self._set_stuck(None, series))
            await asyncio.sleep(0)

    def _set_stuck(self, name: str | None, series: Any) -> None:
        self.stuck = name
        series.abandoned(name is not None)
        self._stuck_changed()

    def then(self, call: Callable[[], None], what: str) -> None:
        """Runs call() on the worker's thread after the calls before it, not waited for;
        what it raises is logged as what failed."""
        def run() -> None:
            try:
                call()
            except Exception:
                logger.exception("%s raised", what)

        self._jobs.put(_Then(run))

    def _work(self) -> None:
        for job in iter(self._jobs.get, None):
            job.run()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class _Then:
    """A job of a _Worker's whose outcome no one awaits (``_Worker.then``)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run


class _Job:
    """One call of a _Worker: run on its thread as its own call number (a serial) of the
    interpreter's registry (_multipy_bootstrap.call), answered on the caller's loop."""

    def __init__(self, call: Callable[[], tuple], started: Started,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._call, self._started, self._loop = call, started, loop
        self._serial = next(serials)
        self.answer = loop.create_future()
        #: done (on the loop) once the call has ended, answered or not
        self.ended = loop.create_future()
        self._thread: int | None = None
        self._abandoned = False
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self._abandoned:
                return
            self._thread = threading.get_ident()
        self._post(self._started.__enter__)
        self._started.pin(True)
        try:  # a cancel lands inside only: the bookkeeping after runs whatever it raised
            outcome = (_multipy_bootstrap.call(self._serial, self._call), None)
        except BaseException as error:  # CallCancelled, or the model's SystemExit, say
            outcome = (None, error)
        self._started.pin(False)
        self._post(self._started.__exit__, None, None, None)
        with self._lock:
            self._thread = None
        self._post(self._settle, outcome)

    def _settle(self, outcome: tuple[Any, BaseException | None]) -> None:
        value, error = outcome
        if not self.ended.done():
            self.ended.set_result(None)
        if self.answer.done():  # abandoned
            return
        if error is not None:
            self.answer.set_exception(error)
        else:
            self.answer.set_result(value)

    def _post(self, callback: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: no one waits any more
            pass

    def abandon(self) -> bool:
        """Gives up on the call: it never runs, or CallCancelled is raised in it; True
        if it was running."""
        with self._lock:
            self._abandoned = True
            if self._thread is None:
                return False
            _multipy_bootstrap.cancel(self._thread, self._serial)
            return True
