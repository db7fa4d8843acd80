"""Interpreters as a manager hands them out, sessions on them, and Obj, a handle to an
object inside one; every call into an interpreter goes through ``Interpreter.request``
(or ``Interpreter.start``, which runs it on a worker thread for an asynchronous caller),
but the common call of a value, which ``Obj.call_value`` hands to the C entry's
``call_value`` (docs/design.md, "The common call in C").
"""
from __future__ import annotations

import contextlib
import marshal
import pickle
import threading
from typing import TYPE_CHECKING, Any, Iterator

from . import _glibc, _host, _pool, _protocol, _sharing
from ._protocol import CALL, CALL_LENT, CALL_VALUE, DEREF, GETATTR, GLOBAL, HASATTR
from ._runtime import Runtime, exports
from .errors import InterpreterError, InterpreterLimitError, RemoteTraceback, WrongInterpreterError

if TYPE_CHECKING:
    from ._runtime import _Job


#: Whether calls of values take the C path (multipy._protocol.C_CALL_PATH).
_C_CALL_PATH = _protocol.C_CALL_PATH


class _Occupancy:
    """The Python reference of _host.Occupancy (MULTIPY_CALL_PATH=python): an
    interpreter's users as the load balancer counts them, kept away while runtime has no
    room or runs an abandoned call."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._lock = threading.RLock()  # a session's finaliser may hand back while held
        self.users = 0
        self._closed = False

    def take_if_idle(self) -> bool:
        runtime = self._runtime
        with self._lock:
            if self.users or self._closed or runtime.out_of_room or runtime.abandoned_calls:
                return False
            self.users = 1
            return True

    def take(self) -> None:
        with self._lock:
            self.users += 1

    def give_back(self) -> None:
        with self._lock:
            self.users -= 1

    def close(self) -> None:
        self._closed = True


#: An interpreter's users: counted in C, with the host's GIL held (docs/design.md)
Occupancy = _host.Occupancy if _C_CALL_PATH else _Occupancy


class _ThreadSettings(threading.local):
    """The Python reference of _host.ThreadSettings: the calling thread's timeout."""

    timeout: float | None = None  # a class default: no AttributeError on every call


class _Cursor(threading.local):
    """The Python reference of _host.Cursor: each thread's last pick among a manager's
    interpreters (slot: unused here)."""

    cursor = 0  # a class default: reading it never raises

    def __init__(self, slot: int) -> None:
        pass


#: A manager's cursor (Cursor(slot)): each thread's last pick among its interpreters,
#: kept in C where a replicated object's call reads it (docs/design.md)
Cursor = _host.Cursor if _C_CALL_PATH else _Cursor

_thread = _host.ThreadSettings() if _C_CALL_PATH else _ThreadSettings()
if _C_CALL_PATH:
    _host.use_call_path(_sharing.Lent, exports, _sharing.alias)


@contextlib.contextmanager
def timeout(seconds: float | None) -> Iterator[None]:
    """Within the block, every call this thread makes into an interpreter gives control
    back after at most ``seconds``, raising TimeoutError.  The call is cancelled (an
    exception raised in it at its next bytecode) and runs on until it stops, and the load
    balancer hands its interpreter to no one else until then.  Timed calls run on a
    worker thread, which costs some microseconds each.  ValueError if seconds < 0."""
    if seconds is not None and not seconds >= 0:  # NaN too
        raise ValueError(f"timeout must be None or at least 0 seconds, not {seconds!r}")
    previous = _thread.timeout
    _thread.timeout = seconds
    try:
        yield
    finally:
        _thread.timeout = previous


def current_timeout() -> float | None:
    """The timeout set by ``timeout()`` for this thread, if any."""
    return _thread.timeout


