"""One interpreter: a CPython in its own glibc link-map namespace, the thread that
started it, and the entry through which host threads run requests in it.

A runtime lives as long as the process: glibc never gives a namespace back.  A request
runs on the thread that makes it (``call``), with the host's GIL released for all of it
and the interpreter's GIL serialising the threads inside; ``start`` runs it on a worker
thread instead, so that its caller can give up at a deadline or await it.  The interpreter's
own thread only starts CPython and, at exit, finalises it (docs/design.md, "The call
path").  Nothing here knows about managers, sessions or handles.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import queue
import signal
import sys
import threading
from typing import Any, Callable

from . import _cuda, _glibc, _host, _root, _sharing
from ._protocol import CANCEL_INTERRUPT, CANCEL_TIMEOUT, OK, RESET
from .errors import InterpreterStartError

_ENTRY = """\
import sys
sys.path[:] = {path!r}
sys.argv[:] = {argv!r}
from multipy._inside import main
handler, objects, lent, names, fast_path = main({status_fd}, {host_main!r})
del main
"""

_KEYS_START = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p,
                               ctypes.c_size_t)
_FREE_START = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_START = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                          ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_STOP = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_FORWARD_TO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_FORWARD_LIBRARY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)
_ACTIVE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_JOIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double)

#: The longest that join waits: a century, which stands for inf.
_LONGEST_JOIN = 100 * 365 * 86400.0

#: The tensors and arrays the host lent to interpreters, until one gives their token back.
exports = _sharing.Exports()



def _library_path(name: str) -> str:
    """Path of one of multipy's C libraries for namespaces (built by setup.py)."""
    spec = importlib.util.find_spec(f"multipy.{name}")
    if spec is None or not spec.origin:
        raise InterpreterStartError(
            f"multipy's C library {name} is not built: install the package with pip "
            f"(pip install . or pip install -e .), which compiles it")
    return spec.origin


def prepare_process() -> None:
    """Once, before the first namespace: reports fatal signals (docs/design.md); creates
    and joins one thread, without which the loader's lock can miss a wake-up."""
    thread = threading.Thread(target=lambda: None, name="multipy-first-thread")
    thread.start()
    thread.join()
    _host.report_crashes()
    _watch_interrupts()


