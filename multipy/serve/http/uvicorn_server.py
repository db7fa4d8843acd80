"""With multipy.serve.http.uvicorn_protocol, the only code that relies on uvicorn beyond
its public API: uvicorn's server, ``Config`` and ``Server`` (and its ``LOGGING_CONFIG``)
without its command line; and ``write_answer``, which writes a whole answer through the
httptools protocol's request cycle at once (``write_whole``).  ``RELIED_ON`` names
every attribute of uvicorn's own that the two modules (and the server's life, which runs
uvicorn's ``Server``) use beyond that API; tests/test_uvicorn_seam.py checks each on the
installed uvicorn, and fails with its name on a uvicorn that lacks it.

Importing any of uvicorn's modules runs its package's ``__init__``, which imports
``uvicorn.main``: its command line, with click, watchfiles and the supervisors'
multiprocessing (about 2 MiB of a process's memory, in the host and in every
interpreter's front end), none of which a server started from code uses.  This module
imports uvicorn's package without running that ``__init__`` (the package's module made
from its spec, as the import system makes it, and registered), then the modules of the
server that it needs.  The package then has ``Config`` and ``Server``, which uvicorn's
own modules import from it; the first use of any other of its names (``uvicorn.run``,
``uvicorn.__version__``: code of others', Ray Serve's say) runs the real ``__init__``
then, so that such code finds the package whole.  Where uvicorn's package is imported
already, it is used as it is.
"""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable




def _package() -> ModuleType:
    """uvicorn's package, registered in sys.modules; its ``__init__`` not run, unless
    someone imported it before."""
    found = sys.modules.get("uvicorn")
    if found is not None:
        return found
    spec = importlib.util.find_spec("uvicorn")
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")
    package = importlib.util.module_from_spec(spec)
    ran = []

    def whole(name: str) -> Any:
        """A name of the package that is not set yet: the real ``__init__`` runs first
        (once)."""
        if not ran:
            ran.append(True)
            spec.loader.exec_module(package)
        try:
            return vars(package)[name]
        except KeyError:
            raise AttributeError(f"module 'uvicorn' has no attribute {name!r}") from None

    package.__getattr__ = whole  # type: ignore[attr-defined]
    sys.modules["uvicorn"] = package
    return package


_uvicorn = _package()

from uvicorn.config import LOGGING_CONFIG, Config  # noqa: E402
from uvicorn.server import Server  # noqa: E402

_uvicorn.Config, _uvicorn.Server = Config, Server  # as its __init__ sets them

# (the HTTP protocol that Config picks, httptools's: its status lines and request cycle)
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle  # noqa: E402
from uvicorn.protocols.http.flow_control import FlowControl  # noqa: E402

__all__ = ["Config", "FlowControl", "LOGGING_CONFIG", "RELIED_ON", "RequestResponseCycle",
           "Server", "write_answer", "write_whole"]

