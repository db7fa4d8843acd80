"""ReplicatedObj: one logical object, materialised lazily in each interpreter that runs it."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from .errors import WrongInterpreterError

if TYPE_CHECKING:
    from .package import Package
    from .session import Interpreter, InterpreterSession, Obj


class PerInterpreter:
    """A value made once per interpreter, on first use, even when threads race for it."""

    def __init__(self, make: Callable[[Interpreter], Obj]) -> None:
        self._make = make
        self._values: dict[Interpreter, Obj] = {}
        self._making: dict[Interpreter, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, interpreter: Interpreter) -> Obj:
        with self._lock:
            value = self._values.get(interpreter)
            if value is not None:
                return value
            making = self._making.setdefault(interpreter, threading.Lock())
        with making:  # one maker per interpreter; the others wait for its value
            with self._lock:
                value = self._values.get(interpreter)
            if value is None:
                value = self._make(interpreter)
                with self._lock:
                    self._values[interpreter] = value
        return value

    def drop(self, interpreter: Interpreter | None = None) -> None:
        with self._lock:
            if interpreter is None:
                self._values.clear()
            else:
                self._values.pop(interpreter, None)

    def __contains__(self, interpreter: Interpreter) -> bool:
        return interpreter in self._values

    def __len__(self) -> int:
        return len(self._values)


class ReplicatedObj:
    """An object that every interpreter of a manager can run.

    Each interpreter builds its own copy on first use (once, even when several threads
    ask at the same time); tensor storages are shared with the original, not copied.
    Calling it runs on an interpreter the load balancer picks and returns host values,
    with tensors and arrays aliased rather than copied.
    """

    def __init__(self, manager: Any, load: Callable[[Interpreter], Obj],
                 package: Package | None = None) -> None:
        self._manager = manager
        self._package = package
        self._instances = PerInterpreter(load)

    def instance(self, interpreter: Interpreter) -> Obj:
        """The object in interpreter, materialised there if it is not yet;
        WrongInterpreterError if interpreter belongs to another manager."""
        if interpreter.manager is not self._manager:
            raise WrongInterpreterError(
                f"{interpreter} belongs to another manager than {self!r}: a replicated "
                f"object runs on the interpreters of the manager that made it")
        return self._instances.get(interpreter)

    def _call(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        with self._manager.acquire_one() as session:
            return self.instance(session.interpreter).call_value(method, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the object on a free interpreter; returns host values."""
        return self._call(None, args, kwargs)

    def call_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Calls the object's method ``name`` on a free interpreter; returns host values."""
        return self._call(name, args, kwargs)

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
