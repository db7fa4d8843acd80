"""The model repository extension (Triton's, which tritonclient's
``get_model_repository_index``, ``load_model`` and ``unload_model`` speak), whatever
carries it: what its requests ask, checked once for HTTP and gRPC, and its index.

A server's repository is the models it knows: those it was started with and those
loaded since by name and path.  Each is READY (every interpreter has it), LOADING, or
UNAVAILABLE (unloaded, or its load failed: the reason says which, UNLOADED or why).
The server's readiness counts them (``not_ready``).  Loading and unloading
are the host's work (multipy.serve.host.service.Service), whichever front end receives the
request; they run one at a time, while the other models serve on.  With
``--model-control none``, the default (Triton's name for it), the index answers and
load and unload are refused.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from .contract import Server
from .messages import ProtocolError

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"
#: The reason of a model UNAVAILABLE because the repository's unload unloaded it (any
#: other reason of UNAVAILABLE says why its load failed).
UNLOADED = "unloaded"
#: --model-control's choices: "none" (the models given at start, for good) or "explicit"
#: (loaded and unloaded by the repository's requests).
MODEL_CONTROLS = ("none", "explicit")
#: What a load request may say of the archive to load.
_ARCHIVE_KEYS = ("path", "module", "resource")
#: A model's name: 1 to 128 of ASCII letters, digits, "_", "-" and ".", not starting
#: with "." or "-" (it names the model in URLs, metrics' labels and file names).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
#: The most characters of a model's reason kept in the index (a failed load's error).
REASON_CHARACTERS = 1000
#: The most bytes (UTF-8) of a path that can name a file: the system's PATH_MAX, with
#: its terminating NUL.
PATH_MAX = os.pathconf("/", "PC_PATH_MAX")


def check_name(name: str) -> None:
    """ProtocolError (400) unless name is a model's name (see _NAME)."""
    if not _NAME.match(name):
        raise ProtocolError(f"{_shown(name)!r} cannot name a model: a name has 1 to 128 of the "
                            f"letters A-Z and a-z, the digits, '_', '-' and '.', and does "
                            f"not start with '.' or '-'")


def index(states: Mapping[str, tuple[str, str]], ready_only: bool = False) -> list[dict]:
    """The repository's index: {"name", "version", "state", "reason"} for each model in
    states (name -> (state, reason)), or for those READY only."""
    return [{"name": name, "version": "1", "state": state, "reason": reason}
            for name, (state, reason) in list(states.items())
            if state == READY or not ready_only]


def not_ready(states: Mapping[str, tuple[str, str]], strict: bool = True) -> str | None:
    """Why a server whose models are in states (name -> (state, reason)) is not ready,
    or None if, as far as its models go, it is.  With strict (--strict-readiness), every
    model that was not unloaded (UNLOADED) must be READY, and one at least; a model
    LOADING, or whose load failed, makes it not ready.  Without, the models do not
    count."""
    if not strict:
        return None
    waiting = [(name, state, reason) for name, (state, reason) in list(states.items())
               if state != READY and (state, reason) != (UNAVAILABLE, UNLOADED)]
    if waiting:
        name, state, reason = waiting[0]
        more = f" (and {len(waiting) - 1} more model(s) not ready)" if len(waiting) > 1 else ""
        return f"model {name!r} is {state}{': ' + reason if reason else ''}{more}"
    if not any(state == READY for state, _ in list(states.values())):
        return ("no model is loaded: every one was unloaded "
                "(POST /v2/repository/models/NAME/load loads one)")
    return None


async def load(service: Server, name: str, parameters: Mapping[str, Any]) -> None:
    """Loads model name on every interpreter of service, from the archive that
    parameters name, if any (see ``archive``), else from the one it was served from;
    ProtocolError if load is disabled (400), name cannot name a model (400), or it fails
    (see Service.load)."""
    _enabled(service, "load")
    check_name(name)
    await service.load(name, archive(parameters))


async def unload(service: Server, name: str) -> None:
    """Unloads model name from every interpreter of service; ProtocolError if unload is
    disabled (400), or it serves no model name (404)."""
    _enabled(service, "unload")
    if not _NAME.match(name):  # (no model can have it)
        raise ProtocolError(f"unknown model {_shown(name)!r}", 404)
    await service.unload(name)


def archive(parameters: Mapping[str, Any]) -> dict[str, str]:
    """The archive a load request names, as {"path", "module", "resource"} (each only if
    given): as parameters of the request, or as the JSON object of its "config"
    parameter (what tritonclient's ``load_model(name, config=...)`` sends).
    ProtocolError (400) for a parameter that is neither, or a value that is not a
    string or is too long to name a file (PATH_MAX bytes or more)."""
    given = dict(parameters)
    config = given.pop("config", None)
    if config is not None:
        if isinstance(config, bytes):
            config = config.decode(errors="replace")
        try:
            named = json.loads(config) if isinstance(config, str) else None
        except ValueError as error:
            raise ProtocolError(f'the load request\'s "config" must be a JSON object: '
                                f"{error}") from None
        if not isinstance(named, dict):
            raise ProtocolError('the load request\'s "config" must be a JSON object of '
                                f'{", ".join(map(repr, _ARCHIVE_KEYS))}')
        given = {**named, **given}
    unknown = sorted(set(given) - set(_ARCHIVE_KEYS))
    if unknown:
        shown = ", ".join(repr(_shown(str(key))) for key in unknown[:5])
        raise ProtocolError(f"the load request has parameters that say nothing to this "
                            f"server: {shown}{', ...' if len(unknown) > 5 else ''}; it "
                            f"takes the archive's {', '.join(map(repr, _ARCHIVE_KEYS))}")
    for key, value in given.items():
        if not isinstance(value, str) or not value:
            raise ProtocolError(f"the load request's {key!r} must be a string")
        if len(value.encode(errors="surrogatepass")) >= PATH_MAX:
            raise ProtocolError(f"the load request's {key!r} ({_shown(value)!r}) is longer "
                                f"than any path that names a file ({PATH_MAX - 1} bytes)")
    return given


def _shown(text: str) -> str:
    """text as an error message quotes it: its first 40 characters."""
    return text if len(text) <= 40 else text[:40] + "..."


def _enabled(service: Server, what: str) -> None:
    if service.model_control != "explicit":
        raise ProtocolError(f"this server does not {what} models: it serves those it was "
                            f"started with (start it with --model-control explicit to "
                            f"load and unload them)")