_PROTOCOL = "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"
_CYCLE = "uvicorn.protocols.http.httptools_impl.RequestResponseCycle"
_SERVER = "uvicorn.server.Server"
_FLOW = "uvicorn.protocols.http.flow_control.FlowControl"
#: What of uvicorn's own this module, multipy.serve.http.uvicorn_protocol, and the server
#: that runs uvicorn's ``Server`` (multipy.serve.main, multipy._inside.front_end) use
#: beyond its public API, as
#: (where, name, kind): kind "method" (a function of that class, called or overridden
#: with these parameters), "attribute" (set on its instances by that class's code) or
#: "name" (of that module, or of that class: a property).  tests/test_uvicorn_seam.py
#: checks each.
RELIED_ON: tuple[tuple[str, str, str], ...] = (
    ("uvicorn.protocols.http.httptools_impl", "STATUS_LINE", "name"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle", "name"),
    (_PROTOCOL, "connection_made(transport)", "method"),
    (_PROTOCOL, "connection_lost(exc)", "method"),
    (_PROTOCOL, "data_received(data)", "method"),
    (_PROTOCOL, "on_message_begin()", "method"),
    (_PROTOCOL, "__init__(config, server_state, app_state, _loop)", "method"),
    (_PROTOCOL, "on_header(name, value)", "method"),
    (_PROTOCOL, "on_url(url)", "method"),
    (_PROTOCOL, "on_body(body)", "method"),
    (_PROTOCOL, "on_headers_complete()", "method"),
    (_PROTOCOL, "on_message_complete()", "method"),
    (_PROTOCOL, "on_response_complete()", "method"),
    (_PROTOCOL, "send_400_response(msg)", "method"),
    # (what uvicorn's Server calls of every connection at shutdown, and the loop at an
    # EOF: the guarded protocol's cycle, or a DirectExchange, as uvicorn's meets it)
    (_PROTOCOL, "shutdown()", "method"),
    (_PROTOCOL, "eof_received()", "method"),
    (_PROTOCOL, "_start_asgi_task(cycle, app)", "method"),
    (_PROTOCOL, "_unsupported_upgrade_warning()", "method"),
    (_PROTOCOL, "transport", "attribute"),
    (_PROTOCOL, "parser", "attribute"),
    (_PROTOCOL, "headers", "attribute"),
    # (what uvicorn's on_message_begin sets, which its on_url and on_headers_complete
    # read: the guarded protocol's own sets them, and makes the scope apart)
    (_PROTOCOL, "url", "attribute"),
    (_PROTOCOL, "scope", "attribute"),
    (_PROTOCOL, "expect_100_continue", "attribute"),
    (_PROTOCOL, "cycle", "attribute"),
    (_PROTOCOL, "pipeline", "attribute"),
    (_PROTOCOL, "flow", "attribute"),
    (_PROTOCOL, "loop", "attribute"),
    (_PROTOCOL, "logger", "attribute"),
    (_PROTOCOL, "server_state", "attribute"),
    (_PROTOCOL, "timeout_keep_alive", "attribute"),
    (_PROTOCOL, "connections", "attribute"),
    (_PROTOCOL, "server", "attribute"),
    (_PROTOCOL, "client", "attribute"),
    (_PROTOCOL, "scheme", "attribute"),
    (_CYCLE, "on_response", "attribute"),
    (_CYCLE, "transport", "attribute"),
    (_CYCLE, "flow", "attribute"),
    (_CYCLE, "scope", "attribute"),
    (_CYCLE, "access_log", "attribute"),
    (_CYCLE, "default_headers", "attribute"),
    (_CYCLE, "message_event", "attribute"),
    (_CYCLE, "disconnected", "attribute"),
    (_CYCLE, "keep_alive", "attribute"),
    (_CYCLE, "waiting_for_100_continue", "attribute"),
    (_CYCLE, "response_started", "attribute"),
    (_CYCLE, "response_complete", "attribute"),
    (_CYCLE, "more_body", "attribute"),
    (_FLOW, "read_paused", "attribute"),
    (_FLOW, "write_paused", "attribute"),
    (_FLOW, "resume_reading()", "method"),
    (_FLOW, "__init__(transport)", "method"),
    ("uvicorn.server.ServerState", "total_requests", "attribute"),
    ("uvicorn.server.ServerState", "connections", "attribute"),
    ("uvicorn.server.ServerState", "default_headers", "attribute"),
    ("uvicorn.config.Config", "http_protocol_class", "attribute"),
    # (read by the protocol's __init__, as uvicorn's reads them)
    ("uvicorn.config.Config", "loaded", "attribute"),
    ("uvicorn.config.Config", "load()", "method"),
    ("uvicorn.config.Config", "loaded_app", "attribute"),
    ("uvicorn.config.Config", "ws_protocol_class", "attribute"),
    ("uvicorn.config.Config", "asgi_version", "name"),
    ("uvicorn.config.Config", "root_path", "attribute"),
    ("uvicorn.config.Config", "limit_concurrency", "attribute"),
    ("uvicorn.config.Config", "reset_contextvars", "attribute"),
    ("uvicorn.config.Config", "timeout_keep_alive", "attribute"),
    ("uvicorn.server.ServerState", "tasks", "attribute"),
    (_SERVER, "startup(sockets)", "method"),
    (_SERVER, "shutdown(sockets)", "method"),
    (_SERVER, "handle_exit(sig, frame)", "method"),
    (_SERVER, "capture_signals()", "method"),
    (_SERVER, "server_state", "attribute"),
    (_SERVER, "lifespan", "attribute"),
    (_SERVER, "started", "attribute"),
    (_SERVER, "should_exit", "attribute"),
    (_SERVER, "force_exit", "attribute"),
)


#: uvicorn's default headers (Server, Date) that an answer was last written with, and
#: their header lines: uvicorn makes a new list of them once a second.
_defaults: tuple[list | None, bytes] = (None, b"")


def _default_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    """headers' lines, each ending in CRLF, made once for each list of them."""
    global _defaults
    made = _defaults  # (read once: another thread's server may make its own meanwhile)
    if made[0] is not headers:
        made = _defaults = (headers, b"".join(b"%s: %s\r\n" % pair for pair in headers))
    return made[1]


def write_answer(send: Callable, status: int, head: bytes, body: bytes) -> bool:
    """Writes a whole answer, status with head (its header lines but Content-Length, each
    ending in CRLF, valid as they are) and body, in one write, as uvicorn's httptools
    cycle writes the two ASGI messages of it (its start, with a Content-Length, and its
    body), when send is such a cycle's send, ready to write, and returns True: the
    answer is complete, and the connection closed unless it is kept alive.  False, with
    nothing done, when send is another server's, or the cycle's writes wait to drain, or
    it would log the answer, or has begun one, or its client has gone: the caller sends
    the messages then."""
    cycle = getattr(send, "__self__", None)
    if (type(cycle) is not RequestResponseCycle or cycle.response_started
            or cycle.disconnected or cycle.flow.write_paused or cycle.access_log
            or cycle.scope["method"] == "HEAD"):
        return False
    write_whole(cycle, status, head, body)
    return True


def write_whole(cycle: Any, status: int, head: bytes, body: bytes) -> None:
    """Writes a whole answer, as ``write_answer`` does, through cycle: a uvicorn httptools
    cycle that has begun no answer, or what stands in its place with the attributes of
    one that this reads and sets (multipy.serve.http.uvicorn_protocol.DirectExchange)."""
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    lines = [STATUS_LINE[status], _default_lines(cycle.default_headers), head,
             b"content-length: %d\r\n" % len(body)]
    if not cycle.keep_alive:
        lines.append(b"connection: close\r\n")
    lines += [b"\r\n", body]
    cycle.transport.write(b"".join(lines))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
