"""ReplicatedObj: one logical object, materialised lazily in each interpreter that runs it."""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from . import _host
from ._parallel import on_each
from ._protocol import C_CALL_PATH
from .errors import WrongInterpreterError
from .session import current_timeout, timeout

if TYPE_CHECKING:
    from .package import Package
    from .session import Interpreter, InterpreterSession, Obj


class PerInterpreter:
    """A value made once per interpreter, on first use, even when threads race for it."""

    def __init__(self, make: Callable[[Interpreter], Obj],
                 note: Callable[[Interpreter, Obj | None], None] | None = None) -> None:
        self._make = make
        #: note(interpreter, value) once a value is made, note(interpreter, None) once it
        #: is dropped, under the lock
        self._note = note
        #: the values made so far, by interpreter: read it, never change it
        self.made: dict[Interpreter, Obj] = {}
        self._making: dict[Interpreter, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, interpreter: Interpreter) -> Obj:
        """The value for interpreter, made now if it is not yet (``made`` has it if it
        is)."""
        value = self.made.get(interpreter)  # made already: the path of every call
        if value is not None:
            return value
        with self._lock:
            value = self.made.get(interpreter)
            if value is not None:
                return value
            making = self._making.setdefault(interpreter, threading.Lock())
        with making:  # one maker per interpreter; the others wait for its value
            with self._lock:
                value = self.made.get(interpreter)
            if value is None:
                value = self._make(interpreter)
                with self._lock:
                    self.made[interpreter] = value
                    if self._note is not None:
                        self._note(interpreter, value)
        return value

    def drop(self, interpreter: Interpreter | None = None) -> None:
        with self._lock:
            dropped = list(self.made) if interpreter is None else [interpreter]
            for each in dropped:
                if self.made.pop(each, None) is not None and self._note is not None:
                    self._note(each, None)

    def __contains__(self, interpreter: Interpreter) -> bool:
        return interpreter in self.made

    def __len__(self) -> int:
        return len(self.made)


