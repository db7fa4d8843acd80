"""``multipy serve --ray``: the server as a Ray Serve deployment, for more interpreters
than one process holds and for many machines (docs/operate/ray.md).

Each replica of the deployment (``Replica``) is a Ray actor process that is what a
``multipy serve`` process is, built from the same Options: a Service (an
InterpreterManager of ``options.interpreters`` interpreters, every model materialised in
each) and multipy.serve.http.app's Starlette application over it, which Ray Serve runs as the
replica's ASGI ingress (``@serve.ingress()`` with ``__serve_build_asgi_app__``, called
once the models are loaded).  Decoding, batching, calling and encoding are the same code
as under uvicorn; Ray Serve's HTTP proxy routes each request to a replica, and the
replica's ASGI lifespan drains its batches when Ray stops it.

glibc reads its tunables only when a process starts, so each replica gets
GLIBC_TUNABLES in its runtime environment (``env_vars``), which Ray puts in the
environment of the worker process it starts for the replica; a replica that did not
start with room for 15 interpreters refuses to start.

``serve_on_ray`` is the driver: it connects to a Ray cluster (or starts a local one),
deploys, waits for SIGTERM or SIGINT and takes the deployment (and a Ray it started)
down.  Like the rest of the host side it never imports torch; the replicas' interpreters
do.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import logging.config
import math
import os
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

import ray
from ray import serve

from .._launch import has_room, launch_environment, tunables_at_start
from .._pool import capacity
from ..manager import cores
from .host.service import Options, Service
from .http.app import create_app

logger = logging.getLogger("multipy.serve")

#: The Ray Serve application's name, and its deployment's.
APP_NAME = "multipy"
#: Ray Serve's default max_ongoing_requests (a replica's requests at a time).
_RAY_DEFAULT_ONGOING = 5


@serve.ingress()
class Replica:
    """One replica: a Service of options' models on options.interpreters interpreters of
    this process, answering the Open Inference Protocol through multipy.serve.http.app.

    Raises, so that Ray reports the replica as failed, if this process lacks room for
    15 interpreters or the models fail to load.
    """

    async def __init__(self, options: Options) -> None:
        _log_to_stderr()
        started = tunables_at_start()
        if not has_room():
            raise RuntimeError(
                f"this replica's process started with GLIBC_TUNABLES "
                f"{':'.join(f'{k}={v}' for k, v in started.items()) or 'unset'}, without "
                f"room for 15 interpreters: deploy it with multipy.serve.on_ray.deployment(), "
                f"whose runtime environment sets {tunables()}")
        room = capacity()
        fit = room["free"] + room["more"]
        if options.interpreters > fit:
            raise RuntimeError(f"{options.interpreters} interpreters were asked for, but "
                               f"this replica's process has room for {fit}")
        logger.info(f"replica pid {os.getpid()} on {socket.gethostname()}: room for {fit} "
                    f"interpreters (GLIBC_TUNABLES at start: "
                    f"{':'.join(f'{k}={v}' for k, v in started.items())})")
        self.service = Service(options)
        began = time.monotonic()
        try:
            # on a thread: the replica's event loop stays free meanwhile
            await asyncio.to_thread(self.service.start)
        except BaseException:
            self.service.close()
            raise
        logger.info(f"replica ready in {time.monotonic() - began:.1f} s: "
                    f"{', '.join(self.service.models)} on {self.service.interpreters} "
                    f"interpreter(s)")

    def __serve_build_asgi_app__(self) -> Any:
        """The application that Ray Serve runs for this replica (after __init__)."""
        return create_app(self.service)

    def about(self) -> dict[str, Any]:
        """This replica's process: pid, host, the tunables it started with, its room for
        interpreters, its interpreters and their torch threads, and whether the host side
        imported torch (it should not).  For a DeploymentHandle: ``handle.about.remote()``."""
        return {"pid": os.getpid(), "hostname": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "tunables": tunables_at_start(), "has_room": has_room(), "room": capacity(),
                "interpreters": self.service.interpreters,
                "torch_threads": self.service.manager.torch_threads,
                "host_imported_torch": "torch" in sys.modules}

    def __del__(self) -> None:  # Ray calls it at shutdown, after the lifespan's drain
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


def tunables() -> str:
    """The GLIBC_TUNABLES the replicas start with: room for 15 interpreters, and the
    other tunables of this process's environment."""
    return launch_environment()["GLIBC_TUNABLES"]


