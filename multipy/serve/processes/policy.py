"""What the supervisor of ``multipy serve --processes`` decides, as pure functions of
what it knows, tested without processes: what follows a process's end (``decide``), and
the model repository's present state that a replacement redoes (``Present``)."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Iterable, Iterator

from .link import RepositoryRequest

#: Replacements in a row that die while starting before the server gives up.
START_FAILURES = 5


@dataclass(frozen=True)
class Restart:
    """What the supervisor does when a process has ended: start a replacement after
    ``pause`` seconds, or (``stop`` not None) stop the server with that exit status;
    ``failures``: the processes in a row that have died while starting, from now on."""

    pause: float = 0.0
    stop: int | None = None
    failures: int = 0
    why: str = ""


def decide(status: int, served: bool, failures: int, listening: bool,
           ever_ready: bool) -> Restart:
    """What follows the end (returncode status) of a process that had ``served`` (loaded
    its models, or was running a call: a request's crash is never a start failure),
    after ``failures`` processes in a row died while starting, the server ``listening``
    (a process had prepared) and ``ever_ready`` (every process has been ready once)."""
    if served:
        return Restart(0.0, None, 0, "a replacement starts now")
    failures += 1
    if not listening and status == 2:
        return Restart(stop=2, failures=failures,
                       why="before the server listened: a model cannot be served (see above)")
    if not ever_ready and status in (1, 2):
        return Restart(stop=1, failures=failures, why="its models failed to load (see above)")
    if failures >= START_FAILURES:
        return Restart(stop=1, failures=failures,
                       why=f"{failures} processes in a row died while starting")
    pause = 2.0 ** (failures - 1)
    return Restart(pause, None, failures, f"a replacement starts in {pause:g} s")


class Present:
    """The model repository as every process serves it now, kept from the requests that
    changed it (``note``), whatever their number: what each model name loaded since
    the start last loaded (its archive), and whether it is loaded, unloaded, or failed
    to load (a name new to the server keeps its place in the index and its slot of the
    metrics all the same).  ``requests`` redo it on a process that has just loaded the
    start-up models (``started_with``), in the order the names came."""

    def __init__(self, started_with: Iterable[str]) -> None:
        self._started_with = frozenset(started_with)
        self._names: dict[str, tuple[dict[str, str], str]] = {}  # name -> (archive, state)

    def note(self, request: RepositoryRequest, statuses: list[int | None]) -> None:
        """request had statuses from the processes (None: one ended first)."""
        what, name, archive = request.what, request.name, request.archive
        known = name in self._names or name in self._started_with
        if what == "load":
            if 200 in statuses:
                self._names[name] = (archive, "loaded")
            elif 500 in statuses and not known:  # its load failed where it was tried
                self._names[name] = (archive, "failed")
        elif 200 in statuses and known:
            self._names[name] = (self._names.get(name, ({}, ""))[0], "unloaded")

    def requests(self) -> Iterator[RepositoryRequest]:
        """The requests that make a freshly started process's repository this one."""
        for name, (archive, state) in self._names.items():
            if state != "unloaded" or name not in self._started_with:
                yield RepositoryRequest("load", name, archive)
            if state == "unloaded":
                yield RepositoryRequest("unload", name)


def ended_how(status: int) -> str:
    """How a process ended, as returncode says it."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = "?"
        return f"was killed by signal {-status} ({name})"
    return f"exited with status {status}"
