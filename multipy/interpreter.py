"""Interpreters: each a CPython in its own glibc link-map namespace, with its own thread.

A started interpreter (``_Runtime``) lives as long as the process, because glibc
never gives a namespace back (DESIGN.md 3.6).  Managers borrow runtimes from the
process-wide pool below and return them when they close; an ``Interpreter`` is one
manager's view of one runtime.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib.util
import os
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from . import _glibc, _sharing
from .channel import (CLOSED, OK, REQUEST_PIPE_SIZE, ChannelClosedError, HostEnd, host_exports,
                      make_pipe)
from .errors import (InterpreterClosedError, InterpreterError, InterpreterLimitError,
                     InterpreterStartError, RemoteTraceback, WrongInterpreterError)
from .session import InterpreterSession, Obj

if TYPE_CHECKING:
    from .manager import InterpreterManager

#: How long exiting waits for interpreters to finish the call they are running ...
EXIT_GRACE_SECONDS = 2.0
#: ... and then for those that did to finalise (torch's finalisation takes a while).
FINALIZE_SECONDS = 30.0

_ENTRY = """\
import sys
sys.path[:] = {path!r}
sys.argv[:] = {argv!r}
from multipy._inside import main
main({index}, {request_fd}, {released_fd}, {status_fd}, {state}, {crash_slot})
"""


class _Start(ctypes.Structure):
    """struct multipy_start of _bootstrap.c."""
    _fields_ = [("program", ctypes.c_char_p), ("code", ctypes.c_char_p), ("error_fd", ctypes.c_int)]


_START = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Start), ctypes.POINTER(ctypes.c_ulong))
_JOIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_double)


def _bootstrap_path() -> str:
    spec = importlib.util.find_spec("multipy._bootstrap")
    if spec is None or not spec.origin:
        raise InterpreterStartError(
            "multipy's C bootstrap is not built: install the package with pip "
            "(pip install . or pip install -e .), which compiles it")
    return spec.origin


class _Runtime:
    """One started interpreter: its namespace, its thread and the host end of its channel."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.owner: Interpreter | None = None
        _, lmid = _glibc.open_namespace(_glibc.libpython_path())
        bootstrap = _glibc.load_into(lmid, _bootstrap_path())
        self._join = _JOIN(_glibc.symbol(bootstrap, "multipy_join"))
        request_read, request_write = make_pipe(REQUEST_PIPE_SIZE)
        released_read, released_write = make_pipe()
        os.set_blocking(released_write, False)
        self._status_read, status_write = os.pipe()
        self.channel = HostEnd(request_write, released_read)
        code = _ENTRY.format(path=list(sys.path), argv=list(sys.argv), index=ordinal,
                             request_fd=request_read, released_fd=released_write,
                             status_fd=status_write,
                             state=self.channel.state_address,
                             crash_slot=_host_library().multipy_crash_slot(ordinal))
        # Both stay referenced for the process's life: the C thread reads them.
        self._start = _Start(sys.executable.encode(), code.encode(), status_write)
        self._thread = ctypes.c_ulong()
        error = _START(_glibc.symbol(bootstrap, "multipy_start"))(
            ctypes.byref(self._start), ctypes.byref(self._thread))
        if error:
            raise InterpreterStartError(f"cannot start interpreter thread: {os.strerror(error)}")
        self.stopped = False

    def wait_ready(self) -> None:
        """Waits until the interpreter serves requests; InterpreterStartError if it cannot."""
        message = os.read(self._status_read, 1 << 16)
        if message != b"ready":
            self.stopped = True
            raise InterpreterStartError(
                f"interpreter {self.ordinal} failed to start: {message.decode(errors='replace')}")

    def stop(self) -> None:
        """Asks the interpreter to finish: calls still queued get InterpreterClosedError."""
        self.channel.stop()

    def join(self, timeout: float) -> bool:
        """Waits for the interpreter's thread to finalise and end; True if it did."""
        if not self.stopped:
            self.stopped = self._join(self._thread, max(timeout, 0.0)) == 0
        return self.stopped


# -- the process-wide pool -----------------------------------------------------

_pool_lock = threading.Lock()
_runtimes: list[_Runtime] = []


@functools.lru_cache(maxsize=None)
def _host_library() -> ctypes.CDLL:
    """The C bootstrap loaded into the host's own namespace, for its process-wide parts:
    the fatal-signal report and the exit guard."""
    library = ctypes.CDLL(_bootstrap_path())
    library.multipy_crash_slot.restype = ctypes.c_void_p
    library.multipy_crash_slot.argtypes = [ctypes.c_int]
    return library


