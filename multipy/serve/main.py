"""``multipy serve PATH [PATH ...]``: the HTTP server's life (its command line is
multipy.serve.command's).

Each interpreter answers requests itself, on its own GIL: its front end
(multipy._inside.front_end) runs uvicorn and the Starlette application
(multipy.serve.http.app) on an event loop of its own, which accepts connections on the
server's listening socket, parses, decodes, runs the model and answers, with no Python
of the host's per request or per connection.  The host's main thread accepts the
connections that no front end has taken within _OVERDUE seconds (every one in a call)
and hands each to the front end with the fewest open connections
(multipy.serve.host.front_ends), or answers a GET itself while every front end is busy;
it also catches the signals and runs the lifespan.  The models
load on a thread of their own once the server listens (a model written as a class loads
on the first interpreter before, so that its code's errors are said before anything
connects: Service.prepare): until they are ready, the host answers the connections
itself (``/v2/health/live`` at once, ``/v2/health/ready`` says when loading is done), one
request per connection.  SIGTERM and SIGINT stop the server gracefully: it stops
accepting connections, every front end answers every request it has received, and the
process exits 0 (a second SIGINT forces it).  With ``--grpc-port``, the host reserves
that port (a socket bound with SO_REUSEPORT that never listens) and every front end
serves gRPC on it too, once the models are ready: the kernel spreads those connections
over the interpreters.  ``multipy serve`` runs this through ``multipy run``'s launcher,
with room for 15 interpreters; ``python -m multipy.serve`` re-executes itself to get it
(make_room).  With ``--ray``, the same options make the same application in each replica
of a Ray Serve deployment instead (multipy.serve.on_ray), and this process only deploys
it; with ``--processes``, this process supervises server processes
(multipy.serve.processes).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import logging.config
import signal
import socket
import sys
import threading
import time
from types import FrameType
from typing import Callable, Iterator

from .. import _host
from .._launch import make_room
from .command import Options, parser, options, refuse
from .host import model_class
from .host.front_ends import FrontEnds
from .host.service import Place, Service
from .http.app import create_app, logging_config
from .http.connection import (Limits, accept, accept_overdue, bind, listen, request_line,
                              stop_accepting)
from .http.inbox import receive
from .http.uvicorn_protocol import guarded
from .http.uvicorn_server import Config, Server
from .processes.link import Link, Start
from .request.metrics import Metrics
from .processes.supervised import Supervised
from .processes.supervisor import HEALTH_TIMEOUT, Supervisor, Tunables

logger = logging.getLogger("multipy.serve")

#: Seconds a connection may wait on the listening socket for a front end to accept it
#: before the host takes it.
_OVERDUE = 0.01


class _Server(Server):
    """uvicorn's server, but a graceful stop by SIGTERM or SIGINT ends the process with
    exit status 0 (uvicorn raises the signal again once it has stopped).  It listens
    and hands each connection it accepts to an interpreter's front end (see the module's
    docstring), or serves it itself while there is none; and stops the front ends first
    when it stops.  A process of --processes (supervised) listens on nothing: its
    connections come from the supervisor."""

    def __init__(self, config: Config, fronts: FrontEnds, limits: Limits, metrics: Metrics,
                 listener: socket.socket | None = None,
                 supervised: Supervised | None = None,
                 family: socket.AddressFamily = socket.AF_INET) -> None:
        super().__init__(config)
        self._fronts = fronts
        self._metrics = metrics
        self._limits = limits
        #: the listening socket (None in a supervised process): the front ends accept on it too
        self.listener = listener
        self._family = family  # (the listening socket's, of the connections given back)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._supervised = supervised
        self._protocol: type | None = None
        self._accepting: asyncio.Task | None = None
        #: set once the server has started (or stopped without): the models load then
        self.begun = threading.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second SIGINT: the front ends stop at once too
            threading.Thread(target=self._fronts.force, name="multipy-serve-force",
                             daemon=True).start()

    async def startup(self, sockets: list | None = None) -> None:
        try:
            await self._start()
        finally:
            self.begun.set()

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup([])  # the lifespan; connections come from accept below
        if self.should_exit:
            return
        # one request per connection served here: the next comes on a new connection,
        # which goes to a front end if one can take it
        self._protocol = guarded(self.config.http_protocol_class, self._limits,
                                 one_request=True)
        if self._supervised is not None:
            self._supervised.listen(self._hand, self._supervisor_gone, self._fronts.accepting)
            return
        listener = self.listener
        self.config.port = listener.getsockname()[1]  # the port --port 0 got, for the ready line
        logger.info("listening on http://%s; loading models (inference answers 503 until "
                    "the \"ready\" line; Ctrl-C stops)", _host_port(self.config.host,
                                                                 self.config.port))
        self._accepting = self._loop.create_task(accept(listener, self._accepted))

    def front_ends_accept(self, accepted: Callable[[], int]) -> None:
        """(From any thread, once the front ends run.)  They accept on the listening
        socket from now on (accepted(): how many they have, ever; a supervised process's,
        on its supervisor's): the host hands on the connections they give back, and
        accepts only those they leave waiting for more than _OVERDUE seconds."""
        def overdue() -> None:
            if self.should_exit:
                return
            self._loop.add_reader(self._fronts.given_back, self._given_back)
            if self._accepting is not None:
                self._accepting.cancel()
                self._accepting = self._loop.create_task(
                    accept_overdue(self.listener, self._accepted, accepted, _OVERDUE))

        self._loop.call_soon_threadsafe(overdue)

    def _given_back(self) -> None:
        """Connections that front ends gave back: handed on; with --processes, to the
        supervisor, for another process, while every front end here runs a call and one
        there runs none."""
        for fd in receive(self._fronts.given_back):  # (told what it is: fewer system calls)
            connection = socket.socket(self._family, socket.SOCK_STREAM, 0, fd)
            if self._supervised is None or self._fronts.can_take_free() \
                    or not self._metrics.idle_elsewhere() \
                    or not self._supervised.give_back(connection):
                self._hand(connection)

    def _accepted(self, connection: socket.socket) -> None:
        self._metrics.accepted_connection()
        self._hand(connection)

    def _hand(self, connection: socket.socket) -> None:
        """To a front end that can take it; served here while none runs or every one is
        stuck; and, while every one is busy (in a call, or decoding a large request),
        served here if it asks for a GET (health, readiness, metadata, metrics: answered
        at once), else handed."""
        if self._fronts.hand(connection, busy_ones=False):
            return
        loop = asyncio.get_running_loop()  # (a system call: asyncio's check of the pid)
        if self._fronts.can_take():
            loop.create_task(self._get_here(connection))
        else:
            loop.create_task(self._serve_here(connection))

    async def _get_here(self, connection: socket.socket) -> None:
        """Every front end can take a connection but is busy: connection's first
        request is served here if it is a GET, else handed to a front end; its request
        line is waited for first (see multipy.serve.http.connection.request_line)."""
        line = await request_line(connection, self._limits)
        if line is None:  # nothing came, or it went
            connection.close()
            return
        if line.startswith(b"GET ") or not self._fronts.hand(connection, busy_ones=True):
            await self._serve_here(connection)

    async def _serve_here(self, connection: socket.socket) -> None:
        """Serves the accepted connection here."""
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: self._protocol(config=self.config, server_state=self.server_state,
                                   app_state=self.lifespan.state), connection)

    def _supervisor_gone(self) -> None:
        self.should_exit = True

    async def shutdown(self, sockets: list | None = None) -> None:
        if self._accepting is not None or self._supervised is not None:
            # stop accepting, then answer what was received
            if self._accepting is not None:
                await stop_accepting(self._accepting, self.listener)
            else:
                self._supervised.stop_listening()
            await asyncio.to_thread(self._fronts.stop)
        self._loop.remove_reader(self._fronts.given_back)  # (none is given back now)
        self._fronts.close()
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the exit status (0 after a
    graceful stop, 1 if the models failed to load).  SystemExit(2), before it listens,
    with one error line naming the address and --port if it cannot listen (the port is
    taken, say), or what is wrong with a model: an archive that is not one, a class that
    is not to be found, or whose code raised as the first interpreter loaded it
    (Service.prepare; then with the interpreter's traceback)."""
    make_room()  # re-executes this process with room for 15 interpreters if it lacks it
    began = time.monotonic()  # "ready in" counts from here: loads before listening too
    parse = parser()
    args = parse.parse_args(argv)
    served = options(args, parse)
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            parse.exit(1, "multipy serve --ray needs the 'ray' extra, which installs Ray "
                          "Serve: pip install 'multipy-interpreters[ray]' (from a checkout: "
                          "pip install -e '.[ray]')\n")
        from .on_ray import serve_on_ray

        return serve_on_ray(served, replicas=args.replicas or 1, replica_cpus=args.replica_cpus,
                            address=args.ray_address, host=args.host, port=args.port,
                            logging_config=logging_config())
    if args.processes > 1:
        return _supervise(args, served, parse, sys.argv[1:] if argv is None else argv)
    logging.config.dictConfig(logging_config())
    if args.link is not None:  # a process of --processes: its supervisor reserved the port
        link = Link.inherited(args.link)
        start, fds = link.first()
        if not isinstance(start, Start):
            raise ConnectionError(f"the supervisor's first message is {start}, not its Start")
        place = Place(start.process, start.processes, fds[0], start.slots, fds[1])
        grpc = None if args.grpc_port is None else _host_port(args.host, args.grpc_port)
        reserved = None
        bound = None
        shared = socket.socket(fileno=fds[2])  # the supervisor's listening socket
    else:  # (bound first: a port that is taken is said before anything else)
        link, place = None, Place()
        bound = bind(args.host, args.port)
        reserved = None if args.grpc_port is None else \
            reserve_port(args.host, args.grpc_port, parse)
        grpc = None if reserved is None else _address(reserved)
        shared = None
    service = Service(served, place)
    if link is not None:  # its supervisor reads which interpreter's call crashed it there
        _host.crash_cell(service.metrics.crash_cell())
    try:  # (a class's own errors stop the server before it listens)
        service.prepare()
    except model_class.ClassError as error:
        service.close()
        refuse(error, parse)
    except KeyboardInterrupt:  # Ctrl-C meanwhile: stopped, as while the models load later
        return 0
    except Exception as error:  # the interpreters did not start: as if later, status 1
        service.close()
        _start_failed(error)
        return 1
    supervised = None if link is None else Supervised(link, service)
    if supervised is not None:
        supervised.prepared()
    listener = None if bound is None else listen(bound)
    fronts = FrontEnds()
    loader = threading.Thread(target=lambda: _load(service, server, fronts, grpc, supervised,
                                                    shared, began),
                              daemon=True, name="multipy-serve-start")
    app = create_app(service, loader.start)
    config = Config(app, host=args.host, port=args.port, lifespan="on", ws="none",
                    access_log=False, log_config=logging_config(),
                    timeout_graceful_shutdown=served.graceful_timeout)
    server = _Server(config, fronts, served.limits, service.metrics, listener, supervised,
                     (shared if bound is None else bound).family)
    server.run()
    server.begun.set()  # (stopped before it started)
    if reserved is not None:
        reserved.close()
    if loader.is_alive():  # stopped while loading: the interpreters stop at exit
        return 0
    service.close()
    return 1 if service.failure is not None else 0


def _start_failed(error: BaseException) -> None:
    """Logs why the start-up failed, with the traceback."""
    logger.error("start-up failed: %s: %s", type(error).__name__, error, exc_info=error)


def reserve_port(host: str, port: int, parse: argparse.ArgumentParser) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT that never listens: it keeps the
    port (a free one for 0) for the front ends' gRPC servers, which bind it too.  Exits
    through parse if it cannot, or if another socket has the port (bound with
    SO_REUSEPORT too, it would share the connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reserved = socket.socket(family, socket.SOCK_STREAM)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as alone:  # the port is free
            alone.bind((host, port))
            port = alone.getsockname()[1]
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((host, port))
    except OSError as error:
        reserved.close()
        parse.exit(2, f"multipy serve: cannot listen for gRPC on {host}:{port}: {error} "
                      f"(--grpc-port picks another port)\n")
    return reserved


def _supervise(args: argparse.Namespace, served: Options, parse: argparse.ArgumentParser,
               argv: list[str]) -> int:
    """Runs the server as --processes server processes (multipy.serve.processes.supervisor)."""
    logging.config.dictConfig(logging_config())
    reserved = None if args.grpc_port is None else reserve_port(args.host, args.grpc_port, parse)
    tunables = Tunables(args.health_timeout or HEALTH_TIMEOUT, args.max_requests,
                        args.max_requests_jitter)
    supervisor = Supervisor(argv, args.processes, served.interpreters, served.slots, args.host,
                            args.port, reserved, served.graceful_timeout,
                            [spec.name for spec in served.models], tunables)
    try:
        return supervisor.run()
    finally:
        if reserved is not None:
            reserved.close()


def _address(reserved: socket.socket) -> str:
    """The "HOST:PORT" that a reserved socket holds, as gRPC names it."""
    return _host_port(*reserved.getsockname()[:2])


def _host_port(host: str, port: int) -> str:
    """"HOST:PORT" as gRPC names it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _load(service: Service, server: _Server, fronts: FrontEnds, grpc: str | None,
          supervised: Supervised | None, shared: socket.socket | None, began: float) -> None:
    """Loads the models once the server listens, then starts the interpreters' front
    ends (with gRPC on grpc, "HOST:PORT", if given; accepting on the server's listening
    socket, or on shared, the supervisor's, once it says so); stops the server if either
    fails.
    A supervised process then tells its supervisor.  Its "ready in" counts from began,
    the command's start (models written as classes load once before it listens)."""
    server.begun.wait()
    if server.should_exit:
        return
    try:
        service.start(before_ready=lambda: _start_front_ends(service, server, fronts, grpc,
                                                             supervised, shared))
    except BaseException as error:
        if server.should_exit:  # stopped meanwhile: nothing failed
            return
        service.failure = error
        _start_failed(error)
        server.should_exit = True
        return
    if supervised is not None:
        supervised.ready()
    names = ", ".join(service.models)
    also = "" if grpc is None else f", gRPC on {grpc}"
    logger.info(f"ready in {time.monotonic() - began:.1f} s: {names} on "
                f"{service.interpreters} interpreter(s), "
                f"http://{server.config.host}:{server.config.port}/v2/models/NAME/infer{also}")


def _start_front_ends(service: Service, server: _Server, fronts: FrontEnds, grpc: str | None,
                      supervised: Supervised | None, shared: socket.socket | None) -> None:
    """Starts the interpreters' front ends, which accept on the server's listening
    socket; a supervised process's, on shared, once its supervisor says so."""
    if supervised is not None:
        try:
            fronts.start(service, grpc, supervised, shared, accepting=False)
        finally:  # (each front end has its own descriptor of it: a stop closes them all)
            shared.close()
    else:
        fronts.start(service, grpc, supervised, server.listener)
    server.front_ends_accept(service.metrics.accepted_connections)


if __name__ == "__main__":
    sys.exit(main())
