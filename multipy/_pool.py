"""The process-wide pool of interpreters: starting them, lending them to managers,
taking them back, and stopping them all at exit.

glibc gives a process at most 15 namespaces and never takes one back, so interpreters
outlive the managers that use them: a manager borrows runtimes here and gives them back
when it closes (or is dropped), and the next manager reuses them.
"""
from __future__ import annotations

import atexit
import collections
import gc
import math
import os
import sys
import threading
import time
from typing import NoReturn

from . import _glibc, _host
from ._runtime import Runtime, prepare_process
from .errors import InterpreterClosedError, InterpreterLimitError, InterpreterStartError

#: How long exiting waits for calls in progress to end ...
EXIT_GRACE_SECONDS = 2.0
#: ... and then, unless set_exit_timeout or the environment says otherwise, for the
#: interpreters to finalise: torch's finalisation takes a while, and CPython's waits
#: for the threads started inside that are not daemons (docs/design.md, "exit").
EXIT_TIMEOUT = 30.0
#: The environment variable that gives another exit timeout (`multipy run --exit-timeout`).
EXIT_TIMEOUT_VARIABLE = "MULTIPY_EXIT_TIMEOUT"

_lock = threading.Lock()
_runtimes: list[Runtime] = []
_lent: set[Runtime] = set()    # runtimes a manager holds (or a reset in progress)
_stale: set[Runtime] = set()   # given back but still holding a manager's objects
#: Runtimes given back, not yet taken in: give_back runs in finalisers, which may run
#: while _lock is held on the same thread, so it only appends here.
_returned: collections.deque = collections.deque()
_prepared = False
#: The exit timeout: set_exit_timeout's, else (from the first interpreter's start on) the
#: environment's or EXIT_TIMEOUT.
_exit_timeout: float | None = None
#: Whether this code runs inside one of multipy's interpreters (whose bootstrap adds the
#: module), which cannot start interpreters: its namespace's pthread keys are multipy's.
_INSIDE = "_multipy_bootstrap" in sys.builtin_module_names


def _take_returned() -> None:
    """Takes in what was given back; with _lock held."""
    while _returned:
        runtime = _returned.popleft()
        _lent.discard(runtime)
        _stale.add(runtime)


def _free() -> list[Runtime]:
    """Runtimes no manager holds, those that had room for every library first."""
    _take_returned()
    return sorted((r for r in _runtimes
                   if r not in _lent and not r.closed_because and not r.abandoned),
                  key=lambda r: r.out_of_room is not None)


def capacity() -> dict[str, int]:
    """How many interpreters this process has started, how many of those are free, and
    how many more fit."""
    with _lock:
        return {"started": len(_runtimes), "free": len(_free()),
                "more": _glibc.namespaces_that_fit(len(_runtimes))}


def _limit_error(wanted: int, free: int, more: int) -> InterpreterLimitError:
    started = len(_runtimes)
    message = f"{wanted} interpreters were asked for, but this process can give only {free + more}"
    if started:
        message += (f" ({started} started, {free} of them not held by another manager; "
                    f"{more} more can start).")
    else:
        message += "."
    if started + more < _glibc.MAX_NAMESPACES:
        message += f" {_glibc.static_tls_advice()}."
    else:
        message += (f" A process starts at most {_glibc.MAX_NAMESPACES} interpreters in its "
                    f"lifetime (glibc never frees one): close a manager to make its "
                    f"interpreters available to the next one.")
    return InterpreterLimitError(message)


def acquire(count: int) -> list[Runtime]:
    """Lends count runtimes, starting new ones as needed (they initialise in parallel).

    InterpreterLimitError, before any is started, if the process cannot hold them;
    InterpreterStartError if one fails to start, or at once if this code runs inside an
    interpreter.
    """
    if _INSIDE:
        raise InterpreterStartError(
            "this code runs inside one of multipy's interpreters, which cannot start "
            "interpreters of their own: start them from the host program (`multipy run "
            "SCRIPT`), not from a model, a call or `multipy shell`")
    with _lock:
        short = count > len(_free()) + _glibc.namespaces_that_fit(len(_runtimes))
    if short:  # managers dropped without close() give theirs back when collected
        gc.collect()
    with _lock:
        free = _free()
        more = _glibc.namespaces_that_fit(len(_runtimes))
        if count > len(free) + more:
            raise _limit_error(count, len(free), more)
        global _prepared, _exit_timeout
        if not _prepared:
            if _exit_timeout is None:
                _exit_timeout = exit_seconds(os.environ.get(EXIT_TIMEOUT_VARIABLE, EXIT_TIMEOUT),
                                             EXIT_TIMEOUT_VARIABLE)
            prepare_process()
            atexit.register(_shutdown)
            _prepared = True
        new: list[Runtime] = []
        try:
            for _ in range(count - len(free)):
                try:
                    new.append(Runtime(len(_runtimes)))
                except _glibc.NamespaceError as error:
                    if "static TLS" in str(error) or "no more namespaces" in str(error):
                        raise InterpreterLimitError(
                            f"{error}: {_glibc.static_tls_advice()}.") from None
                    raise InterpreterStartError(str(error)) from None
                _runtimes.append(new[-1])
        finally:
            failures = []
            for runtime in new:  # every one, even after a failure: none is left starting
                try:
                    runtime.wait_ready()
                except InterpreterStartError as error:
                    failures.append(error)
            if failures:
                raise failures[0]
        taken = free[:count]
        for runtime in taken:
            if runtime in _stale and runtime.reset():
                _stale.discard(runtime)
        taken += new
        _lent.update(taken)
        return taken


