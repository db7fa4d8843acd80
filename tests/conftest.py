"""Shared fixtures.

A process can start at most 15 interpreters and never frees one, so the tests share
one manager for the whole session and run anything that needs a fresh process (exit
behaviour, limits, tunables) in a subprocess with a timeout.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import multipy
from multipy._launch import launch_environment, restore_environment


# With pytest-xdist (`make test` runs the suite on several worker processes), the
# workers are started by the controller with the environment `multipy run` restored to
# the user's, so pytest_xdist_setupnodes gives them the launch's tunables: glibc reads
# them as a worker starts, and the worker restores the user's environment at once, as
# `multipy run` does, so that what it starts inherits the user's.
if os.environ.get("PYTEST_XDIST_WORKER"):
    restore_environment()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """Before the controller starts its workers: room for 15 interpreters in each."""
    os.environ.update(launch_environment())


# Started in the background (`nohup make test &`), the suite inherits SIGINT ignored, and
# so would every process it starts: Python would install no KeyboardInterrupt handler in
# them.  A handler of our own is reset to the default at exec, so the children get it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def manager():
    with multipy.InterpreterManager(2) as m:
        yield m


@pytest.fixture
def sessions(manager):
    """One open session on each interpreter of the shared manager."""
    opened = [interpreter.acquire_session() for interpreter in manager.all_instances()]
    yield opened
    for session in opened:
        session.close()


@pytest.fixture
def python(tmp_path):
    """python(code, launcher=False, timeout=60, popen=False, env=None): runs code as a
    script in a fresh process, through `multipy run` if launcher, with glibc's default
    tunables otherwise (or env's: it adds to the environment).  Returns a CompletedProcess (text output), or the Popen if popen."""

    def run(code: str, *, launcher: bool = False, timeout: float = 60, popen: bool = False,
            env: dict[str, str] | None = None):
        script = tmp_path / f"script_{len(list(tmp_path.iterdir()))}.py"
        script.write_text(textwrap.dedent(code))
        command = [sys.executable, *(["-m", "multipy", "run"] if launcher else []), str(script)]
        env = {**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
               "PYTHONUNBUFFERED": "1", **(env or {})}
        if popen:
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)

    return run


def until(condition, seconds: float = 60) -> None:
    """Waits until condition() is true; fails after seconds."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for a server to listen on),
    below the kernel's range of ephemeral ports: a port of that range (which binding
    port 0 gives) may be taken meanwhile as the local end of any connection that a test
    makes, and a server that binds it later fails (Ray Serve's proxy did, once)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(100):
        port = random.randrange(max(1024, ephemeral - 12000), ephemeral)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: another
                continue
            return port
    with socket.socket() as sock:  # (all taken: the kernel's choice)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_one(fifo) -> bool:
    """Writes a byte into the FIFO if a reader has it open (a call blocked in C waiting
    on it then returns); whether a reader had it."""
    try:
        descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody reads it yet
        return False
    try:
        os.write(descriptor, b"x")
    except BrokenPipeError:  # the reader's open returned, and it has gone since
        pass
    finally:
        os.close(descriptor)
    return True


def export(folder, module: str, source: str, make, path: str, example: tuple | None = None,
           extern: tuple[str, ...] = ("torch.**",)) -> str:
    """A torch.package archive at folder/path of make(the module called module, whose
    source is written beside it), its example inputs if given; its path."""
    import torch.package

    (folder / f"{module}.py").write_text(source)
    sys.path.insert(0, str(folder))
    try:
        __import__(module)
        with torch.package.PackageExporter(str(folder / path)) as exporter:
            exporter.extern(list(extern))
            exporter.intern(module)
            exporter.save_pickle("model", "model.pkl", make(sys.modules[module]))
            if example is not None:
                exporter.save_pickle("model", "example.pkl", example)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(module, None)
    return str(folder / path)


# -- the servers that several test modules of `multipy serve` share (tests/serving.py) --

@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    """name -> path of each test model's torch.package archive (serving.MODELS), and
    python_heavy's, in one folder (the model repository of test_serve_repository.py)."""
    from serving import make_packages

    return make_packages(tmp_path_factory.mktemp("serve_models"))


@pytest.fixture(scope="session")
def served(packages, tmp_path_factory):
    """A server of 2 interpreters, --timeout 5, no batching (one event loop), with gRPC;
    stopped by test_serve_stop.py."""
    from serving import _start, _stop

    names = ["python_heavy", "cast", "pair", "fails", "slow", "exits", "blocks", "text"]
    server = _start(tmp_path_factory.mktemp("served"), [packages[n] for n in names],
                    "--interpreters", "2", "--timeout", "5", "--grpc-port", "0")
    try:
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="session")
def per_loop(packages, tmp_path_factory):
    """A server of 2 interpreters, neither --timeout nor batching: an event loop per
    interpreter; stopped by test_serve_stop.py."""
    from serving import _start, _stop

    server = _start(tmp_path_factory.mktemp("per_loop"),
                    [packages[n] for n in ("thread", "slow", "exits", "blocks")],
                    "--interpreters", "2")
    try:
        yield server
    finally:
        _stop(server)


def pytest_collection_modifyitems(items):
    """The tests marked stops_shared_servers (SIGTERM to ``served`` and ``per_loop``) run,
    in their order, just after the last of the other tests that use either server."""
    stopping = [item for item in items if item.get_closest_marker("stops_shared_servers")]
    others = [item for item in items if not item.get_closest_marker("stops_shared_servers")]
    users = [k for k, item in enumerate(others)
             if {"served", "per_loop"} & set(getattr(item, "fixturenames", ()))]
    at = users[-1] + 1 if users else len(others)
    items[:] = others[:at] + stopping + others[at:]
