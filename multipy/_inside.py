"""The code that runs inside each interpreter, on the interpreter's own thread.

It is started by the C bootstrap through ``main()`` and never runs in the host.  It
keeps the interpreter's objects that the host holds handles to, runs the host's
requests one at a time, and answers through the channel.  Its imports stay small:
everything here costs start-up time in every interpreter.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.abc
import importlib.util
import itertools
import os
import pickle
import sys
import threading
import traceback

from . import _sharing
from .channel import ERROR, OK, InterpreterEnd


def _strip_rtld_global() -> None:
    """RTLD_GLOBAL inside a namespace crashes glibc (DESIGN.md 3.2): drop it everywhere
    Python code can ask for it (``import torch`` does, through ctypes)."""
    set_flags = sys.setdlopenflags
    sys.setdlopenflags = lambda flags: set_flags(flags & ~os.RTLD_GLOBAL)
    sys.setdlopenflags(sys.getdlopenflags())
    cdll_init = ctypes.CDLL.__init__

    def init(self, name, mode=ctypes.DEFAULT_MODE, *args, **kwargs):
        cdll_init(self, name, mode & ~os.RTLD_GLOBAL, *args, **kwargs)

    ctypes.CDLL.__init__ = init
    ctypes.RTLD_GLOBAL = 0


def _name(target) -> str:
    """target's own dotted name if it has one (functions, classes), else its type's.
    Never runs a __getattr__ (nn.Module's raises, slowly, on every call)."""
    try:
        own = object.__getattribute__(target, "__qualname__")
        return f"{object.__getattribute__(target, '__module__')}.{own}"
    except AttributeError:
        kind = type(target)
        return f"a {kind.__module__}.{kind.__qualname__}"


class _NewObject:
    """Marks a result that stays in the interpreter and goes back as a handle."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports modules from sources the host registered (register_module_source).

    A registered name that is a prefix of other registered names is a package.
    """

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.sources:
            return None
        is_package = any(name.startswith(fullname + ".") for name in self.sources)
        return importlib.util.spec_from_loader(fullname, self, origin=f"<multipy:{fullname}>",
                                               is_package=is_package)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__spec__.name
        exec(compile(self.sources[name], f"<multipy:{name}>", "exec"), module.__dict__)


class _Unpickler(_sharing.AliasingUnpickler):
    """Unpickles a request: a handle becomes the object the host holds, a lent tensor or
    array becomes an alias of the host's memory."""

    def __init__(self, data: bytes, objects: dict[int, object], released: list[int]) -> None:
        super().__init__(data, released.append)
        self._objects = objects

    def find_class(self, module: str, name: str):
        if module == _sharing.__name__ and name == "handle":
            return functools.partial(_object, self._objects)  # not a method: see AliasingUnpickler
        return super().find_class(module, name)


def _object(objects: dict[int, object], number: int):
    """The object behind a handle the host sent."""
    try:
        return objects[number]
    except KeyError:
        raise LookupError(f"object #{number} is gone from this interpreter: it was "
                          f"released, or the manager it came from closed") from None


class _Interpreter:
    """State of this interpreter as the host sees it: its objects and its requests."""

    def __init__(self, index: int, released: list[int], crash_slot: int) -> None:
        self.index = index
        # The host's fatal-signal report reads this thread's id and current call here.
        identity = (ctypes.c_int * 2).from_address(crash_slot)  # struct multipy_slot
        identity[0], identity[1] = threading.get_native_id(), index
        self._what = crash_slot + 8
        self.objects: dict[int, object] = {}
        # Handles and lent tensors share one numbering, never reused, so that a release
        # names one thing and a late release is harmless.
        self._ids = itertools.count(1)
        self.exports = _sharing.Exports(self._ids)  # outlives managers: the host may hold aliases
        self._released = released
        self.sources = _SourceFinder()
        sys.meta_path.insert(0, self.sources)

    # -- the operations the host asks for; each returns a value or a _NewObject --

    def op_global(self, module: str, name: str):
        value = importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
        return _NewObject(value)

    def op_call(self, target, args, kwargs):
        return _NewObject(target(*args, **kwargs))

    def op_call_value(self, target, method, args, kwargs):
        """target(*args, **kwargs), or its method's, returned as a value."""
        return (target if method is None else getattr(target, method))(*args, **kwargs)

    def op_getattr(self, target, name: str):
        return _NewObject(getattr(target, name))

    def op_hasattr(self, target, name: str) -> bool:
        return hasattr(target, name)

    def op_deref(self, target):
        return target

    def op_set_sources(self, sources: dict[str, str]) -> None:
        self._forget_source_modules()
        self.sources.sources = dict(sources)

    def op_reset(self) -> None:
        """Forgets the host's objects and sources: the manager that used them closed."""
        self.objects.clear()
        self._forget_source_modules()
        self.sources.sources = {}

    def _forget_source_modules(self) -> None:
        """Unimports modules made from registered sources, so that new sources take effect."""
        for name in self.sources.sources:
            sys.modules.pop(name, None)

    # -- plumbing --

    def _load(self, data: bytes):
        return _Unpickler(data, self.objects, self._released).load()

    def handle_call(self, data: bytes) -> tuple[int, int, bytes]:
        arguments_read = False
        try:
            op, args = self._load(data)
            arguments_read = True
            self._note(op, args)
            result = getattr(self, "op_" + op)(*args)
            if isinstance(result, _NewObject):
                handle = next(self._ids)
                self.objects[handle] = result.value
                return OK, handle, b""
            return OK, 0, _sharing.LendingPickler(self.exports).dumps(result)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: they end a call, not the interpreter
            try:
                return self._error(exc, arguments_read)
            except BaseException:  # the exception cannot even be described (a broken __str__)
                detail = (None, "multipy.InterpreterError", "an exception was raised inside "
                          "the interpreter, and describing it failed too", "", arguments_read)
                return ERROR, 0, pickle.dumps(detail)

    def _note(self, op: str, args: tuple) -> None:
        """Records what this interpreter runs now, for the fatal-signal report."""
        try:
            text = f"import of {args[0]}.{args[1]}" if op == "global" else \
                f"{op} of {_name(args[0] if args else None)}"
        except Exception:  # user objects may answer attribute lookups in any way
            text = op
        encoded = text.encode(errors="replace")[:111] + b"\0"
        ctypes.memmove(self._what, encoded, len(encoded))

    def _error(self, exc: BaseException, arguments_read: bool) -> tuple[int, int, bytes]:
        """An ERROR reply; arguments_read False tells the host that nothing it lent for
        this request was aliased, so it may take it all back."""
        kind = type(exc)
        text = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
        picklable = None
        if isinstance(exc, Exception):  # BaseExceptions such as SystemExit must not act in the host
            try:
                picklable = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
                pickle.loads(picklable)
            except BaseException:
                picklable = None
        detail = (picklable, f"{kind.__module__}.{kind.__qualname__}", str(exc), text,
                  arguments_read)
        return ERROR, 0, pickle.dumps(detail, protocol=pickle.HIGHEST_PROTOCOL)

    def release(self, handle: int) -> None:
        """Drops a handle, or a tensor lent to the host (they share one numbering)."""
        if self.objects.pop(handle, None) is None:
            self.exports.release(handle)


_current: _Interpreter | None = None


def stats() -> dict[str, int]:
    """What this interpreter holds for the host: objects behind handles, tensors and
    arrays lent to the host, and host tokens it released but has not yet reported."""
    return {"objects": len(_current.objects), "lent": len(_current.exports),
            "unreported": len(_current._released)}


def forget_paths(paths: list[str]) -> None:
    """Removes paths from sys.path and unimports every module loaded from under them."""
    for path in paths:
        while path in sys.path:
            sys.path.remove(path)
    prefixes = tuple(os.path.join(p, "") for p in paths)
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(prefixes):
            del sys.modules[name]
    importlib.invalidate_caches()


def main(index: int, request_fd: int, released_fd: int, status_fd: int, state_address: int,
         crash_slot: int) -> None:
    """Runs this interpreter until the host stops it."""
    try:
        _strip_rtld_global()
        end = InterpreterEnd(request_fd, released_fd, state_address)
        interpreter = _Interpreter(index, end.released, crash_slot)
        global _current
        _current = interpreter
    except BaseException:
        os.write(status_fd, traceback.format_exc().encode())
        raise
    os.write(status_fd, b"ready")
    end.serve(interpreter.handle_call, interpreter.release)
    if len(interpreter.exports):
        interpreter.exports.keep_forever()  # the host may still read them while it exits
