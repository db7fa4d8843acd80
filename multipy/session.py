"""Sessions (exclusive use of one interpreter) and Obj, a handle to an object inside one."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .interpreter import Interpreter


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
        of the same interpreter."""
        return self._interpreter._request("call", self, args, kwargs)

    def attr(self, name: str) -> Obj:
        """The object's attribute ``name``."""
        return self._interpreter._request("getattr", self, name)

    def hasattr(self, name: str) -> bool:
        """Whether the object has attribute ``name``."""
        return self._interpreter._request("hasattr", self, name)

    def deref(self) -> Any:
        """A copy of the object in the host (it must be picklable)."""
        return self._interpreter._request("deref", self)

    def __repr__(self) -> str:
        return f"<multipy.Obj #{self._handle} in {self._interpreter}>"

    def __reduce__(self):
        raise TypeError("an Obj cannot be pickled: pass it as an argument to a call in its "
                        "own interpreter, or deref() it")

    def __del__(self) -> None:
        interpreter = getattr(self, "_interpreter", None)
        if interpreter is not None:
            interpreter._release(self._handle)


class InterpreterSession:
    """Exclusive use of one interpreter while the session is open (a context manager).

    The interpreter counts as busy for the load balancer until ``close()``.  Made by
    ``InterpreterManager.acquire_one()`` or ``Interpreter.acquire_session()``.
    """

    def __init__(self, interpreter: Interpreter) -> None:
        self._interpreter = interpreter  # whoever makes a session has counted it as a use
        self._closed = False
        #: The package importer or replicated object this session is about, else None.
        self.self: Obj | None = None
        self._package = None  # the Package that self came from, for create_movable

    @property
    def interpreter(self) -> Interpreter:
        """The interpreter this session holds."""
        return self._interpreter

    def global_(self, module: str, name: str) -> Obj:
        """The object ``name`` (dots allowed) of ``module``, imported in the interpreter."""
        return self._interpreter._request("global", module, name)

    def from_movable(self, replicated) -> Obj:
        """The replicated object (from ``create_movable``) in this session's interpreter."""
        return replicated._instance(self._interpreter)

    def is_owner(self, obj: Obj) -> bool:
        """Whether obj lives in this session's interpreter."""
        return isinstance(obj, Obj) and obj.interpreter is self._interpreter

    def _about(self, make_self, package) -> InterpreterSession:
        """This session, with ``self`` set to make_self(interpreter) and the package it
        came from; closed if making ``self`` fails."""
        try:
            self.self = make_self(self._interpreter)
        except BaseException:
            self.close()
            raise
        self._package = package
        return self

    def close(self) -> None:
        """Hands the interpreter back to the load balancer; idempotent."""
        if not self._closed:
            self._closed = True
            self._interpreter._release_use()

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