class _PythonReplicas:
    """The Python reference of _host.Replicas (MULTIPY_CALL_PATH=python), the base of
    ReplicatedObj: its call, always by ``_call``."""

    def __init__(self, manager: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(None, args, kwargs)

    def _note(self, interpreter: Interpreter, instance: Obj | None) -> None:
        pass


#: The base of ReplicatedObj: its call in C when the calling thread's last pick is free
#: and the object made there (docs/design.md, "The common call in C")
_Replicas = _host.Replicas if C_CALL_PATH else _PythonReplicas


class ReplicatedObj(_Replicas):
    """An object that every interpreter of a manager can run.

    Each interpreter builds its own copy on first use (once, even when several threads
    ask at the same time); tensor storages are shared with the original, not copied.
    Calling it, ``r(*args, **kwargs)``, runs on an interpreter the load balancer picks
    and returns host values, with tensors and arrays aliased rather than copied; it
    raises what the call raised inside, and what ``manager.acquire_one()`` raises.
    """

    def __init__(self, manager: Any, load: Callable[[Interpreter], Obj],
                 package: Package | None = None) -> None:
        super().__init__(manager)
        self._manager = manager
        self._package = package
        this = weakref.ref(self)  # no cycle: dropped, it goes at once, its copies with it

        def note(interpreter: Interpreter, instance: Obj | None) -> None:
            replicated = this()
            if replicated is not None:
                replicated._note(interpreter, instance)

        self._instances = PerInterpreter(load, note)

    def instance(self, interpreter: Interpreter) -> Obj:
        """The object in interpreter, materialised there if it is not yet;
        WrongInterpreterError if interpreter belongs to another manager."""
        if interpreter.manager is not self._manager:
            raise WrongInterpreterError(
                f"{interpreter} belongs to another manager than {self!r}: a replicated "
                f"object runs only on the interpreters of the manager that made it. Call "
                f"it directly (r(...) picks one of them), or use a session of that manager "
                f"(r.acquire_session(), session.from_movable(r)); to have it in this "
                f"interpreter's manager, make it there again (that manager's "
                f"load_package(...).load_pickle(...), or its create_movable(obj, session))")
        return self._instances.get(interpreter)

    def _call(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        interpreter = self._manager.occupy_one()  # no session: the path of every call
        try:
            instance = self._instances.made.get(interpreter)  # get()'s common case, inline
            if instance is None:
                instance = self._instances.get(interpreter)
            return instance.call_value(method, args, kwargs)
        finally:
            interpreter.occupancy.give_back()  # hand_back(), one call less

    def call_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Calls the object's method ``name`` on a free interpreter; returns host values."""
        return self._call(name, args, kwargs)

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """``r(*args, **kwargs)`` for asyncio: the same host values (or exception), and
        the event loop is never blocked (the call runs on a worker thread).

        If the awaiting task is cancelled (``task.cancel()``, ``asyncio.wait_for``), the
        call is cancelled as at a ``multipy.timeout`` deadline: CallCancelled is raised in
        it at its next bytecode, or it never runs if it had not started, and the load
        balancer hands its interpreter to no one until it has stopped.  A first use that
        materialises the object on an interpreter runs on a thread too, and is not
        cancelled.  Bound it with ``asyncio.wait_for`` (``multipy.timeout`` is for
        threads).
        """
        return await self._acall(None, args, kwargs)

    async def acall_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``r.call_method(name, ...)`` for asyncio; see ``acall``."""
        return await self._acall(name, args, kwargs)

    async def _acall(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        import asyncio

        from . import _aio

        with await _aio.acquire_one(self._manager) as session:
            interpreter = session.interpreter
            if interpreter in self._instances:
                instance = self.instance(interpreter)
            else:  # materialising makes calls that block: not on the loop's thread
                instance = await asyncio.to_thread(self.instance, interpreter)
            return await _aio.result(instance.start_call_value(method, args, kwargs))

    def hasattr(self, name: str) -> bool:
        with self._manager.acquire_one() as session:
            return self.instance(session.interpreter).hasattr(name)

    def acquire_session(self, interpreter: Interpreter | None = None) -> InterpreterSession:
        """A session on interpreter (or one the load balancer picks) whose ``self`` is
        this object in that interpreter; WrongInterpreterError for an interpreter of
        another manager."""
        session = self._manager.acquire_one() if interpreter is None else interpreter.acquire_session()
        return session.about(self.instance, self._package)

    def unload(self, interpreter: Interpreter | None = None) -> None:
        """Drops the copy in interpreter, or in all; a later use materialises it again."""
        self._instances.drop(interpreter)

    def warm_up(self, *args: Any, **kwargs: Any) -> None:
        """Materialises the object on every interpreter of its manager now, all at once
        (one host thread per interpreter), so that no caller pays for it later; with
        args or kwargs, also calls it once with them on each interpreter, whose first
        calls are slow (imports, caches).  Returns None.

        Each interpreter counts as busy for the load balancer while it warms up.  The
        calling thread's ``multipy.timeout`` bounds each call the warm-up makes.  If it
        fails on any interpreter, the error of the first such interpreter is raised here,
        once every thread has ended.
        """
        call = bool(args or kwargs)
        seconds = current_timeout()

        def warm(interpreter: Interpreter) -> None:
            with timeout(seconds), interpreter.acquire_session():
                instance = self.instance(interpreter)
                if call:
                    instance.call_value(None, args, kwargs)

        on_each(self._manager.all_instances(), warm, "multipy-warm-up")

    def __repr__(self) -> str:
        return f"<multipy.ReplicatedObj loaded in {len(self._instances)} interpreter(s)>"


class PythonMethodWrapper:
    """A callable for one method of a replicated object; ``argument_names`` lists the
    method's parameters (read from its signature inside an interpreter)."""

    def __init__(self, replicated: ReplicatedObj, method: str) -> None:
        self.replicated = replicated
        self.method = method
        self._argument_names: list[str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.replicated.call_method(self.method, *args, **kwargs)

    @property
    def argument_names(self) -> list[str]:
        if self._argument_names is None:
            with self.replicated.acquire_session() as session:
                names = session.global_("multipy._inside.package", "argument_names")
                self._argument_names = names(session.self, self.method).deref()
        return self._argument_names