def _prepare_process() -> None:
    """Once, before the first namespace: see DESIGN.md 3.4 and 3.7."""
    thread = threading.Thread(target=lambda: None, name="multipy-first-thread")
    thread.start()
    thread.join()
    _host_library().multipy_report_crashes()
    atexit.register(_shutdown)


def capacity() -> dict[str, int]:
    """How many interpreters this process has started, and how many more fit."""
    with _pool_lock:
        started = len(_runtimes)
        free = sum(r.owner is None and not r.stopped for r in _runtimes)
    return {"started": started, "free": free, "more": _glibc.namespaces_that_fit(started)}


def _limit_error(wanted: int, free: int, more: int) -> InterpreterLimitError:
    started = len(_runtimes)
    message = (f"{wanted} interpreters were asked for, but this process can give "
               f"{free + more}: {free} started and free, {more} more that fit "
               f"({started} started so far).")
    if started + more < _glibc.MAX_NAMESPACES:
        message += (f" glibc sizes the room for interpreters when a process starts; up to "
                    f"{_glibc.MAX_NAMESPACES} fit when the program is started with "
                    f"`multipy run SCRIPT` (or `python -m multipy run SCRIPT`), or with "
                    f"GLIBC_TUNABLES={_glibc.LAUNCH_TUNABLES} in its environment.")
    else:
        message += (f" A process holds at most {_glibc.MAX_NAMESPACES} and never gets one "
                    f"back: close a manager to return its interpreters to the pool.")
    return InterpreterLimitError(message)


def _acquire_runtimes(count: int) -> list[_Runtime]:
    """Takes count free runtimes, starting new ones as needed (in parallel)."""
    with _pool_lock:
        free = [r for r in _runtimes if r.owner is None and not r.stopped]
        more = _glibc.namespaces_that_fit(len(_runtimes))
        if count > len(free) + more:
            raise _limit_error(count, len(free), more)
        if not _runtimes:
            _prepare_process()
        new = []
        try:
            for _ in range(count - len(free)):
                try:
                    new.append(_Runtime(len(_runtimes)))
                except _glibc.NamespaceError as error:
                    if "static TLS" in str(error) or "no more namespaces" in str(error):
                        raise InterpreterLimitError(
                            f"{error}: {_glibc.static_tls_advice()}") from None
                    raise InterpreterStartError(str(error)) from None
                _runtimes.append(new[-1])
        finally:
            for runtime in new:  # they initialise in parallel, each on its own thread
                runtime.wait_ready()
        taken = free[:count] + new
        for runtime in taken:
            runtime.owner = True  # replaced by the Interpreter that wraps it
        return taken


def _return_runtimes(runtimes: list[_Runtime]) -> None:
    with _pool_lock:
        for runtime in runtimes:
            runtime.owner = None


def _shutdown() -> None:
    """At exit: stop and finalise every interpreter on its own thread, then join it.

    An interpreter whose loop does not end within EXIT_GRACE_SECONDS is running a call
    that does not return: it is left as it is, and the process leaves without the
    library destructors that would wait for it (DESIGN.md 3.7).
    """
    running = [r for r in _runtimes if not r.stopped]
    for runtime in running:
        runtime.stop()
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    while time.monotonic() < deadline and not all(r.channel.loop_finished() for r in running):
        time.sleep(0.005)
    deadline = time.monotonic() + FINALIZE_SECONDS
    stuck = [r for r in running
             if not (r.channel.loop_finished() and r.join(deadline - time.monotonic()))]
    if stuck:
        names = ", ".join(f"#{r.ordinal}" for r in stuck)
        print(f"multipy: interpreter(s) {names} still running at exit; leaving without "
              f"finalising them", file=sys.stderr, flush=True)
        _host_library().multipy_skip_destructors_at_exit()


# -- the manager's view --------------------------------------------------------

_thread = threading.local()


@contextlib.contextmanager
def timeout(seconds: float | None) -> Iterator[None]:
    """Within the block, every call this thread makes into an interpreter waits at most
    ``seconds``, then raises TimeoutError.  The call runs on in its interpreter, which the
    load balancer hands to no one else until it has finished."""
    previous = getattr(_thread, "timeout", None)
    _thread.timeout = seconds
    try:
        yield
    finally:
        _thread.timeout = previous