def deployment(options: Options, replicas: int = 1, replica_cpus: float | None = None,
               **settings: object) -> Any:
    """The Ray Serve application (a bound deployment, for ``serve.run(app,
    route_prefix="/")``) of ``replicas`` Replicas serving options.  settings go to
    ``serve.deployment`` over the ones made here (``autoscaling_config=...`` instead of
    a fixed number of replicas, ``max_ongoing_requests``, ``health_check_period_s``...);
    ``ray_actor_options`` are merged into the ones made here, whose runtime environment
    always sets GLIBC_TUNABLES.

    replica_cpus: the CPUs Ray reserves for each replica (default: its interpreters),
    which Ray places replicas by; each interpreter runs torch with replica_cpus divided
    among the interpreters (at least 1) unless options.torch_threads says otherwise.  A
    replica takes up to 2 x interpreters x max_batch_size requests at a time (running,
    and waiting for an interpreter or a batch), and at least Ray Serve's default 5, so
    that its interpreters do not idle while the proxy routes the next request; Ray's
    proxies queue the rest.
    """
    cpus = float(options.interpreters if replica_cpus is None else replica_cpus)
    if options.torch_threads is None:
        options = dataclasses.replace(
            options, torch_threads=max(1, math.floor(cpus) // options.interpreters))
    actor = {"num_cpus": cpus, **(settings.pop("ray_actor_options", None) or {})}
    runtime_env = dict(actor.get("runtime_env") or {})
    # glibc reads them when the replica's process starts: Ray starts it with them
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "GLIBC_TUNABLES": tunables()}
    actor["runtime_env"] = runtime_env
    made: dict[str, Any] = {
        "name": APP_NAME,
        "num_replicas": None if "autoscaling_config" in settings else replicas,
        "max_ongoing_requests": max(_RAY_DEFAULT_ONGOING,
                                    2 * options.interpreters * options.max_batch_size),
        "logging_config": {"enable_access_log": False},  # as multipy serve: none
        "ray_actor_options": actor,
    }
    return serve.deployment(Replica, **{**made, **settings}).bind(options)


def replicas_seen(app_name: str = APP_NAME, replicas: int = 1, calls: int = 200) -> list[dict]:
    """``Replica.about()`` of each of the application's replicas that answered one of up
    to ``calls`` calls (Ray routes each to a replica of its choosing), stopping once
    ``replicas`` different ones have."""
    handle = serve.get_app_handle(app_name)
    seen: dict[int, dict] = {}
    for _ in range(calls):
        about = handle.about.remote().result(timeout_s=60)
        seen.setdefault(about["pid"], about)
        if len(seen) >= replicas:
            break
    return list(seen.values())


class _Stopped(BaseException):
    """SIGTERM or SIGINT arrived: stop."""


def serve_on_ray(options: Options, *, replicas: int = 1, replica_cpus: float | None = None,
                 address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
                 logging_config: dict | None = None) -> int:
    """Deploys options as ``replicas`` replicas on the Ray cluster at address (None:
    a local Ray started here), served on host:port by Ray Serve's HTTP proxy, until
    SIGTERM or SIGINT; then deletes the application (and shuts down the Ray and Serve it
    started) and returns 0, or 1 if the deployment failed."""
    if logging_config is not None:
        logging.config.dictConfig(logging_config)
    cpus = float(options.interpreters if replica_cpus is None else replica_cpus)
    needed = replicas * cpus
    ours = address is None
    connected = False
    status = 0
    try:
        if ours:
            # As many logical CPUs as the replicas reserve, at least the cores: what is
            # asked for runs on this machine, sharing its cores if they are fewer.
            logger.info("starting a local Ray (--ray-address not given)")
            # No dashboard: it costs about 1 GB here (start Ray yourself for one).
            ray.init(address="local", num_cpus=max(cores(), math.ceil(needed)),
                     include_dashboard=False)
            if needed > cores():
                logger.warning(f"{replicas} replica(s) x {cpus:g} CPU(s) is more than this "
                               f"machine's {cores()} cores: they share them")
        else:
            ray.init(address=address)
            total = ray.cluster_resources().get("CPU", 0)
            if needed > total:
                logger.warning(f"{replicas} replica(s) x {cpus:g} CPU(s) is more than the "
                               f"cluster's {total:g} CPUs now: replicas wait for nodes")
        connected = True
        _stop_on_signals()  # after ray.init, which sets a SIGTERM handler of its own
        serve.start(http_options={"host": host, "port": port})
        names = ", ".join(spec.name for spec in options.models)
        logger.info(f"deploying {names}: {replicas} replica(s) x {options.interpreters} "
                    f"interpreter(s), {cpus:g} CPU(s) each")
        began = time.monotonic()
        serve.run(deployment(options, replicas, replica_cpus), name=APP_NAME, route_prefix="/")
        for about in sorted(replicas_seen(APP_NAME, replicas), key=lambda a: a["pid"]):
            room = about["room"]
            logger.info(f"replica pid {about['pid']} on {about['hostname']}: "
                        f"{about['interpreters']} interpreter(s), room for "
                        f"{room['started'] + room['more']}, has_room "
                        f"{about['has_room']}")
        logger.info(f"ready in {time.monotonic() - began:.1f} s: {names} on {replicas} "
                    f"replica(s) x {options.interpreters} interpreter(s) through Ray Serve, "
                    f"http://{host}:{port}/v2/models/NAME/infer")
        while True:
            signal.pause()
    except (_Stopped, KeyboardInterrupt):
        logger.info("stopping: deleting the deployment" + (" and Ray" if ours else ""))
    except Exception as error:
        logger.error("serving on Ray failed: %s: %s", type(error).__name__, error,
                     exc_info=error)
        status = 1
    finally:
        # A second SIGINT interrupts the shutdown; SIGTERM meanwhile is ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if connected:
            try:
                if ours:
                    serve.shutdown()
                else:
                    serve.delete(APP_NAME)
            finally:
                ray.shutdown()
    return status


def _stop_on_signals() -> None:
    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stopped()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _log_to_stderr() -> None:
    """multipy.serve's lines on this process's stderr (which Ray streams to the driver)."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
