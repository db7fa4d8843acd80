"""What multipy serve relies on of uvicorn beyond its public API
(multipy.serve.http.uvicorn_server.RELIED_ON), checked on the installed uvicorn: each
name is one test, which fails with that name when an upgrade removes or changes it."""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from multipy.serve.http.uvicorn_server import RELIED_ON  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _find(where: str):
    """The module, or the class in its module, that where names."""
    try:
        return importlib.import_module(where)
    except ImportError:
        module, _, name = where.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _assigned(source: object) -> tuple[set[str], set[str]]:
    """The attributes of self that source's code (a class's or a function's) sets, and the
    plain names it assigns (a class body's declarations; a function's locals), read from
    its source, a tuple's items each."""
    on_self: set[str] = set()
    plain: set[str] = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(source)))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in (item for target in targets
                       for item in (target.elts if isinstance(target, ast.Tuple) else [target])):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id == "self":
                on_self.add(target.attr)
            elif isinstance(target, ast.Name):
                plain.add(target.id)
    return on_self, plain


def _set_on_self(cls: type) -> set[str]:
    """The attributes that cls's own code (and its bases' in uvicorn) sets on self, with
    those its class body declares."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("uvicorn"):
            on_self, declared = _assigned(klass)
            names |= on_self | declared
    return names


@pytest.mark.parametrize("where, name, kind", RELIED_ON,
                         ids=[f"{where.rsplit('.', 1)[-1]}.{name}" for where, name, _ in RELIED_ON])
def test_uvicorn_has_what_multipy_relies_on(where, name, kind):
    found = _find(where)
    if kind == "name":
        assert hasattr(found, name), f"uvicorn's {where} has no {name}"
    elif kind == "attribute":
        assert name in _set_on_self(found), f"uvicorn's {where} sets no attribute {name}"
    else:
        method, _, parameters = name.partition("(")
        wanted = [p for p in parameters.rstrip(")").replace(" ", "").split(",") if p]
        function = getattr(found, method, None)
        assert callable(function), f"uvicorn's {where} has no method {method}"
        given = [p for p in inspect.signature(function).parameters if p != "self"]
        assert given == wanted, f"uvicorn's {where}.{method} takes {given}, not {wanted}"


def test_every_name_of_uvicorn_that_the_adapter_uses_is_declared():
    """The adapter (its two modules) reads no attribute of a uvicorn cycle, protocol,
    config or server state that RELIED_ON does not name (a new use must be declared, and
    so checked)."""
    from multipy.serve.http import uvicorn_protocol, uvicorn_server

    declared = {name.partition("(")[0] for _, name, _ in RELIED_ON}
    used = set()
    for node in (node for module in (uvicorn_server, uvicorn_protocol)
                 for node in ast.walk(ast.parse(inspect.getsource(module)))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("cycle", "config", "server_state"):
            used.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self" \
                and node.value.attr in ("cycle", "flow", "server_state"):
            used.add(node.attr)
    assert used and used <= declared, sorted(used - declared)


def test_the_guarded_protocol_sets_up_what_uvicorns_sets_up():
    """The guarded protocol's own __init__ (uvicorn's less its loggers' look-ups) and
    connection_made set every attribute that uvicorn's set: a uvicorn that sets one
    more fails here, by name, not at a connection."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from multipy.serve.http.uvicorn_protocol import _Guarded

    theirs = _assigned(HttpToolsProtocol.__init__)[0] | \
        _assigned(HttpToolsProtocol.connection_made)[0]
    ours = _assigned(_Guarded.__init__)[0] | _assigned(_Guarded.connection_made)[0]
    assert "logger" in ours and theirs <= ours, sorted(theirs - ours)


def test_the_scope_that_the_guarded_protocol_makes_is_uvicorns():
    """The scope that the guarded protocol makes for a request that goes to the
    application, once its head has come, is the one uvicorn's on_message_begin makes
    (on_headers_complete adds the rest to either)."""
    import asyncio

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from multipy.serve.http.connection import Limits
    from multipy.serve.http.uvicorn_protocol import guarded

    async def app(scope, receive, send):
        pass

    config = uvicorn.Config(app, log_config=None, root_path="/under")
    loop = asyncio.new_event_loop()
    try:
        protocol = guarded(HttpToolsProtocol, Limits())(
            config=config, server_state=uvicorn.server.ServerState(),
            app_state={"key": "value"}, _loop=loop)
        protocol.server, protocol.client, protocol.scheme = ("s", 1), ("c", 2), "http"
        protocol.on_message_begin()
        protocol.on_header(b"Name", b"value")
        ours = protocol._scope()
        headers = protocol.headers
        HttpToolsProtocol.on_message_begin(protocol)
        protocol.headers.extend(headers)
        assert ours == protocol.scope and ours["state"] is not protocol.app_state
    finally:
        loop.close()