def current_timeout() -> float | None:
    """The timeout set by ``timeout()`` for this thread, if any."""
    return getattr(_thread, "timeout", None)


class _Pickler(_sharing.LendingPickler):
    """Pickles a request: an Obj becomes a reference to the object it stands for, a CPU
    tensor or array is lent (see _sharing), not copied."""

    def __init__(self, interpreter: Interpreter) -> None:
        super().__init__(host_exports)
        self._interpreter = interpreter

    def reducer_override(self, obj):
        if type(obj) is not Obj:
            return super().reducer_override(obj)
        owner = obj._interpreter
        if owner._closed:
            raise InterpreterClosedError(f"{obj!r} belongs to a manager that was closed")
        if owner is not self._interpreter:
            raise WrongInterpreterError(
                f"{obj!r} lives in {owner} and cannot be used in {self._interpreter}: "
                f"an object belongs to the interpreter that made it")
        return _sharing.handle, (obj._handle,)


def _remote_error(data: bytes) -> tuple[BaseException, bool]:
    """The host exception for an error reply, with the remote traceback as its cause;
    and whether the interpreter had read the request's arguments."""
    picklable, type_name, message, traceback_text, arguments_read = pickle.loads(data)
    error = None
    if "in static TLS block" in message:
        error = InterpreterLimitError(f"{message}: {_glibc.static_tls_advice()}")
    elif picklable is not None:
        try:
            error = pickle.loads(picklable)
        except Exception:  # its type does not exist in the host
            error = None
    if error is None:
        error = InterpreterError(type_name, message, traceback_text)
    error.__cause__ = RemoteTraceback(traceback_text)
    return error, arguments_read


class Interpreter:
    """One interpreter of a manager; ``index`` is its position in the manager."""

    def __init__(self, index: int, manager: InterpreterManager, runtime: _Runtime) -> None:
        self.index = index
        self.manager = manager
        self._runtime = runtime
        self._closed = False
        self._uses = 0  # open sessions, read by the load balancer under its lock
        runtime.owner = self

    def acquire_session(self) -> InterpreterSession:
        """A session on this interpreter, bypassing the load balancer."""
        self.manager._check_open()
        return self._session()

    def _session(self) -> InterpreterSession:
        self.manager._count_use(self, +1)
        return InterpreterSession(self)

    def _release_use(self) -> None:
        self.manager._count_use(self, -1)

    def _request(self, op: str, *args: Any) -> Any:
        """Runs one operation of _inside._Interpreter; the single path of every call."""
        if self._closed:
            raise InterpreterClosedError(f"{self} belongs to a manager that was closed")
        return self._send(op, args)

    def _send(self, op: str, args: tuple, timeout: Any = "thread") -> Any:
        """timeout: seconds, None for none, or "thread" for the thread's multipy.timeout."""
        seconds = current_timeout() if timeout == "thread" else timeout
        pickler = _Pickler(self)
        message = pickler.dumps((op, args))
        try:
            status, handle, data = self._runtime.channel.call(message, seconds)
        except ChannelClosedError as error:
            raise InterpreterClosedError(f"{self}: {error}") from None
        except TimeoutError:
            raise TimeoutError(
                f"{self} did not answer within {seconds} s; the call runs (or waits) on "
                f"there, and the interpreter is handed to no one else until it ends") from None
        if status == OK:
            if handle:
                return Obj(self, handle)
            return _sharing.AliasingUnpickler(data, self._runtime.channel.release).load()
        if status == CLOSED:
            raise InterpreterClosedError(f"{self} is stopped: the process is exiting")
        error, arguments_read = _remote_error(data)
        if not arguments_read:  # nothing lent was aliased: take it back
            pickler.take_back()
        raise error

    def _release(self, handle: int) -> None:
        if not self._closed:
            self._runtime.channel.release(handle)

    def _close(self) -> None:
        """Forgets this manager's objects in the interpreter and returns it to the pool."""
        if self._closed:
            return
        self._closed = True  # first: nothing new can be made that the reset would miss
        try:
            # Behind a call its caller gave up on, the reset waits its turn: do not wait
            # for it.  Queued first, it runs before anything a later manager sends, and
            # the interpreter counts as held until it has.
            self._send("reset", (), 0.0 if self._runtime.channel.running_abandoned_call() else None)
        except (InterpreterClosedError, TimeoutError):
            pass
        finally:
            _return_runtimes([self._runtime])

    def __repr__(self) -> str:
        return f"<multipy.Interpreter {self.index} (#{self._runtime.ordinal} of this process)>"
