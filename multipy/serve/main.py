"""``multipy serve PATH [PATH ...]``: the command line, and the HTTP server's life.

Each interpreter answers requests itself, on its own GIL: its front end
(multipy._inside.front_end) runs uvicorn and the Starlette application
(multipy.serve.app) on an event loop of its own, which parses, decodes, runs the model
and answers, with no Python of the host's per request.  The host's main thread accepts
the connections and hands each to the front end with the fewest open connections
(``FrontEnds``), so that N clients' keep-alive connections land on N interpreters; it
also catches the signals and runs the lifespan.  The models load on a thread of their
own once the server listens (a model written as a class loads on the first interpreter
before, so that its code's errors are said before anything connects: Service.prepare):
until they are ready, the host answers the connections itself (``/v2/health/live`` at
once, ``/v2/health/ready`` says when loading is done), one request per connection.
SIGTERM and SIGINT stop the server
gracefully: it stops accepting connections, every front end answers every request it
has received, and the process exits 0 (a second SIGINT forces it).  With
``--grpc-port``, the host reserves that port (a socket bound with SO_REUSEPORT that never
listens) and every front end serves gRPC on it too, once the models are ready: the
kernel spreads those connections over the interpreters.
``multipy serve`` runs this through ``multipy run``'s launcher, with room for 15
interpreters; ``python -m multipy.serve`` re-executes itself to get it (make_room).
With ``--ray``, the same options make the same application in each replica of a Ray
Serve deployment instead (multipy.serve.on_ray), and this process only deploys it.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import contextlib
import importlib.util
import logging
import logging.config
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterator, NoReturn

from .. import _cuda, _host
from .._glibc import MAX_NAMESPACES
from .._launch import make_room
from .._pool import capacity
from ..manager import cores
from .app import create_app, logging_config
from . import model_class
from .archive import ArchiveError
from .connection import (MAX_HEADER_SIZE, MAX_HEADERS, READ_TIMEOUT, Limits, accept,
                         bind, guarded, listen, request_line)
from .contract import FrontEndCalls
from .control import Control
from .inbox import FORCE, STOP, open_inbox, receive, send
from .link import Link
from .models import ModelSpec
from .messages import MAX_REQUEST_SIZE, ProtocolError
from .repository import MODEL_CONTROLS, check_name
from .service import (GRACEFUL_TIMEOUT, MORE_MODELS, Options, Place, Service,
                      default_interpreters)
from .supervised import Supervised
from .supervisor import HEALTH_TIMEOUT, PING_EVERY, UNRESPONSIVE_AFTER, Supervisor, Tunables
from .uvicorn_server import Config, Server

logger = logging.getLogger("multipy.serve")

DESCRIPTION = """\
Serves torch.package archives and models written as Python classes over HTTP/REST with
the Open Inference Protocol (KServe's v2 protocol, which Triton speaks too): every
interpreter runs every model, requests go to free interpreters, and the host process
never imports torch.  Each PATH's object at (--module, --resource) is served as a model
named after the file's stem; each FILE.py:CLASS or MODULE:CLASS, as one named after the
class, in lower case (docs/serving.md, "Models written as classes")."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line, without the usage (a dozen lines,
    which ``--help`` prints)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The options of ``multipy serve``."""
    parse = _Parser(prog="multipy serve", description=DESCRIPTION)
    parse.add_argument("paths", metavar="PATH", nargs="+",
                       help="a torch.package archive, or a class: FILE.py:CLASS, MODULE:CLASS")
    parse.add_argument("--module", default="model",
                       help="the package that holds the model in each archive (default: model)")
    parse.add_argument("--resource", default="model.pkl",
                       help="the model's pickle in that package (default: model.pkl)")
    parse.add_argument("--name", help="the model's name, with one PATH (default: the file's stem)")
    parse.add_argument("--device", default="cpu", metavar="DEVICE",
                       help="where the archives' models run: cpu, cuda or cuda:N (their weights "
                            "copied to the GPU once for every interpreter; inputs go there and "
                            "outputs come back). A model class puts itself on a device in its "
                            "own load() (default: cpu)")
    parse.add_argument("--interpreters", type=int, metavar="N",
                       help=f"interpreters, each running every model, in each process "
                            f"(default: the cores, {cores()} here, divided among the "
                            f"processes, at most as many as fit in one)")
    parse.add_argument("--processes", type=int, default=1, metavar="P",
                       help="server processes, each of --interpreters interpreters, on one "
                            "port: a crash ends one process, which is replaced, and P "
                            "processes hold up to 15 P interpreters (default: 1, one "
                            "process; docs/serving.md, \"Several processes\")")
    parse.add_argument("--health-timeout", type=float, metavar="S",
                       help=f"with --processes: kill and replace a process that has not "
                            f"answered the supervisor's health check (every second, from "
                            f"its event loop) for S seconds; it gets no new connection "
                            f"after {UNRESPONSIVE_AFTER:g} (default: {HEALTH_TIMEOUT:g})")
    parse.add_argument("--max-requests", type=int, metavar="N",
                       help="with --processes: replace a process once it has answered N "
                            "inference requests, the new one ready before the old one stops "
                            "taking connections (default: never)")
    parse.add_argument("--max-requests-jitter", type=int, default=0, metavar="J",
                       help="with --max-requests: add a random 0 to J to each process's N, "
                            "so that processes are not all replaced at once (default: 0)")
    parse.add_argument("--link", type=int, help=argparse.SUPPRESS)  # a process's, from its supervisor
    parse.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parse.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parse.add_argument("--model-control", choices=MODEL_CONTROLS, default="none",
                       help="'explicit': the model repository's requests load and unload "
                            "models while the server runs (up to %d more than it starts "
                            "with); 'none' (default): it serves the models it was started "
                            "with, and refuses them" % MORE_MODELS)
    parse.add_argument("--model-repository", action="append", metavar="DIR",
                       help="with --model-control explicit: a directory whose archives the "
                            "repository's loads may read (NAME.pt, or the \"path\" a load "
                            "names, inside DIR); may be given several times, searched in "
                            "order (default: none, loads only reload the archives the "
                            "server started with)")
    parse.add_argument("--grpc-port", type=int, metavar="PORT",
                       help="also serve the protocol over gRPC on this port, once the models "
                            "are ready (8001 by convention; 0: a free one, which the ready "
                            "line names; default: no gRPC)")
    parse.add_argument("--max-batch-size", type=int, default=1, metavar="B",
                       help="batch requests along their first dimension up to B rows "
                            "(default: 1, no batching)")
    parse.add_argument("--batch-timeout-ms", type=float, default=5.0, metavar="T",
                       help="how long a request waits for others to batch with, in "
                            "milliseconds (default: 5)")
    parse.add_argument("--timeout", type=float, metavar="S",
                       help="answer a request with an error after S seconds, cancelling "
                            "its call (default: no limit)")
    parse.add_argument("--max-header-size", type=int, default=MAX_HEADER_SIZE, metavar="BYTES",
                       help=f"answer 431 to a request whose request line and headers have "
                            f"more than BYTES (default: {MAX_HEADER_SIZE})")
    parse.add_argument("--max-headers", type=int, default=MAX_HEADERS, metavar="N",
                       help=f"answer 431 to a request with more than N header fields "
                            f"(default: {MAX_HEADERS})")
    parse.add_argument("--read-timeout", type=float, default=READ_TIMEOUT, metavar="S",
                       help=f"answer 408 to a request that has not arrived whole S seconds "
                            f"after its first byte, and close a new connection that sends "
                            f"nothing for S seconds (default: {READ_TIMEOUT:g})")
    parse.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT, metavar="S",
                       help=f"on SIGTERM or SIGINT, wait at most S seconds for the requests in "
                            f"flight, then close what is left and exit (default: "
                            f"{GRACEFUL_TIMEOUT:g}; 0: no limit)")
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
        written = model_class.parse(path)
        if written is None:
            spec = ModelSpec("", os.path.abspath(path), args.module, args.resource)
            stem = os.path.splitext(os.path.basename(path))[0]
        else:
            spec = ModelSpec("", *written, kind="class")
            stem = spec.resource.lower()
        spec.name = name = args.name or stem
        try:
            check_name(name)
        except ProtocolError as error:
            parse.error(f"{path}: {error} (--name gives it another)")
        if any(spec.name == name for spec in found):
            parse.error(f"two models would both be served as {name!r}: rename one "
                        f"(or serve them from two servers)")
        found.append(spec)
    return found


class _Server(Server):
    """uvicorn's server, but a graceful stop by SIGTERM or SIGINT ends the process with
    exit status 0 (uvicorn raises the signal again once it has stopped).  It listens
    and hands each connection it accepts to an interpreter's front end (see the module's
    docstring), or serves it itself while there is none; and stops the front ends first
    when it stops.  A process of --processes (supervised) listens on nothing: its
    connections come from the supervisor."""

    def __init__(self, config: Config, fronts: FrontEnds, limits: Limits,
                 listener: socket.socket | None = None,
                 supervised: Supervised | None = None) -> None:
        super().__init__(config)
        self._fronts = fronts
        self._limits = limits
        self._listener = listener
        self._supervised = supervised
        self._protocol: Any = None
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
        if self.force_exit:  # a second SIGINT: the front ends stop at once too
            threading.Thread(target=self._fronts.force, name="multipy-serve-force",
                             daemon=True).start()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup([])  # the lifespan; connections come from accept below
        if self.should_exit:
            return
        # one request per connection served here: the next comes on a new connection,
        # which goes to a front end if one can take it
        self._protocol = guarded(self.config.http_protocol_class, self._limits,
                                 one_request=True)
        if self._supervised is not None:
            self._supervised.listen(self._hand, self._supervisor_gone)
            return
        listener = self._listener
        self.config.port = listener.getsockname()[1]  # the port --port 0 got, for the ready line
        logger.info("listening on http://%s; loading models (inference answers 503 until "
                    "the \"ready\" line; Ctrl-C stops)", _host_port(self.config.host,
                                                                 self.config.port))
        self._accepting = asyncio.get_running_loop().create_task(accept(listener, self._hand))

    def _hand(self, connection: socket.socket) -> None:
        """To a front end that can take it; served here while none runs or every one is
        stuck; and, while every one is busy (in a call, or decoding a large request),
        served here if it asks for a GET (health, readiness, metadata, metrics: answered
        at once), else handed."""
        loop = asyncio.get_running_loop()
        if self._fronts.hand(connection, busy_ones=False):
            return
        if self._fronts.can_take():
            loop.create_task(self._get_here(connection))
        else:
            loop.create_task(self._serve_here(connection))

    async def _get_here(self, connection: socket.socket) -> None:
        """Every front end can take a connection but is busy: connection's first
        request is served here if it is a GET, else handed to a front end; its request
        line is waited for first (see multipy.serve.connection.request_line)."""
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
                self._accepting.cancel()
            else:
                self._supervised.stop_listening()
            await asyncio.to_thread(self._fronts.stop)
        await super().shutdown(sockets)


#: seconds a front end may take to start serving
_START_TIMEOUT = 60.0


class FrontEnds:
    """The interpreters' front ends (multipy._inside.front_end), once the models are
    ready: each runs in its interpreter on a host thread of its own.  ``hand`` gives
    each new connection to the one with the fewest open connections (then the fewest
    calls running), skipping any that has stopped, by writing its file descriptor into
    that front end's inbox: the host never waits for an interpreter's GIL to hand one.
    The host owns the inboxes: what a front end leaves in its inbox when it ends, the
    host closes."""

    def __init__(self) -> None:
        self._fronts: list[FrontEndCalls] = []  # the FrontEnd in each interpreter
        self._threads: list[threading.Thread] = []
        self._inboxes: list[tuple[int, int]] = []  # (read end, write end) of each
        self._handed: list[int] = []  # connections handed to each, ever
        self._metrics: Any = None
        self._control: Control | None = None
        self._stopping = False
        self._forced = False
        self._lock = threading.Lock()

    def start(self, service: Service, grpc: str | None = None,
              repository: Any = None) -> None:
        """Makes a front end in each interpreter of service, which is loaded, and runs
        them, each also serving gRPC on grpc ("HOST:PORT") if given, their model
        repository requests done by repository (default: the service; see
        multipy.serve.control); raises what failed."""
        options, metrics = service.options, service.metrics
        settings = {"names": list(service.models), "interpreters": service.interpreters,
                    "board": metrics.board.address, "rows": metrics.board.rows,
                    "first": metrics.first, "processes": metrics.processes,
                    "max_batch_size": options.max_batch_size,
                    "batch_delay": options.batch_timeout_ms / 1000, "timeout": options.timeout,
                    "max_request_size": options.max_request_size,
                    "limits": dataclasses.asdict(options.limits),
                    "stuck_after": metrics.stuck_after,
                    "graceful_timeout": options.graceful_timeout, "grpc": grpc,
                    "states": service.states, "model_control": service.model_control,
                    "refused": None if service.refused is None else service.refused.address,
                    "slots": metrics.slots,
                    "described": {name: model.described for name, model in service.models.items()}}
        fronts, inboxes, controls = [], [], []
        interpreters = service.manager.all_instances()
        try:
            for k, interpreter in enumerate(interpreters):
                inboxes.append(open_inbox())
                controls.append(open_inbox())
                loaded = {name: model.instance(interpreter)
                          for name, model in service.models.items()}
                make = interpreter.global_("multipy._inside.front_end", "FrontEnd")
                fronts.append(FrontEndCalls(make(loaded, {
                    **settings, "row": k + 1, "inbox": inboxes[k][0],
                    "control": controls[k][1]})))
        except BaseException:
            for pipe in inboxes + controls:
                os.close(pipe[0])
                os.close(pipe[1])
            raise
        self._control = Control(service, fronts, interpreters, controls, repository)
        self._control.start()
        threads = [threading.Thread(target=self._run, args=(k,), daemon=True,
                                    name=f"multipy-serve-front-{k}") for k in range(len(fronts))]
        with self._lock:
            self._fronts, self._threads, self._inboxes = fronts, threads, inboxes
            self._metrics, self._handed = metrics, [0] * len(fronts)
            for thread in threads:
                thread.start()
            if self._stopping:  # stopped while they were made
                self._tell(STOP)
        for k, front in enumerate(fronts):  # (gRPC connections find a server listening)
            if not front.wait_serving(_START_TIMEOUT) and not self._stopping:
                raise RuntimeError(f"interpreter {k}'s front end did not start serving "
                                   f"within {_START_TIMEOUT} s (its error, if any, is above)")

    def _run(self, k: int) -> None:
        try:
            self._fronts[k].run()
        except BaseException as error:
            if not self._stopping:
                logger.error("interpreter %d's front end failed; the others serve its "
                             "connections from now on: %s: %s", k, type(error).__name__,
                             error, exc_info=error)
        finally:
            with self._lock:  # nothing is written into its inbox any more
                read, write = self._inboxes[k]
                self._inboxes[k] = (-1, -1)
            _close_left(read)
            os.close(write)

    def _open(self) -> list[int]:
        """Under the lock: the front ends that run and are not stuck (multipy.serve.
        metrics.Metrics.stuck)."""
        if self._stopping:
            return []
        return [k for k, (_, write) in enumerate(self._inboxes)
                if write >= 0 and self._metrics.stuck(k + 1) is None]

    def can_take(self) -> bool:
        """Whether a front end runs that is not stuck."""
        with self._lock:
            return bool(self._open())

    def hand(self, connection: socket.socket, busy_ones: bool) -> bool:
        """Gives connection to the front end with the fewest open connections (then the
        least busy) among those that run and are not stuck, and, unless busy_ones, are
        not busy (in a call, or decoding a large request: Metrics.busy); False if there
        is none (the caller serves it)."""
        with self._lock:
            metrics = self._metrics
            running = [k for k in self._open() if busy_ones or not metrics.busy(k + 1)]
            if not running:
                return False
            k = min(running, key=lambda k: (
                self._handed[k] - metrics.closed_connections(k + 1), metrics.busy(k + 1)))
            fd = connection.detach()
            try:
                send(self._inboxes[k][1], fd)
            except OSError as error:  # its inbox is full: thousands wait there
                os.close(fd)
                logger.error("interpreter %d's front end has not taken the connections "
                             "handed to it (%s): closing a new one", k, error)
                return True
            self._handed[k] += 1
        return True

    def stop(self) -> None:
        """Stops every front end gracefully (each serves the connections handed to it
        and answers what it has received) and waits for them, until ``force``."""
        with self._lock:
            self._stopping = True
            self._tell(STOP)
        for thread in self._threads:
            while thread.is_alive() and not self._forced:
                thread.join(0.1)
        if self._control is not None and not self._forced:
            self._control.close()

    def force(self) -> None:
        """Stops the front ends at once, as uvicorn does on a second SIGINT (a model
        call still ends first), and ends ``stop``'s wait."""
        self._forced = True
        with self._lock:
            self._tell(FORCE)

    def _tell(self, message: int) -> None:
        """Under the lock: message to every front end that runs."""
        for k, (_, write) in enumerate(self._inboxes):
            if write >= 0:
                try:
                    send(write, message)
                except OSError as error:
                    logger.error("interpreter %d's front end could not be told to stop: %s",
                                 k, error)


