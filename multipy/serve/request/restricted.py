"""Restricted APIs, as Triton restricts them (``--http-restricted-api`` and
``--grpc-restricted-protocol``, with Triton's syntax ``API[,API...]:KEY=VALUE``): a
request to an endpoint of a restricted category must carry the header KEY with the value
VALUE, else it is refused (HTTP 403, gRPC PERMISSION_DENIED) before anything else is
read of it.  Over gRPC the header is ``triton-grpc-protocol-KEY``, as Triton names it.

What each of the server's HTTP routes and gRPC RPCs belongs to (``HTTP_ROUTES``,
``RPCS``), the parsing of the options (``parse``) and the check (``Restrictions``),
shared by the host and every interpreter's front end.  ``/metrics`` is in no category
(Triton serves it on a port of its own): it is never restricted.
"""
from __future__ import annotations

import hmac
import re
from typing import Iterable

HEALTH, METADATA, INFERENCE = "health", "metadata", "inference"
STATISTICS, MODEL_REPOSITORY = "statistics", "model-repository"
#: Triton's categories, in its order.  shared-memory, model-config, trace and logging
#: name endpoints that this server does not have: restricting them changes nothing.
CATEGORIES = (HEALTH, METADATA, INFERENCE, "shared-memory", "model-config",
              MODEL_REPOSITORY, STATISTICS, "trace", "logging")
#: What Triton puts before KEY to name the gRPC header (gRPC's metadata keys are in
#: lower case).
GRPC_PREFIX = "triton-grpc-protocol-"

_MODEL, _VERSION = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
#: The category of each route of multipy.serve.http.app, by its path as Starlette's
#: Route takes it (None: never restricted).
HTTP_ROUTES: dict[str, str | None] = {
    "/v2/health/live": HEALTH, "/v2/health/ready": HEALTH,
    f"{_MODEL}/ready": HEALTH, f"{_VERSION}/ready": HEALTH,
    "/v2": METADATA, _MODEL: METADATA, _VERSION: METADATA,
    f"{_MODEL}/infer": INFERENCE, f"{_VERSION}/infer": INFERENCE,
    **{f"{path}/{route}": INFERENCE for path in (_MODEL, _VERSION)
       for route in ("generate", "generate_stream")},
    "/v2/models/stats": STATISTICS, f"{_MODEL}/stats": STATISTICS,
    f"{_VERSION}/stats": STATISTICS,
    "/v2/repository/index": MODEL_REPOSITORY,
    "/v2/repository/models/{model}/load": MODEL_REPOSITORY,
    "/v2/repository/models/{model}/unload": MODEL_REPOSITORY,
    "/metrics": None,
}
#: The category of each RPC of multipy.serve.rpc.server.
RPCS: dict[str, str] = {
    "ServerLive": HEALTH, "ServerReady": HEALTH, "ModelReady": HEALTH,
    "ServerMetadata": METADATA, "ModelMetadata": METADATA, "ModelInfer": INFERENCE,
    "ModelStreamInfer": INFERENCE,
    "ModelStatistics": STATISTICS, "RepositoryIndex": MODEL_REPOSITORY,
    "RepositoryModelLoad": MODEL_REPOSITORY, "RepositoryModelUnload": MODEL_REPOSITORY,
}

#: KEY: a header name that HTTP and gRPC both carry as it is (gRPC in lower case).
_KEY = re.compile(r"[A-Za-z0-9_.-]+\Z")
#: VALUE: printable ASCII, neither starting nor ending with a space (HTTP drops those).
_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?\Z")


#: (category, KEY, VALUE) of each restricted category, as ``parse`` gives them.
Restricted = tuple[tuple[str, str, str], ...]


def parse(values: Iterable[str], option: str) -> Restricted:
    """(category, KEY, VALUE) for each category that option's values (each
    ``API[,API...]:KEY=VALUE``) restrict.  ValueError, saying what is wrong (but never
    a VALUE), for a value without ":" or "=", an unknown category, a category given
    twice, or a KEY or VALUE that a header cannot carry (for gRPC, a KEY ending in
    "-bin", which gRPC reads as binary)."""
    syntax = f"{option} takes API[,API...]:KEY=VALUE"
    found: dict[str, tuple[str, str, str]] = {}
    for given in values:
        categories, colon, setting = given.partition(":")
        if not colon or "=" in categories:  # (quoted no further: it may hold a VALUE)
            raise ValueError(f"{syntax}: one has no ':' after its APIs")
        key, equals, value = setting.partition("=")
        if not equals:
            raise ValueError(f"{syntax}: the one of {categories} has no '=' between KEY "
                             f"and VALUE")
        if not _KEY.match(key) or option.startswith("--grpc") and key.lower().endswith("-bin"):
            raise ValueError(f"{syntax}: KEY {key!r} of {categories} is not a header name "
                             f"of letters, digits, '-', '_' and '.'"
                             + (" (not ending in '-bin')" if option.startswith("--grpc")
                                else ""))
        if not _VALUE.match(value):
            raise ValueError(f"{syntax}: the VALUE of {categories}:{key} is not printable "
                             f"ASCII (neither starting nor ending with a space)")
        for category in categories.split(","):
            if category not in CATEGORIES:
                raise ValueError(f"{option}: unknown API {category!r} (the APIs: "
                                 f"{', '.join(CATEGORIES)})")
            if category in found:
                raise ValueError(f"{option}: API {category!r} is given twice: each API "
                                 f"takes one KEY=VALUE")
            found[category] = (category, key, value)
    return tuple(found.values())


class Restrictions:
    """The restrictions of one transport: for each restricted category, the header
    that its requests must carry (KEY in lower case, after prefix: GRPC_PREFIX for gRPC)
    and its value, from ``parse``'s triples."""

    def __init__(self, restricted: Iterable[tuple[str, str, str]], prefix: str = "") -> None:
        self._required = {category: (prefix + key.lower(), value.encode("ascii"))
                          for category, key, value in restricted}

    def header(self, category: str | None) -> str | None:
        """The header (in lower case) that requests of category must carry; None if
        category is not restricted."""
        required = self._required.get(category)
        return None if required is None else required[0]

    def refused(self, category: str, given: bytes | str | None) -> str | None:
        """Why a request of category whose header (``header(category)``) is given
        (None: absent) is refused, naming the header but not its value; None if it may
        pass.  The value is compared in constant time (hmac.compare_digest)."""
        name, value = self._required[category]
        if isinstance(given, str):
            given = given.encode("utf-8", "surrogateescape")
        if given is not None and hmac.compare_digest(given, value):
            return None
        return (f"the {category!r} API is restricted: the request must carry the header "
                f"{name!r} with the value this server was started with")
