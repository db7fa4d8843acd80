"""``multipy serve PATH [PATH ...]``: the command line, and the HTTP server's life.

The Starlette application (multipy.serve.app) runs on uvicorn, on event loops of their
own: one per interpreter, each on its own thread (one loop when batching, or a
per-request timeout, needs every request on one loop).  The main thread's loop accepts
the connections and hands each to the least busy loop, so that N clients' keep-alive
connections land on N loops; a loop that serves one connection runs its model calls on
its own thread (multipy.serve.models.serve_inline), the way a worker process of other
servers does, with no hand-over to a worker thread and back.  However many loops call,
one call per interpreter runs at a time (multipy.serve.models.Turns).  The main thread also
catches the signals and runs the application's lifespan.  The models load on a thread of
their own once the server listens, so that ``/v2/health/live`` answers at once and
``/v2/health/ready`` says when loading is done.  SIGTERM and SIGINT stop the server
gracefully: it stops accepting connections, answers every request it has received, and
the process exits 0 (a second SIGINT forces it).
``multipy serve`` runs this through ``multipy run``'s launcher, with room for 15
interpreters; ``python -m multipy.serve`` re-executes itself to get it (make_room).
With ``--ray``, the same options make the same application in each replica of a Ray
Serve deployment instead (multipy.serve.on_ray), and this process only deploys it.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import importlib.util
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from .._glibc import MAX_NAMESPACES
from .._launch import make_room
from .._pool import capacity
from ..manager import cores
from .app import create_app
from .archive import ArchiveError, check
from .models import ModelSpec, ServingLoop, serve_inline
from .protocol import MAX_REQUEST_SIZE
from .service import Options, Service, default_interpreters

logger = logging.getLogger("multipy.serve")

DESCRIPTION = """\
Serves torch.package archives over HTTP/REST with the Open Inference Protocol (KServe's
v2 protocol, which Triton speaks too): every interpreter runs every model, requests go to
free interpreters, and the host process never imports torch.  Each PATH's object at
(--module, --resource) is served as a model named after the file's stem."""


def parser() -> argparse.ArgumentParser:
    """The options of ``multipy serve``."""
    parse = argparse.ArgumentParser(prog="multipy serve", description=DESCRIPTION)
    parse.add_argument("paths", metavar="PATH", nargs="+", help="a torch.package archive")
    parse.add_argument("--module", default="model",
                       help="the package that holds the model in each archive (default: model)")
    parse.add_argument("--resource", default="model.pkl",
                       help="the model's pickle in that package (default: model.pkl)")
    parse.add_argument("--name", help="the model's name, with one PATH (default: the file's stem)")
    parse.add_argument("--interpreters", type=int, metavar="N",
                       help=f"interpreters, each running every model (default: the cores, "
                            f"{cores()} here, at most as many as fit)")
    parse.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parse.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parse.add_argument("--max-batch-size", type=int, default=1, metavar="B",
                       help="batch requests along their first dimension up to B rows "
                            "(default: 1, no batching)")
    parse.add_argument("--batch-timeout-ms", type=float, default=5.0, metavar="T",
                       help="how long a request waits for others to batch with, in "
                            "milliseconds (default: 5)")
    parse.add_argument("--timeout", type=float, metavar="S",
                       help="answer a request with an error after S seconds, cancelling "
                            "its call (default: no limit)")
    parse.add_argument("--max-request-size", type=int, default=MAX_REQUEST_SIZE, metavar="BYTES",
                       help=f"answer 413 to a request body, or a compressed body expanded, "
                            f"of more than BYTES (default: {MAX_REQUEST_SIZE}, 64 MiB)")
    ray = parse.add_argument_group(
        "Ray Serve", "With --ray, the models are served by replicas of a Ray Serve "
                     "deployment, each a process of --interpreters interpreters answering "
                     "the same routes, behind Ray Serve's HTTP proxy on --host and --port; "
                     "needs the 'ray' extra (docs/serving.md, \"Scaling out with Ray "
                     "Serve\")")
    ray.add_argument("--ray", action="store_true",
                     help="serve through Ray Serve, on a Ray cluster")
    ray.add_argument("--replicas", type=int, metavar="R",
                     help="replica processes, each with --interpreters interpreters "
                          "(default: 1)")
    ray.add_argument("--replica-cpus", type=float, metavar="C",
                     help="CPUs Ray reserves for each replica, which places replicas by "
                          "them; each interpreter gets C / N torch threads (default: N, "
                          "--interpreters)")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the Ray cluster to deploy on, as ray.init takes it (\"auto\", "
                          "HOST:6379); default: start a local Ray for this process, shut "
                          "down when it stops")
    return parse