def give_back(runtimes: list[Runtime]) -> None:
    """Takes runtimes back from a manager; they forget its objects before they are lent
    again (or at once, with reset_now).  Takes no lock and enters no interpreter: safe
    in a finaliser, wherever it runs."""
    _returned.extend(runtimes)


def reset_now(runtime: Runtime) -> None:
    """Makes a runtime given back forget its manager's objects now, unless an abandoned
    call runs in it or it was lent again meanwhile."""
    with _lock:
        _take_returned()
        if runtime not in _stale or runtime in _lent:
            return
        _lent.add(runtime)  # reserved while the reset runs
    try:
        if runtime.reset():
            with _lock:
                _stale.discard(runtime)
    finally:
        with _lock:
            _lent.discard(runtime)


def exit_seconds(value: str | float, what: str) -> float:
    """value as an exit timeout in seconds (inf: no limit, as CPython); ValueError,
    naming what gave it, unless it is a number, 0 or more."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds >= 0:  # NaN too
        raise ValueError(f"{what} must be a number of seconds, 0 or more (inf: no limit), "
                         f"not {value!r}")
    return seconds


def set_exit_timeout(seconds: float) -> None:
    """How long, at exit, the interpreters get to finalise before the process leaves
    without finalising those that have not; it wins over MULTIPY_EXIT_TIMEOUT's seconds,
    which ``multipy run --exit-timeout`` sets (default EXIT_TIMEOUT, 30 s).
    Finalising waits, as CPython does, for the threads started inside that are not
    daemons: a program whose libraries leave such threads working as it exits gives them
    the time they need here (inf: as long as they take, as CPython waits).  For the whole
    process, whichever manager; ValueError unless seconds is a number, 0 or more."""
    global _exit_timeout
    _exit_timeout = exit_seconds(seconds, "the exit timeout")


#: Set once the process has begun to exit (_shutdown).
_exiting = threading.Event()


def refuse(message: str) -> NoReturn:
    """Raises InterpreterClosedError(message): the interpreter or manager a call asked
    for is closed.  But a daemon thread that asks once the process is exiting waits here
    until the process ends, as CPython's own daemon threads do at finalisation: the
    error would end the thread with a traceback written while the process finalises,
    which CPython 3.14 and later turn into a fatal error (stderr's lock held at exit)."""
    if _exiting.is_set() and threading.current_thread().daemon:
        threading.Event().wait()  # never set
    raise InterpreterClosedError(message)


def _shutdown() -> None:
    """At exit: stop every interpreter, let calls in progress end, finalise each on its
    own thread and join it.

    An interpreter still running a call after EXIT_GRACE_SECONDS, or not finalised
    within the exit timeout, is left as it is, and the process leaves without the
    library destructors that would wait for it (docs/design.md, "exit").
    """
    _exiting.set()
    running = [r for r in _runtimes if not r.finished and not r.closed_because]
    for runtime in running:
        runtime.stop()
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    while time.monotonic() < deadline and not all(r.idle() for r in running):
        time.sleep(0.005)
    idle = [r for r in running if r.idle()]
    for runtime in idle:  # all at once: they finalise in parallel, each on its own thread
        runtime.finalise_start()
    seconds = _exit_timeout  # set when the first interpreter started, which registered this
    deadline = time.monotonic() + seconds
    unfinished = [r for r in idle if not r.join(deadline - time.monotonic())]
    busy = [r for r in running if r not in idle]
    for stuck, why in ((busy, "still running a call at exit"),
                       (unfinished, f"not finalised within the exit timeout of {seconds:g} s "
                                    f"(finalising waits for the threads started inside "
                                    f"that are not daemons; multipy run --exit-timeout or "
                                    f"multipy.set_exit_timeout gives more time)")):
        if stuck:
            names = ", ".join(f"#{r.ordinal}" for r in stuck)
            print(f"multipy: interpreter(s) {names} {why}: leaving without finalising them",
                  file=sys.stderr, flush=True)
    if busy or unfinished:
        _host.skip_destructors_at_exit()


def _after_fork_in_child() -> None:
    """A forked child has the interpreters' memory but none of their threads: it must
    not enter them, nor wait for them at exit, nor run their libraries' destructors."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for runtime in _runtimes:
        runtime.close("it belongs to the parent of this forked process")
    if _runtimes:
        _host.skip_destructors_at_exit()


os.register_at_fork(after_in_child=_after_fork_in_child)