def _guarded_protocol(loop):
    """A guarded protocol (uvicorn's httptools one under multipy's limits), set up as
    connection_made leaves it, but for its transport (None)."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from multipy.serve.http.connection import Limits
    from multipy.serve.http.uvicorn_protocol import guarded

    async def app(scope, receive, send):
        pass

    protocol = guarded(HttpToolsProtocol, Limits())(
        config=uvicorn.Config(app, log_config=None), server_state=uvicorn.server.ServerState(),
        app_state={}, _loop=loop)
    protocol.server, protocol.client, protocol.scheme = ("s", 1), ("c", 2), "http"
    protocol.transport = None
    return protocol


def test_the_guarded_protocol_s_own_request_callbacks_do_what_uvicorns_do():
    """on_message_begin and on_header, which the guarded protocol writes again (its scope
    made apart: the test above), set what uvicorn's set, and on_header keeps the same
    fields, names in lower case, and notes Expect: 100-continue as uvicorn's does."""
    import asyncio

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from multipy.serve.http.uvicorn_protocol import _Guarded

    theirs, ours = (_assigned(cls.on_message_begin)[0] for cls in (HttpToolsProtocol, _Guarded))
    assert theirs <= ours, sorted(theirs - ours)
    fields = [(b"Host", b"x"), (b"Expect", b"100-Continue"), (b"X-Two", b"a"), (b"x-two", b"b")]
    loop = asyncio.new_event_loop()
    try:
        seen = []
        for on_header in (HttpToolsProtocol.on_header, None):
            protocol = _guarded_protocol(loop)
            protocol.on_message_begin()
            for name, value in fields:
                (on_header or type(protocol).on_header)(protocol, name, value)
            seen.append((protocol.headers, protocol.expect_100_continue))
        assert seen[0] == seen[1] and seen[1][1] is True
    finally:
        loop.close()


#: What uvicorn's on_headers_complete and _start_asgi_task read of the protocol and its
#: config: the guarded protocol answers an inference request without them only where
#: none of it would change the request's way (multipy.serve.http.uvicorn_protocol.
#: DirectExchange). A name that a new uvicorn reads there fails the test below: see
#: what it does before adding it here.
_READ_AS_A_REQUEST_STARTS = {
    "self": {"parser", "scope", "url", "root_path", "limit_concurrency", "connections",
             "tasks", "logger", "app", "cycle", "transport", "flow", "access_logger",
             "access_log", "server_state", "expect_100_continue", "on_response_complete",
             "pipeline", "_should_upgrade", "_start_asgi_task", "config", "loop"},
    "config": {"reset_contextvars"},
}


def test_uvicorn_reads_nothing_new_as_a_request_starts():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    read: dict[str, set[str]] = {"self": set(), "config": set()}
    for method in (HttpToolsProtocol.on_headers_complete, HttpToolsProtocol._start_asgi_task):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(method)))):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                read["self"].add(node.attr)
            elif isinstance(node.value, ast.Attribute) and node.value.attr == "config":
                read["config"].add(node.attr)
    for owner, names in read.items():
        new = names - _READ_AS_A_REQUEST_STARTS[owner]
        assert not new, f"uvicorn now reads {sorted(new)} of its {owner} as a request starts"


def test_a_direct_exchange_has_what_uvicorns_protocol_uses_of_a_cycle():
    """A DirectExchange stands in the cycle's place on the guarded protocol: every
    attribute that uvicorn's protocol methods that may meet it there (all but those the
    guarded protocol writes again without calling them, and on_body, which it gives
    only the cycles of uvicorn's) read or set of a cycle, and of its message_event, is
    one it has."""
    import asyncio

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from multipy.serve.http.uvicorn_protocol import DirectExchange, _Guarded

    met = []
    for name, function in vars(HttpToolsProtocol).items():
        ours = vars(_Guarded).get(name)
        if not callable(function) or name == "on_body" or (
                ours is not None and "super()." not in inspect.getsource(ours)):
            continue
        met.append(name)
        used, on_event = set(), set()
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id == "existing_cycle" or (
                    isinstance(value, ast.Attribute) and value.attr == "cycle"
                    and isinstance(value.value, ast.Name) and value.value.id == "self"):
                used.add(node.attr)
            if isinstance(value, ast.Attribute) and value.attr == "message_event":
                on_event.add(node.attr)
        loop = asyncio.new_event_loop()
        try:
            exchange = DirectExchange(_guarded_protocol(loop), [], True)
            missing = {attr for attr in used if not hasattr(exchange, attr)} | \
                {f"message_event.{attr}" for attr in on_event
                 if not hasattr(exchange.message_event, attr)}
        finally:
            loop.close()
        assert not missing, f"uvicorn's {name} uses {sorted(missing)} of a cycle"
    assert {"connection_lost", "on_message_complete", "shutdown",
            "on_headers_complete"} <= set(met), met