def specs(args: argparse.Namespace, parse: argparse.ArgumentParser) -> list[ModelSpec]:
    """The models the arguments name; exits through parse with a message if two share
    a name, or --name is given with several paths."""
    if args.name is not None and len(args.paths) != 1:
        parse.error("--name names one model: give one PATH with it")
    found: list[ModelSpec] = []
    for path in args.paths:
        name = args.name or os.path.splitext(os.path.basename(path))[0]
        if any(spec.name == name for spec in found):
            parse.error(f"two archives would both be served as {name!r}: rename one "
                        f"(or serve them from two servers)")
        found.append(ModelSpec(name, os.path.abspath(path), args.module, args.resource))
    return found


class _Server(uvicorn.Server):
    """uvicorn's server, but a graceful stop by SIGTERM or SIGINT ends the process with
    exit status 0 (uvicorn raises the signal again once it has stopped).  It listens
    and hands each connection it accepts to one of its loops (see the module's
    docstring), and stops them first when it stops."""

    def __init__(self, config: uvicorn.Config, loops: _ConnectionLoops) -> None:
        super().__init__(config)
        self._loops = loops
        self._accepting: asyncio.Task | None = None

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

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second SIGINT: the loops stop at once too
            self._loops.force()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup([])  # the lifespan; the loops serve the connections
        if self.should_exit:
            return
        try:
            listener = self.config.bind_socket()  # says why it cannot, and exits
        except SystemExit:  # (the port is taken, say): the lifespan ends first, as uvicorn's
            await self.lifespan.shutdown()
            raise
        self.config.port = listener.getsockname()[1]  # the port --port 0 got, for the ready line
        listener.listen(self.config.backlog)
        listener.setblocking(False)
        self._loops.start()
        self._accepting = asyncio.get_running_loop().create_task(self._loops.accept(listener))
        self._accepting.add_done_callback(self._accepted)

    def _accepted(self, accepting: asyncio.Task) -> None:
        """When accepting ends: by itself (every loop has stopped), the server stops."""
        if not accepting.cancelled():
            self.should_exit = True

    async def shutdown(self, sockets: list | None = None) -> None:
        if self._accepting is not None:  # stop accepting, then answer what was received
            self._accepting.cancel()
            await asyncio.to_thread(self._loops.stop)
        await super().shutdown(sockets)