class Obj:
    """A handle to an object that lives inside one interpreter.

    Calling it, or asking for an attribute, runs inside that interpreter and gives
    another Obj; ``deref()`` brings a copy of the value to the host.  The object in the
    interpreter is released when the host's last reference to its Obj goes away.
    """

    __slots__ = ("_interpreter", "_handle", "__weakref__")

    def __init__(self, interpreter: Interpreter, handle: int) -> None:
        self._interpreter = interpreter
        self._handle = handle

    @property
    def interpreter(self) -> Interpreter:
        """The interpreter that owns the object."""
        return self._interpreter

    def __call__(self, *args: Any, **kwargs: Any) -> Obj:
        """Calls the object inside its interpreter; arguments are host values or Objs
        of the same interpreter (WrongInterpreterError otherwise)."""
        return self._interpreter.request(CALL, self, args, kwargs)

    def call_value(self, method: str | None, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Calls the object (or its method) and returns the result as a host value.  The
        C entry makes the call itself (Entry.call_value) on this thread, unless
        MULTIPY_CALL_PATH=python or under ``multipy.timeout``."""
        interpreter = self._interpreter
        if _C_CALL_PATH and _thread.timeout is None and not interpreter._closed:
            return interpreter._entry.call_value(interpreter, self, self._handle,
                                                 interpreter._epoch, method, args, kwargs or {})
        return interpreter.request(CALL_VALUE, self, method, args, kwargs or {})

    def start_call_value(self, method: str | None, args: tuple = (),
                         kwargs: dict | None = None) -> _Job:
        """call_value on a worker thread: returns the running call at once (see
        ``Interpreter.start``); its ``result()`` is what call_value returns."""
        return self._interpreter.start(CALL_VALUE, self, method, args, kwargs or {})

    def attr(self, name: str) -> Obj:
        """The object's attribute ``name``."""
        return self._interpreter.request(GETATTR, self, name)

    def hasattr(self, name: str) -> bool:
        """Whether the object has attribute ``name``."""
        return self._interpreter.request(HASATTR, self, name)

    def deref(self) -> Any:
        """A copy of the object in the host (it must be picklable)."""
        return self._interpreter.request(DEREF, self)

    def __repr__(self) -> str:
        return f"<multipy.Obj #{self._handle} in {self._interpreter}>"

    def __reduce__(self):
        raise TypeError("an Obj cannot be pickled: pass it as an argument to a call in its "
                        "own interpreter, or deref() it")

    def __del__(self) -> None:
        # No I/O and no lock: the release goes in with the interpreter's next request.
        try:
            self._interpreter._runtime.releases.append(self._handle)
        except AttributeError:  # __init__ did not run
            pass


class _Pickler(_sharing.LendingPickler):
    """Pickles a request's arguments: an Obj becomes a reference to the object it stands
    for, a CPU tensor or array is lent (see _sharing), not copied."""

    def __init__(self, interpreter: Interpreter) -> None:
        super().__init__(_sharing.Lent(exports))
        self._interpreter = interpreter

    def reducer_override(self, obj):
        if type(obj) is not Obj:
            return super().reducer_override(obj)
        self._interpreter._check_owns(obj)
        return _sharing.handle, (obj._handle,)


def _nothing() -> None:
    pass


#: The errors a library that could not be loaded raises (dlopen's message in them).
_LOAD_ERRORS = frozenset({"builtins.ImportError", "builtins.ModuleNotFoundError",
                          "builtins.OSError"})


def _remote_error(record: _protocol.RemoteError) -> BaseException:
    """The host exception for an error reply, with the remote traceback as its cause."""
    error = None
    if record.type_name in _LOAD_ERRORS and "in static TLS block" in record.message:
        library = record.message.partition(": cannot allocate")[0].rpartition("/")[2]
        error = InterpreterLimitError(
            f"this interpreter has no room left to load {library} (no static TLS left in "
            f"the process), and load balancers no longer pick it. "
            f"{_glibc.static_tls_advice()}.")
    elif record.pickled is not None:
        try:
            error = pickle.loads(record.pickled)
        except Exception:  # its type does not exist in the host
            error = None
    if error is None:
        error = InterpreterError(record.type_name, record.message, record.traceback)
    error.__cause__ = RemoteTraceback(record.traceback)
    return error


class Interpreter:
    """One interpreter of a manager; ``index`` is its position in the manager.

    Several host threads may use it at once: they run inside it one at a time, as
    threads of one CPython do (its GIL).
    """

    def __init__(self, index: int, manager: Any, runtime: Runtime) -> None:
        self.index = index
        self.manager = manager
        self._runtime = runtime
        self._entry = runtime.entry
        self._epoch = runtime.epoch  # this manager's requests carry it
        self._closed = False
        #: open sessions and running calls of replicated objects: the load balancer's
        #: measure of load (``occupy`` and ``hand_back`` count them; its take_if_idle
        #: counts one if there is none, room left, no abandoned call, the manager open)
        self.occupancy = Occupancy(runtime)
        self._lock = threading.RLock()  # a session's finaliser may close it while held

    @property
    def open_sessions(self) -> int:
        """Sessions open on this interpreter now, and calls of replicated objects running
        on it (see ``occupy``)."""
        return self.occupancy.users

    @property
    def running_abandoned_call(self) -> bool:
        """Whether a call that its caller gave up on (a timeout, Ctrl-C) still runs here."""
        return self._runtime.abandoned > 0

    @property
    def out_of_room(self) -> str | None:
        """Why this interpreter could not load a library for lack of room (then load
        balancers pass it by), or None."""
        return self._runtime.out_of_room

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire_session(self) -> InterpreterSession:
        """A session on this interpreter, bypassing the load balancer;
        InterpreterClosedError if its manager is closed."""
        return InterpreterSession(self.occupy())

    def occupy(self) -> Interpreter:
        """Counts one more user of this interpreter for the load balancer until
        ``hand_back()`` (a session counts for its whole life) and returns it;
        InterpreterClosedError if its manager is closed."""
        with self._lock:
            if self._closed:
                _pool.refuse(f"{self} belongs to a manager that was closed")
            self.occupancy.take()
        return self

    def hand_back(self) -> None:
        """Ends one ``occupy()``."""
        self.occupancy.give_back()

    def global_(self, module: str, name: str) -> Obj:
        """The object ``name`` (dots allowed) of ``module``, imported in the interpreter."""
        return self.request(GLOBAL, None, module, name)

    def request(self, op: int, target: Obj | None, *args: Any) -> Any:
        """Runs one operation of multipy._protocol in the interpreter, on this thread (on
        a worker under ``multipy.timeout``); the path of every call but Obj.call_value's
        common case, which takes this path in C.  Raises what the operation raised
        inside, InterpreterClosedError, or TimeoutError."""
        seconds = _thread.timeout
        if seconds is not None:
            return self.start(op, target, *args).wait(seconds)
        op, handle, body, lent = self._encode(op, target, args)
        # Ctrl-C may raise in the host before _finish reads the reply: then the entry
        # gives back what the request lent and the interpreter did not alias
        reply = self._runtime.call(op, handle, self._epoch, body, 0, lent)
        if reply[1]:  # a new object: the common case, first
            return Obj(self, reply[1])
        return self._finish(reply, lent)

    def start(self, op: int, target: Obj | None, *args: Any) -> _Job:
        """Starts one operation as ``request`` does, but on a worker thread, and returns
        at once: the running call, whose ``add_done_callback``, ``result`` (what request
        would return or raise) and ``cancel`` (as at a ``multipy.timeout`` deadline) an
        asynchronous caller uses.  Raises InterpreterClosedError at once."""
        op, handle, body, lent = self._encode(op, target, args)
        return self._runtime.start((op, handle, self._epoch, body),
                                   lambda reply: self._finish(reply, lent),
                                   lent.take_back if lent else _nothing)

    def _encode(self, op: int, target: Obj | None,
                args: tuple) -> tuple[int, int, bytes, _sharing.Lent | None]:
        """The request for an operation, (op, handle, body) as multipy._protocol says,
        and what it lent (None when nothing is: plain arguments, the fastest path).
        InterpreterClosedError once this interpreter's manager is closed,
        WrongInterpreterError for another interpreter's Obj."""
        if self._closed:
            _pool.refuse(f"{self} belongs to a manager that was closed")
        handle = 0
        if target is not None:
            if target._interpreter is not self:
                self._check_owns(target)
            handle = target._handle
        body = _sharing.plain(args)
        if body is not None:
            return op, handle, body, None
        if op == CALL_VALUE and (not args[2] or _sharing.is_plain(args[2])):
            lent = _sharing.Lent(exports)  # a call with scalars and tensors: the fast path
            try:
                flat = _sharing.lend_flat(args[1], lent)
                if flat is not None:
                    body = _sharing.plain((args[0], *flat, args[2]))
                    if body is not None:
                        return CALL_LENT, handle, body, lent
                    lent.take_back()  # a tuple or long text met twice: pickle keeps it so
            except BaseException:
                lent.take_back()
                raise
        pickler = _Pickler(self)
        return op, handle, pickler.dumps(args), pickler.lent

    def _finish(self, reply: tuple[int, int, bytes], lent: _sharing.Lent | None) -> Any:
        """The result of a reply, or the exception it carries."""
        status, handle, payload = reply
        if status == _protocol.LENT or status == _protocol.TENSOR:
            aliased: list[int] = []
            try:
                if status == _protocol.TENSOR:  # one tensor's record, as LENT would have it
                    token, address = _protocol.LENT_TENSOR.unpack(payload)
                    values, positions, single = ((_sharing.TORCH, token, address),), (0,), True
                else:
                    values, positions, single = marshal.loads(payload)
                values = _sharing.alias_flat(values, positions, self._runtime.ordinal,
                                             aliased)
            except BaseException:  # Ctrl-C, say
                self._give_back(payload, status, aliased)
                raise
            return values[0] if single else tuple(values)
        if status == _protocol.OK:
            if handle:
                return Obj(self, handle)
            if payload[0] != _sharing.PICKLED:
                return marshal.loads(payload)
            reader = _sharing.AliasingUnpickler(payload, self._runtime.ordinal)
            try:
                return reader.load()
            except BaseException as error:
                self._give_back(payload, status, reader.aliased)
                if not isinstance(error, Exception):  # Ctrl-C while reading, say
                    raise
                raise InterpreterError(
                    f"{type(error).__module__}.{type(error).__qualname__}",
                    f"the call's result could not be read in the host: {error}",
                    "") from error
        if status == _protocol.ERROR:
            if lent is not None:
                lent.unread(status, payload)  # reading the request may have failed midway
            record = _protocol.RemoteError(*marshal.loads(payload))
            error = _remote_error(record)
            if isinstance(error, InterpreterLimitError):
                self._runtime.out_of_room = str(error)
            raise error
        if status == _protocol.CLOSED or status == _protocol.CANCELLED:
            if lent is not None:
                lent.unread(status, payload)  # nothing ran: nothing lent was aliased
            if status == _protocol.CANCELLED:  # by Ctrl-C (a timed call's caller is gone)
                raise KeyboardInterrupt
            if self._closed:  # refused: the interpreter went to another manager
                _pool.refuse(f"{self} belongs to a manager that was closed")
            _pool.refuse(f"{self}: {self._runtime.closed_because or 'stopped'}")
        text = payload.decode(errors="replace")  # BROKEN: multipy's own code inside raised
        if text.startswith("KeyboardInterrupt"):
            raise KeyboardInterrupt
        raise InterpreterError("multipy.InterpreterError", f"multipy's code inside the "
                               f"interpreter failed: {text}", "")

    def _give_back(self, payload: bytes, status: int, aliased: list[int]) -> None:
        """For a reply that could not be read whole: what it lent and was not aliased
        goes back to the interpreter with the next call."""
        kept = set(aliased)
        self._runtime.releases.extend(
            token for token in _sharing.lent_tokens(payload, status) if token not in kept)

    def _check_owns(self, obj: Obj) -> None:
        owner = obj._interpreter
        if owner._closed:
            _pool.refuse(f"{obj!r} belongs to a manager that was closed")
        if owner is not self:
            if owner.manager is not self.manager:
                raise WrongInterpreterError(
                    f"{obj!r} lives in {owner}, of another manager, and cannot be used in "
                    f"{self}: an object belongs to the interpreter that made it. Copy it with "
                    f"obj.deref() and pass the copy instead")
            raise WrongInterpreterError(
                f"{obj!r} lives in {owner} and cannot be used in {self}: an object belongs "
                f"to the interpreter that made it. Copy it with obj.deref() and pass the "
                f"copy instead, or make it movable: r = manager.create_movable(obj, session) "
                f"with a session on {owner} (the one obj came from), then "
                f"session.from_movable(r) in a session on {self} gives it there")

    def close(self) -> None:
        """Used by the manager as it closes: no new calls; the interpreter forgets the
        manager's objects and goes back to the process's pool.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # first: nothing new can be made that the reset would miss
            self.occupancy.close()
        _pool.give_back([self._runtime])
        _pool.reset_now(self._runtime)

    def __repr__(self) -> str:
        return f"<multipy.Interpreter {self.index} (#{self._runtime.ordinal} of this process)>"


class InterpreterSession:
    """Exclusive use of one interpreter while the session is open (a context manager).

    The interpreter counts as busy for the load balancer until ``close()``.  Made by
    ``InterpreterManager.acquire_one()`` or ``Interpreter.acquire_session()``.
    """

    def __init__(self, interpreter: Interpreter) -> None:
        self._interpreter = interpreter  # whoever makes a session has counted it
        self._closed = False
        #: The package importer or replicated object this session is about, else None.
        self.self: Obj | None = None
        #: The Package that ``self`` came from, if any (create_movable resolves its classes).
        self.package = None

    @property
    def interpreter(self) -> Interpreter:
        """The interpreter this session holds."""
        return self._interpreter

    def global_(self, module: str, name: str) -> Obj:
        """The object ``name`` (dots allowed) of ``module``, imported in the interpreter;
        InterpreterClosedError once the session is closed."""
        self._check_open()
        return self._interpreter.global_(module, name)

    def from_movable(self, replicated) -> Obj:
        """The replicated object (from ``create_movable``) in this session's interpreter;
        WrongInterpreterError if it belongs to another manager."""
        self._check_open()
        return replicated.instance(self._interpreter)

    def _check_open(self) -> None:
        if self._closed:
            _pool.refuse(f"{self} is closed: open another session")

    def is_owner(self, obj: Obj) -> bool:
        """Whether obj lives in this session's interpreter."""
        return isinstance(obj, Obj) and obj.interpreter is self._interpreter

    def about(self, make_self, package=None) -> InterpreterSession:
        """This session, with ``self`` set to make_self(interpreter) and ``package``; the
        session is closed if making ``self`` fails."""
        try:
            self.self = make_self(self._interpreter)
        except BaseException:
            self.close()
            raise
        self.package = package
        return self

    def close(self) -> None:
        """Hands the interpreter back to the load balancer; idempotent."""
        if not self._closed:
            self._closed = True
            self._interpreter.hand_back()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def __enter__(self) -> InterpreterSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<multipy.InterpreterSession {state} on {self._interpreter}>"