def _close_left(inbox: int) -> None:
    """Closes the connections left in an inbox that no front end reads any more, and
    the inbox."""
    try:
        while left := receive(inbox):
            for fd in left:
                if fd >= 0:
                    os.close(fd)
    finally:
        os.close(inbox)


def options(args: argparse.Namespace, parse: argparse.ArgumentParser) -> Options:
    """What the arguments ask to serve, and how; exits through parse with a message if
    they make no sense or an archive is not one (checked here before anything starts)."""
    models = specs(args, parse)
    if args.processes < 1:
        parse.error("--processes must be at least 1")
    if args.ray and args.processes != 1:
        parse.error("--processes is not served with --ray: --replicas sets its processes")
    for option in ("health_timeout", "max_requests"):
        if getattr(args, option) is not None and args.processes == 1 and args.link is None:
            parse.error(f"--{option.replace('_', '-')} is an option of --processes (2 or more)")
    if args.health_timeout is not None and not args.health_timeout >= 2 * PING_EVERY:
        parse.error(f"--health-timeout must be at least {2 * PING_EVERY:g} seconds")
    if args.max_requests is not None and args.max_requests < 1:
        parse.error("--max-requests must be at least 1")
    if args.max_requests_jitter < 0 or args.max_requests_jitter and args.max_requests is None:
        parse.error("--max-requests-jitter is a number of requests (0 or more), with "
                    "--max-requests")
    if args.ray:  # each replica is a process of its own, with room for 15
        fit, where = MAX_NAMESPACES, "what fits in one replica process"
    else:
        room = capacity()
        fit, where = room["free"] + room["more"], "what fits in this process"
        for option in ("replicas", "replica_cpus", "ray_address"):
            if getattr(args, option) is not None:
                parse.error(f"--{option.replace('_', '-')} is an option of --ray")
    if args.ray and args.grpc_port is not None:
        parse.error("--grpc-port is not served with --ray: Ray Serve's proxy speaks HTTP")
    if args.ray and args.model_control != "none":
        parse.error("--model-control explicit is not served with --ray: redeploy to change "
                    "the models")
    repositories = tuple(os.path.realpath(d) for d in args.model_repository or ())
    if repositories and args.model_control != "explicit":
        parse.error("--model-repository is for --model-control explicit")
    for directory in repositories:
        if not os.path.isdir(directory):
            parse.error(f"--model-repository {directory}: not a directory")
    for option, port in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if port is not None and not 0 <= port <= 65535:
            parse.error(f"{option} must be a port number, 0 to 65535 (0: a free one), not {port}")
    interpreters = args.interpreters if args.interpreters is not None else \
        default_interpreters(args.processes)
    if not 1 <= interpreters <= fit:
        parse.error(f"--interpreters must be between 1 and {fit} ({where}), not {interpreters}")
    if args.max_batch_size < 1:
        parse.error("--max-batch-size must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parse.error("--timeout must be a number of seconds above 0")
    for option in ("max_request_size", "max_header_size", "max_headers"):
        if getattr(args, option) < 1:
            parse.error(f"--{option.replace('_', '-')} must be at least 1")
    if not args.read_timeout > 0:
        parse.error("--read-timeout must be a number of seconds above 0")
    if args.graceful_timeout < 0:
        parse.error("--graceful-timeout must be a number of seconds, 0 for no limit")
    if args.device != "cpu":
        if re.fullmatch(r"cuda(:\d+)?", args.device) is None:
            parse.error(f"--device must be cpu, cuda or cuda:N (a GPU's index), not {args.device!r}")
        if _cuda.driver() is None:
            parse.error(f"--device {args.device}: this machine has no CUDA driver that loads "
                        f"(multipy info)")
    if args.ray and args.replicas is not None and args.replicas < 1:
        parse.error("--replicas must be at least 1")
    if args.ray and args.replica_cpus is not None and not args.replica_cpus > 0:
        parse.error("--replica-cpus must be above 0")
    try:
        for spec in models:
            spec.check()
    except (ArchiveError, model_class.ClassError) as error:
        _refuse(error, parse)
    return Options(tuple(models), interpreters, args.max_batch_size, args.batch_timeout_ms,
                   args.timeout, max_request_size=args.max_request_size,
                   limits=Limits(args.max_header_size, args.max_headers, args.read_timeout),
                   graceful_timeout=args.graceful_timeout or None,
                   model_control=args.model_control, model_repository=repositories,
                   device=args.device)


def _refuse(error: ArchiveError | model_class.ClassError,
            parse: argparse.ArgumentParser) -> NoReturn:
    """Exits with status 2 and what is wrong with a model: one line, then the
    interpreter's traceback for a class whose code raised there."""
    parse.exit(2, f"multipy serve: {error}\n{getattr(error, 'traceback', '')}")


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the exit status (0 after a
    graceful stop, 1 if the models failed to load).  SystemExit(2), before it listens,
    with one error line naming the address and --port if it cannot listen (the port is
    taken, say), or what is wrong with a model: an archive that is not one, a class that
    is not to be found, or whose code raised as the first interpreter loaded it
    (Service.prepare; then with the interpreter's traceback)."""
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
                            logging_config=logging_config())
    if args.processes > 1:
        return _supervise(args, served, parse, sys.argv[1:] if argv is None else argv)
    logging.config.dictConfig(logging_config())
    if args.link is not None:  # a process of --processes: its supervisor reserved the port
        link = Link.inherited(args.link)
        start, fds = link.first()
        place = Place(start["process"], start["processes"], fds[0], start["slots"], fds[1])
        grpc = None if args.grpc_port is None else _host_port(args.host, args.grpc_port)
        reserved = None
        bound = None
    else:  # (bound first: a port that is taken is said before anything else)
        link, place = None, Place()
        bound = bind(args.host, args.port)
        reserved = None if args.grpc_port is None else \
            reserve_port(args.host, args.grpc_port, parse)
        grpc = None if reserved is None else _address(reserved)
    service = Service(served, place)
    if link is not None:  # its supervisor reads which interpreter's call crashed it there
        _host.crash_cell(service.metrics.crash_cell())
    try:  # (a class's own errors stop the server before it listens)
        service.prepare()
    except model_class.ClassError as error:
        service.close()
        _refuse(error, parse)
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
    loader = threading.Thread(target=lambda: _load(service, server, fronts, grpc, supervised),
                              daemon=True, name="multipy-serve-start")
    app = create_app(service, loader.start)
    config = Config(app, host=args.host, port=args.port, lifespan="on", ws="none",
                    access_log=False, log_config=logging_config(),
                    timeout_graceful_shutdown=served.graceful_timeout)
    server = _Server(config, fronts, served.limits, listener, supervised)
    server.run()
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
    """Runs the server as --processes server processes (multipy.serve.supervisor)."""
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


def _load(service: Service, server: Server, fronts: FrontEnds, grpc: str | None,
          supervised: Supervised | None) -> None:
    """Loads the models once the server listens, then starts the interpreters' front
    ends (with gRPC on grpc, "HOST:PORT", if given); stops the server if either fails.
    A supervised process then tells its supervisor."""
    while not server.started and not server.should_exit:
        time.sleep(0.01)
    if server.should_exit:
        return
    started = time.monotonic()
    try:
        service.start(before_ready=lambda: fronts.start(service, grpc, supervised))
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
    logger.info(f"ready in {time.monotonic() - started:.1f} s: {names} on "
                f"{service.interpreters} interpreter(s), "
                f"http://{server.config.host}:{server.config.port}/v2/models/NAME/infer{also}")


if __name__ == "__main__":
    sys.exit(main())