class _ConnectionLoops:
    """``count`` uvicorn servers of one application, each on an event loop on a thread
    of its own and with no socket of its own: ``accept`` hands them the connections."""

    def __init__(self, app: Any, count: int, inline: bool) -> None:
        self._app, self._inline = app, inline
        # in the order their loops started
        self._servers: list[uvicorn.Server] = []
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._serving: list[ServingLoop] = []
        self._threads = [threading.Thread(target=self._run, name=f"{_LOOP_THREAD}{k}",
                                          daemon=True) for k in range(count)]
        self._started = threading.Barrier(count + 1)
        self._lock = threading.Lock()
        self._forced = False

    def __len__(self) -> int:
        return len(self._threads)

    def start(self) -> None:
        """Starts the loops and waits for them; BrokenBarrierError if one failed."""
        for thread in self._threads:
            thread.start()
        self._started.wait()

    def _run(self) -> None:
        try:
            server = _LoopServer(uvicorn.Config(self._app, lifespan="off", access_log=False,
                                                log_config=None, timeout_graceful_shutdown=None),
                                 self._started_serving)
            server.run(sockets=[])
        finally:
            self._started.abort()  # (once started, a no-op: no one waits any more)

    def _started_serving(self, server: uvicorn.Server) -> None:
        """On each loop's thread, once its server runs."""
        serving = ServingLoop(server.server_state.connections)
        if self._inline:
            serve_inline(serving)
        with self._lock:
            self._servers.append(server)
            self._loops.append(asyncio.get_running_loop())
            self._serving.append(serving)
        self._started.wait()

    def _load(self, k: int) -> float:
        """How busy loop k is: its connections, open and arriving, and one more while it
        calls a model on its own thread (it answers nothing else meanwhile); a loop
        that has stopped running takes none."""
        if not self._loops[k].is_running():
            return math.inf
        serving = self._serving[k]
        return len(serving.connections) + serving.arriving + serving.calling

    async def accept(self, listener: Any) -> None:
        """Accepts connections on listener until cancelled, handing each to the least
        busy loop.  An error accepting one (too many open files, say) is logged, and
        accepting goes on after a pause.  Returns, with an error logged, if every loop
        has stopped (they stop only when this is cancelled, unless one fails)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    connection, _ = await loop.sock_accept(listener)
                except OSError as error:
                    logger.error("accepting a connection failed, trying again in %s s: %s",
                                 _ACCEPT_PAUSE, error)
                    await asyncio.sleep(_ACCEPT_PAUSE)
                    continue
                if not self._hand(connection):
                    connection.close()
                    logger.error("every connection loop has stopped: the server stops")
                    return
        finally:
            listener.close()

    def _hand(self, connection: Any) -> bool:
        """Hands connection to the least busy loop that runs; False if none does."""
        while True:
            with self._lock:
                k = min(range(len(self._servers)), key=self._load)
                if not self._loops[k].is_running():  # the least busy has stopped: all have
                    return False
                self._serving[k].arriving += 1
            arrived = self._arrival(k)
            try:
                handed = asyncio.run_coroutine_threadsafe(
                    _connect(self._servers[k], connection, arrived), self._loops[k])
            except RuntimeError:  # that loop closed meanwhile: another one
                arrived()
                continue
            handed.add_done_callback(lambda done, k=k, connection=connection, arrived=arrived:
                                     self._handed(k, done, connection, arrived))
            return True

    def _arrival(self, k: int) -> Callable[[], None]:
        """What to call when a connection handed to loop k is there (it is one of the
        loop's connections) or will never be: it is no longer arriving.  Once."""
        arriving = [True]

        def arrived() -> None:
            with self._lock:
                if arriving:
                    arriving.clear()
                    self._serving[k].arriving -= 1
        return arrived

    def _handed(self, k: int, done: concurrent.futures.Future, connection: Any,
                arrived: Callable[[], None]) -> None:
        """Once the hand-over of connection to loop k has ended, well or not."""
        arrived()
        if done.cancelled():  # the loop ended first
            connection.close()
        elif done.exception() is not None:
            logger.error("handing a connection to loop %d failed, closing it: %r",
                         k, done.exception())
            connection.close()

    def stop(self) -> None:
        """Stops every loop gracefully (each answers what it has received) and waits for
        them, until ``force``."""
        for server in self._servers:
            server.should_exit = True
        for thread in self._threads:
            while thread.is_alive() and not self._forced:
                thread.join(0.1)

    def force(self) -> None:
        """Stops the loops at once, as uvicorn does on a second SIGINT (a call running
        on a loop's thread still ends first), and ends ``stop``'s wait."""
        self._forced = True
        for server in self._servers:
            server.force_exit = True


#: seconds between a failed accept and the next try
_ACCEPT_PAUSE = 0.1


async def _connect(server: uvicorn.Server, connection: Any, arrived: Callable[[], None]) -> None:
    """On server's loop: serves the accepted socket connection there, calling arrived
    as it becomes one of the server's connections.  One that arrives once the server is
    stopping (it waited for a call on the loop's thread) is shut down as the server shut
    down its others, which it may have done already: a request it has received is
    answered, then it closes; with none, it closes."""
    def protocol() -> asyncio.Protocol:
        arrived()
        return server.config.http_protocol_class(
            config=server.config, server_state=server.server_state,
            app_state=server.lifespan.state)

    _, served = await asyncio.get_running_loop().connect_accepted_socket(protocol, connection)
    if server.should_exit:
        await asyncio.sleep(0)  # a turn of the loop, which reads what the socket holds
        served.shutdown()


class _LoopServer(uvicorn.Server):
    """A server of _ConnectionLoops: calls started(self) on its loop once it runs."""

    def __init__(self, config: uvicorn.Config, started: Any) -> None:
        super().__init__(config)
        self._started = started

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        self._started(self)


class _OneServerLines(logging.Filter):
    """Drops uvicorn's information lines (starting, stopping) of each connection loop's
    server: the process is one server, whose main thread says those once.  Warnings
    and errors stay, and so do the lines of a graceful stop that say what it waits for
    ("Waiting for connections to close"), once each."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or not record.threadName.startswith(_LOOP_THREAD):
            return True
        message = record.getMessage()
        if not message.startswith("Waiting for"):
            return False
        with self._lock:
            said = message in self._said
            self._said.add(message)
        return not said


_LOOP_THREAD = "multipy-serve-loop-"


def _logging_config() -> dict:
    """uvicorn's logging, with multipy.serve's lines formatted as uvicorn's own, and
    uvicorn's information lines from the connection loops' servers left out."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["multipy.serve"] = {"handlers": ["default"], "level": "INFO",
                                          "propagate": False}
    config.setdefault("filters", {})["one_server"] = {"()": _OneServerLines}
    config["loggers"]["uvicorn.error"]["filters"] = ["one_server"]
    return config


