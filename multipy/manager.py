"""InterpreterManager: a pool of interpreters with a load balancer."""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import IO, Any

from . import _pool
from .environment import Environment, NoopEnvironment
from .errors import InterpreterClosedError, InterpreterLimitError, WrongInterpreterError
from .package import Package
from .replicated import ReplicatedObj
from .session import Cursor, Interpreter, InterpreterSession, Obj, current_timeout

_INSIDE = "multipy._inside"


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_torch_threads(n_interpreters: int) -> int:
    """The intra-op threads each of n interpreters runs torch with by default: the cores
    this process may use, divided among them (at least 1), so that together they do not
    oversubscribe the cores (each interpreter has its own copy of torch's thread pool)."""
    return max(1, cores() // max(1, n_interpreters))


class InterpreterManager:
    """n interpreters of this process, configured by ``environment``.

    torch, in each interpreter, runs with ``torch_threads`` intra-op threads (default:
    ``default_torch_threads(n)``) and grad mode ``grad_enabled`` (default: on, as in
    torch), on every thread that calls in, from its first call after torch is imported
    (torch keeps both per thread, and the host's settings do not carry over).  With
    ``cuda_streams`` (the default), each interpreter queues its CUDA work on a stream of
    its own, which every thread that calls in gets as its current stream once CUDA has
    started there (a thread that chose a stream itself keeps it); without, on the
    device's default stream, which serialises the work of every interpreter.

    A context manager; ``close()`` returns the interpreters to the process, which keeps
    them for the next manager (a process can start at most 15 and never frees one); a
    manager dropped without ``close()`` returns them too.  Objects obtained through a
    manager stop working when it closes.  Raises InterpreterLimitError if the process
    cannot hold n more, InterpreterStartError if one fails to start.
    """

    def __init__(self, n_interpreters: int = 2, environment: Environment | None = None, *,
                 torch_threads: int | None = None, grad_enabled: bool = True,
                 cuda_streams: bool = True) -> None:
        if n_interpreters < 1:
            raise ValueError(f"n_interpreters must be at least 1, not {n_interpreters}")
        if torch_threads is not None and torch_threads < 1:
            raise ValueError(f"torch_threads must be at least 1, not {torch_threads}")
        self.torch_threads = torch_threads or default_torch_threads(n_interpreters)
        self.grad_enabled = bool(grad_enabled)
        self.cuda_streams = bool(cuda_streams)
        self.environment = environment if environment is not None else NoopEnvironment()
        self._sources: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._runtimes = _pool.acquire(n_interpreters)
        self._interpreters = [Interpreter(i, self, runtime)
                              for i, runtime in enumerate(self._runtimes)]
        # Dropped without close(): the runtimes go back (reset before they are lent again).
        self._finalizer = weakref.finalize(self, _pool.give_back, self._runtimes)
        self._thread = Cursor(self._runtimes[0].ordinal)  # each thread's last pick
        self._limit = n_interpreters
        self._configured: list[Interpreter] = []
        try:
            for interpreter in self._interpreters:
                with interpreter.acquire_session() as session:
                    session.global_(_INSIDE, "set_torch_settings")(
                        self.torch_threads, self.grad_enabled, self.cuda_streams)
                    self.environment.configure(session)
                self._configured.append(interpreter)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._interpreters)

    def __getitem__(self, index: int) -> Interpreter:
        return self._interpreters[index]

    def all_instances(self) -> list[Interpreter]:
        """Every interpreter, for work that must run on each (set-up, loading)."""
        return list(self._interpreters)

    def acquire_one(self) -> InterpreterSession:
        """A session on the interpreter the load balancer picks.

        Starting at the calling thread's last pick, the first interpreter with no open
        session; if all are busy, the one with the fewest.  An interpreter still running
        a call that its caller gave up on (timeout, Ctrl-C) is not picked until that call
        ends; if every one is, this waits (at most the thread's ``multipy.timeout``, then
        TimeoutError).  An interpreter that had no room to load a library is never
        picked; InterpreterLimitError if none is left.  InterpreterClosedError once the
        manager is closed.
        """
        return InterpreterSession(self.occupy_one())

    def occupy_one(self) -> Interpreter:
        """The interpreter acquire_one would pick, counted busy until its
        ``hand_back()``: acquire_one without a session, for one call of a replicated
        object.  Raises what acquire_one raises."""
        deadline = None
        while True:
            # Most calls: the thread's last pick is free, taken by its occupancy alone
            # (which checks and counts at once; the manager's lock orders passes)
            if not self._closed:
                last = self._interpreters[self._thread.cursor % self._limit]
                if last.occupancy.take_if_idle():
                    return last
            self._lock.acquire()  # not `with`: half the cost
            try:
                chosen = None if self._closed else self._pick()
                if chosen is not None:
                    self._thread.cursor = chosen.index
                    return chosen.occupy()
            finally:
                self._lock.release()
            self._check_open()
            if deadline is None:  # every interpreter runs an abandoned call: wait
                seconds = current_timeout()
                deadline = float("inf") if seconds is None else time.monotonic() + seconds
            if time.monotonic() >= deadline:  # timeout(0): one try, never a sleep
                raise TimeoutError(
                    "every interpreter is still running a call its caller gave up on")
            time.sleep(0.001)

    def _pick(self) -> Interpreter | None:
        """See acquire_one: one pass, for when the calling thread's last pick is busy."""
        interpreters, count = self._interpreters, self._limit
        start = self._thread.cursor
        best, fewest, roomy = None, 0, False
        for step in range(count):
            interpreter = interpreters[(start + step) % count]
            if interpreter.out_of_room:
                continue
            roomy = True
            if interpreter.running_abandoned_call:
                continue
            sessions = interpreter.open_sessions
            if sessions == 0:
                return interpreter
            if best is None or sessions < fewest:
                best, fewest = interpreter, sessions
        if not roomy:
            raise InterpreterLimitError(f"no interpreter of this manager had room to load "
                                        f"what it was asked to: {interpreters[0].out_of_room}")
        return best

    def debug_limit_interpreters(self, count: int) -> None:
        """Makes the load balancer use only the first ``count`` interpreters."""
        if not 1 <= count <= len(self._interpreters):
            raise ValueError(f"count must be between 1 and {len(self._interpreters)}, not {count}")
        self._limit = count

    def register_module_source(self, name: str, source: str) -> None:
        """Makes ``source`` importable as module ``name`` in every interpreter of this
        manager.  Only that module is touched: registering it again replaces it (it is
        re-imported on next use); other registered modules keep their state.  A syntax
        error raises SyntaxError here, before any interpreter is changed; a name of the
        standard library raises ValueError."""
        self._check_open()
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names:
            raise ValueError(f"module name {name!r} would shadow the standard library's "
                             f"{top!r} inside the interpreters: choose another name")
        compile(source, f"<multipy:{name}>", "exec")
        self._sources[name] = source
        for interpreter in self._interpreters:
            with interpreter.acquire_session() as session:
                session.global_(_INSIDE, "register_source")(name, source)

    def count_registered_module_sources(self) -> int:
        return len(self._sources)

    def load_package(self, path_or_file: str | os.PathLike | IO[bytes]) -> Package:
        """Opens a torch.package archive for every interpreter of this manager."""
        self._check_open()
        return Package(self, path_or_file)

    def create_movable(self, obj: Obj, session: InterpreterSession) -> ReplicatedObj:
        """Makes obj, which lives in session's interpreter, usable from every interpreter.

        Other interpreters rebuild it from a pickle over the same tensor storages; the
        session's package (if it came from one) resolves packaged classes.  TypeError if
        obj is not an Obj, WrongInterpreterError if it is not in session's interpreter.
        """
        if not isinstance(obj, Obj):
            raise TypeError(f"create_movable takes an Obj (an object inside an interpreter), "
                            f"not {type(obj).__name__}")
        if not session.is_owner(obj):
            raise WrongInterpreterError(
                f"Cannot create movable from an object that lives in different session: "
                f"{obj!r} is not in {session.interpreter}")
        package = session.package
        source = session.interpreter

        def importer(interpreter: Interpreter) -> Any:
            return package.importer(interpreter) if package is not None else None

        data, storages = session.global_(f"{_INSIDE}.package", "movable")(
            obj, importer(source)).deref()

        def load(interpreter: Interpreter) -> Obj:
            if interpreter is source:
                return obj
            rebuild = interpreter.global_(f"{_INSIDE}.package", "from_movable")
            return rebuild(data, storages, importer(interpreter))

        return ReplicatedObj(self, load, package)

    def close(self) -> None:
        """Undoes the environment and returns the interpreters to the process; idempotent.

        Every interpreter is returned even if undoing the environment fails on some; the
        first such error is raised afterwards.
        """
        if self._closed:
            return
        self._closed = True
        for interpreter in self._interpreters:  # no replicated object's call in C from now
            interpreter.occupancy.close()
        errors = []
        try:
            for interpreter in self._configured:
                try:
                    with interpreter.acquire_session() as session:
                        self.environment.unconfigure(session)
                except InterpreterClosedError:
                    pass  # the process is exiting
                except Exception as error:
                    errors.append(error)
        finally:  # even if interrupted: every interpreter goes back to the process, first
            _pool.give_back(self._runtimes)
            self._finalizer.detach()
            for interpreter in self._interpreters:
                interpreter.close()
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            _pool.refuse("the manager is closed")

    def __enter__(self) -> InterpreterManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<multipy.InterpreterManager {state}, {len(self._interpreters)} interpreters>"