def _host_main() -> tuple[str, str | None] | None:
    """The host's main script, whose classes objects sent in may be instances of: (its
    path, its module name if it ran with -m), or None.  An interpreter imports it as
    __mp_main__, and the host gets that name for its __main__ too, so that objects of
    those classes that come back find their module."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return None
    sys.modules.setdefault("__mp_main__", main)
    spec = getattr(main, "__spec__", None)
    return os.path.abspath(path), getattr(spec, "name", None)


class Runtime:
    """A started interpreter; see the module's docstring.

    ``call(op, handle, epoch, body)`` runs a request (multipy._protocol) on the calling
    thread and returns (status, new object handle, payload): the C entry itself, which
    sends ``releases`` along.  On the main thread, Ctrl-C raises KeyboardInterrupt
    inside the call at its next bytecode (and then in the host, as usual).
    """

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        libpython = _glibc.libpython_path()  # UnsupportedPythonError, saying why
        try:  # first: a namespace cannot be given back if this fails
            key = _host.take_key()
        except RuntimeError as failure:
            raise InterpreterStartError(f"interpreter {ordinal}: {failure}") from None
        # The root object, _keys, brings libpython in and keeps the namespace's pthread
        # keys: its libc must hand out none (docs/design.md, "pthread keys").
        root, lmid = _glibc.open_namespace(_root.root_path(_library_path("_keys"), libpython))
        _glibc.one_arena(root)  # before a thread of its own allocates there
        # before it starts a thread: what its pthread_create frees is the host's
        _FREE_START(_glibc.symbol(root, "multipy_free_start"))(_glibc.host_free())
        loaded = _glibc.file_of(_glibc.symbol(root, "Py_Initialize"))
        if loaded != os.path.realpath(libpython):
            raise InterpreterStartError(
                f"interpreter {ordinal} loaded {loaded}, not this CPython's {libpython}: "
                f"multipy's root object did not bring it in (multipy/_root.py)")
        error = ctypes.create_string_buffer(512)
        if _KEYS_START(_glibc.symbol(root, "multipy_keys_start"))(ordinal, key, error, len(error)):
            raise InterpreterStartError(f"interpreter {ordinal}: {error.value.decode()}")
        forwarder = _cuda.forwarder()
        if forwarder is not None:  # before any code runs there: the host's CUDA driver
            forward_to = _glibc.symbol(_glibc.load_into(lmid, forwarder), "multipy_forward_to")
            _FORWARD_TO(forward_to)(_cuda.driver()._handle)
        forward_library = _FORWARD_LIBRARY(_glibc.symbol(root, "multipy_forward_library"))
        for library, its_forwarder in _cuda.forwarded_libraries():  # when first opened there
            if forward_library(library.encode(), its_forwarder.encode()):
                break  # the root's table is full: the rest load a copy each
        bootstrap = _glibc.load_into(lmid, _library_path("_bootstrap"))
        symbol = lambda name: _glibc.symbol(bootstrap, name)  # noqa: E731
        self._status_read, status_write = os.pipe()
        stop_read, self._stop_write = os.pipe()
        code = _ENTRY.format(path=list(sys.path), argv=list(sys.argv), status_fd=status_write,
                             host_main=_host_main())
        self._address = _START(symbol("multipy_start"))(
            sys.executable.encode(), code.encode(), _glibc.environment(), status_write,
            stop_read, error, len(error))
        if not self._address:
            raise InterpreterStartError(f"interpreter {ordinal}: {error.value.decode()}")
        self._stop = _STOP(symbol("multipy_stop"))
        self._active = _ACTIVE(symbol("multipy_active"))
        self._join = _JOIN(symbol("multipy_join"))
        #: Handles and tokens the host dropped; they go in with the next request.  Only
        #: ever appended to (finalisers do that) and emptied by the C entry.
        self.releases: list[int] = []
        self.entry = _host.Entry(ordinal, self._address, symbol("multipy_enter"),
                                 symbol("multipy_leave"), symbol("multipy_cancel"),
                                 symbol("multipy_forget"), key, self.releases, exports.objects,
                                 _sharing.lent_tokens)
        self.call = self.entry.call
        #: Why the interpreter cannot be entered (stopped, or a forked child's), or None.
        self.closed_because: str | None = None
        #: Why it could not load a library for lack of static TLS, or None: load
        #: balancers pass it by (docs/design.md, "Static TLS").
        self.out_of_room: str | None = None
        #: Timed calls whose callers gave up on them and that still run (or wait to).
        self.abandoned_calls: set[_Job] = set()
        #: How many times it was reset: requests carry the epoch they were made in.
        self.epoch = 0
        self.finished = False

    def wait_ready(self) -> None:
        """Waits until the interpreter can be entered; InterpreterStartError if it cannot."""
        message = os.read(self._status_read, 1 << 16)
        if message != b"ready":
            self.finished = True
            self.close("it failed to start")
            raise InterpreterStartError(
                f"interpreter {self.ordinal} failed to start: {message.decode(errors='replace')}")

    def close(self, reason: str) -> None:
        """No entry from now on: calls answer CLOSED."""
        self.closed_because = reason
        self.entry.close()

    def start(self, request: tuple[int, int, int, bytes], finish: Callable[[tuple], Any],
              unsent: Callable[[], None]) -> _Job:
        """Runs request (call's first four arguments) on a worker thread and returns at
        once: the job, whose end its ``wait``, ``add_done_callback`` and ``result`` tell
        (finish(reply) is its value).

        A caller that gives up on it (``wait`` past its deadline: TimeoutError, or
        KeyboardInterrupt if interrupted; ``cancel``) has the call cancelled (CallCancelled,
        or KeyboardInterrupt, raised in it at its next bytecode); it counts in
        ``abandoned`` until it ends, and its result is finished and dropped.  A call that
        had not started never runs, and unsent() takes back what it lent.
        """
        job = _Job(self, request, finish, unsent)
        _workers.submit(job.run)
        return job

    def reset(self) -> bool:
        """Forgets the objects and sources of the manager that used this interpreter; runs
        behind nothing, so only when no abandoned call runs.  True if it ran."""
        if self.abandoned:
            return False
        self.epoch += 1  # requests of the managers before are refused from now on
        status, _, _ = self.call(RESET, 0, self.epoch, _sharing.plain(()))
        return status == OK

    @property
    def abandoned(self) -> int:
        """How many calls whose callers gave up on them still run (or wait to) here."""
        return len(self.abandoned_calls)

    # -- exit --

    def stop(self) -> None:
        """Refuses new entries; calls in progress go on (``idle`` tells when none is)."""
        self.close("the interpreter is stopped: the process is exiting")
        self._stop(self._address)

    def idle(self) -> bool:
        return self._active(self._address) == 0

    def finalise_start(self) -> None:
        """After stop(), with no call in progress: its own thread finalises it (join)."""
        os.write(self._stop_write, b"x")

    def join(self, timeout: float) -> bool:
        """Waits up to timeout seconds (inf: until it ends) for the interpreter's thread to
        end; True if it did."""
        if not self.finished:
            seconds = min(max(timeout, 0.0), _LONGEST_JOIN)  # the C deadline must be finite
            self.finished = self._join(self._address, seconds) == 0
        return self.finished

    def __repr__(self) -> str:
        return f"<multipy runtime #{self.ordinal}>"


class _Job:
    """One call of start: run by a worker, waited for by its caller
    (``wait``) or reported to it (``add_done_callback``)."""

    def __init__(self, runtime: Runtime, request: tuple[int, int, int, bytes], finish: Callable,
                 unsent: Callable) -> None:
        self._runtime = runtime
        self._request = request
        self._finish = finish
        self._unsent = unsent
        self._serial = _host.next_serial()
        self._thread: int | None = None
        self._done = threading.Event()
        self._outcome: tuple[Any, BaseException | None] = (None, None)
        self._abandoned = False
        self._callbacks: list[Callable[[_Job], None]] = []
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self._abandoned:  # given up before it started: never run it
                self._runtime.abandoned_calls.discard(self)
                self._unsent()
                return
            self._thread = threading.get_ident()
        runtime = self._runtime
        try:
            outcome = (self._finish(runtime.entry.call(*self._request, self._serial)), None)
        except BaseException as error:
            outcome = (None, error)
        with self._lock:
            runtime.abandoned_calls.discard(self)
            if not self._abandoned:
                self._outcome = outcome
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        del outcome  # an abandoned result goes now: its handles and aliases are released
        for callback in callbacks:
            callback(self)

    def wait(self, seconds: float) -> Any:
        try:
            finished = self._done.wait(max(seconds, 0.0))
        except BaseException:  # Ctrl-C while waiting
            self._give_up(CANCEL_INTERRUPT)
            raise
        if not finished and self._give_up(CANCEL_TIMEOUT):
            raise TimeoutError(
                f"interpreter #{self._runtime.ordinal} did not answer within {seconds} s; the "
                f"call was cancelled and runs (or waits) on there until it stops, and the "
                f"interpreter is handed to no one else until then")
        return self.result()

    def add_done_callback(self, callback: Callable[[_Job], None]) -> None:
        """callback(job) once the call has ended, on the worker thread that ran it (at
        once, here, if it has ended); never for a call that was given up before it
        started.  It must not raise."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def result(self) -> Any:
        """The call's value, or the exception it raised, once it has ended; None for a
        call that was given up on (its result was dropped)."""
        value, error = self._outcome
        if error is not None:
            raise error
        return value

    def cancel(self) -> bool:
        """Gives up on the call as a deadline does (see Runtime.start): it is
        cancelled if it runs and never runs if it has not started.  False if it had
        already ended."""
        return self._give_up(CANCEL_TIMEOUT)

    def _give_up(self, kind: int) -> bool:
        """Abandons the call unless it has ended; False if it had."""
        with self._lock:
            if self._done.is_set():
                return False
            self._abandoned = True
            self._runtime.abandoned_calls.add(self)
            thread = self._thread
        if thread is not None:  # cancelling waits for the interpreter's GIL: not here
            entry, serial = self._runtime.entry, self._serial
            _workers.submit(lambda: entry.cancel(thread, serial, kind))
        return True


class _Workers:
    """Daemon threads for started calls: one per job in flight; idle ones are reused."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spare = self._idle > 0
            self._idle -= spare
        if not spare:
            threading.Thread(target=self._work, name="multipy-worker", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


def _watch_interrupts() -> None:
    """Ctrl-C while the main thread runs a call: the signal's wake-up byte reaches a
    watcher thread, which raises KeyboardInterrupt in that call (the host's own handler
    raises it in the host once the call returns).  Only when this runs on the main
    thread and no one else set a wake-up fd (an asyncio loop does; then Ctrl-C waits
    for the call to end)."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _host.set_main_thread(threading.get_ident())

    def relay() -> None:
        while True:
            if signal.SIGINT in os.read(read_fd, 64):
                _host.interrupt_main()

    threading.Thread(target=relay, name="multipy-interrupts", daemon=True).start()


_workers = _Workers()


def _after_fork_in_child() -> None:
    """The workers are threads, which a forked child does not have; their lock may have
    been held by another thread at the fork."""
    global _workers
    _workers = _Workers()


os.register_at_fork(after_in_child=_after_fork_in_child)