def options(args: argparse.Namespace, parse: argparse.ArgumentParser) -> Options:
    """What the arguments ask to serve, and how; exits through parse with a message if
    they make no sense or an archive is not one (checked here before anything starts)."""
    models = specs(args, parse)
    if args.ray:  # each replica is a process of its own, with room for 15
        fit, where = MAX_NAMESPACES, "what fits in one replica process"
    else:
        room = capacity()
        fit, where = room["free"] + room["more"], "what fits in this process"
        for option in ("replicas", "replica_cpus", "ray_address"):
            if getattr(args, option) is not None:
                parse.error(f"--{option.replace('_', '-')} is an option of --ray")
    interpreters = args.interpreters if args.interpreters is not None else default_interpreters()
    if not 1 <= interpreters <= fit:
        parse.error(f"--interpreters must be between 1 and {fit} ({where}), not {interpreters}")
    if args.max_batch_size < 1:
        parse.error("--max-batch-size must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parse.error("--timeout must be a number of seconds above 0")
    if args.max_request_size < 1:
        parse.error("--max-request-size must be at least 1 byte")
    if args.ray and args.replicas is not None and args.replicas < 1:
        parse.error("--replicas must be at least 1")
    if args.ray and args.replica_cpus is not None and not args.replica_cpus > 0:
        parse.error("--replica-cpus must be above 0")
    try:
        for spec in models:
            check(spec.path, spec.module, spec.resource)
    except ArchiveError as error:
        parse.exit(2, f"multipy serve: {error}\n")
    return Options(tuple(models), interpreters, args.max_batch_size, args.batch_timeout_ms,
                   args.timeout, max_request_size=args.max_request_size)


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the exit status (0 after a
    graceful stop, 1 if the models failed to load).  SystemExit(3), with uvicorn's one
    error line, if it cannot listen (the port is taken, say)."""
    make_room()  # re-executes this process with room for 15 interpreters if it lacks it
    parse = parser()
    args = parse.parse_args(argv)
    served = options(args, parse)
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            parse.exit(1, "multipy serve --ray needs the 'ray' extra, which installs Ray "
                          "Serve: pip install 'multipy[ray]' (from a checkout: "
                          "pip install -e '.[ray]')\n")
        from .on_ray import serve_on_ray

        return serve_on_ray(served, replicas=args.replicas or 1, replica_cpus=args.replica_cpus,
                            address=args.ray_address, host=args.host, port=args.port,
                            logging_config=_logging_config())
    service = Service(served)
    loader = threading.Thread(target=lambda: _load(service, server), daemon=True,
                              name="multipy-serve-start")
    app = create_app(service, loader.start)
    # A loop per interpreter, which calls models on its own thread while it serves one
    # connection; one loop when batching (a batch gathers requests on one loop) or a
    # per-request timeout (bounded by the loop, on a worker thread) needs it.
    inline = served.max_batch_size == 1 and served.timeout is None
    loops = _ConnectionLoops(app, served.interpreters if inline else 1, inline)
    config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="on",
                            access_log=False, log_config=_logging_config(),
                            timeout_graceful_shutdown=None)
    server = _Server(config, loops)
    server.run()
    if loader.is_alive():  # stopped while loading: the interpreters stop at exit
        return 0
    service.close()
    return 1 if service.failure is not None else 0


def _load(service: Service, server: uvicorn.Server) -> None:
    """Loads the models once the server listens; stops the server if loading fails."""
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.should_exit:
        return
    started = time.monotonic()
    try:
        service.start()
    except BaseException as error:
        if server.should_exit:  # stopped meanwhile: nothing failed
            return
        service.failure = error
        logger.error("start-up failed: %s: %s", type(error).__name__, error, exc_info=error)
        server.should_exit = True
        return
    names = ", ".join(service.models)
    logger.info(f"ready in {time.monotonic() - started:.1f} s: {names} on "
                f"{service.interpreters} interpreter(s), "
                f"http://{server.config.host}:{server.config.port}/v2/models/NAME/infer")


if __name__ == "__main__":
    sys.exit(main())
