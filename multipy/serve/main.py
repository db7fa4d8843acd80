"""``multipy serve PATH [PATH ...]``: the command line, and the HTTP server's life.

uvicorn runs the Starlette application (multipy.serve.app) on the main thread; the
models load on a thread of their own once the server listens, so that
``/v2/health/live`` answers at once and ``/v2/health/ready`` says when loading is done.
SIGTERM and SIGINT stop the server gracefully: it stops accepting connections, answers
every request it has received, and the process exits 0 (a second SIGINT forces it).
``multipy serve`` runs this through ``multipy run``'s launcher, with room for 15
interpreters; ``python -m multipy.serve`` re-executes itself to get it (make_room).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from .._launch import make_room
from .._pool import capacity
from .app import create_app
from .archive import ArchiveError
from .models import ModelSpec
from .service import Service, cores, default_interpreters

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
    exit status 0 (uvicorn raises the signal again once it has stopped)."""

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


def _logging_config() -> dict:
    """uvicorn's logging, with multipy.serve's lines formatted as uvicorn's own."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["multipy.serve"] = {"handlers": ["default"], "level": "INFO",
                                          "propagate": False}
    return config


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the exit status (0 after a
    graceful stop, 1 if the models failed to load)."""
    make_room()  # re-executes this process with room for 15 interpreters if it lacks it
    parse = parser()
    args = parse.parse_args(argv)
    models = specs(args, parse)
    room = capacity()
    fit = room["free"] + room["more"]
    interpreters = args.interpreters if args.interpreters is not None else default_interpreters()
    if not 1 <= interpreters <= fit:
        parse.error(f"--interpreters must be between 1 and {fit} (what fits in this "
                    f"process), not {interpreters}")
    if args.max_batch_size < 1:
        parse.error("--max-batch-size must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parse.error("--timeout must be a number of seconds above 0")
    try:
        service = Service(models, interpreters, args.max_batch_size,
                          args.batch_timeout_ms / 1000, args.timeout)
    except ArchiveError as error:
        parse.exit(2, f"multipy serve: {error}\n")
    loader = threading.Thread(target=lambda: _load(service, server), daemon=True,
                              name="multipy-serve-start")
    config = uvicorn.Config(create_app(service, loader.start), host=args.host, port=args.port,
                            lifespan="on", access_log=False, log_config=_logging_config(),
                            timeout_graceful_shutdown=None)
    server = _Server(config)
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
