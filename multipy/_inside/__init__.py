"""The code that runs inside each interpreter; no host module imports it.

The C bootstrap runs ``main()`` on the interpreter's own thread once CPython is up;
``main`` returns the handler that the C entry calls for every request, on whichever host
thread entered the interpreter, with the interpreter's GIL held.  The handler keeps the
objects that the host holds handles to, and never raises: every failure becomes an
error reply.  Imports stay small (``_protocol``, ``_sharing`` and the standard library):
everything here costs start-up time in every interpreter.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.abc
import importlib.util
import itertools
import linecache
import marshal
import os
import pickle
import sys
import threading
import traceback
from typing import Any

import _multipy_bootstrap

from .. import _protocol, _sharing
from .._protocol import (CALL, CALL_LENT, CALL_TENSOR, CALL_VALUE, CLOSED, DEREF, ERROR,
                         GETATTR, GLOBAL, HASATTR, LENT, LENT_TENSOR, OK, RESET)

_NEW_OBJECT = frozenset({GLOBAL, CALL, GETATTR})  #: operations whose result stays inside
_NONE = _sharing.plain(None)  #: the most common value's payload
_OP_TEXTS = tuple(name.encode() for name in _protocol.OP_NAMES)  #: for crash reports


def _strip_rtld_global() -> None:
    """RTLD_GLOBAL inside a namespace crashes glibc (docs/design.md, "RTLD_GLOBAL"):
    drop it everywhere Python code can ask for it (``import torch`` does, through ctypes)."""
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


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports modules from sources the host registered (register_module_source).

    A registered name that is a prefix of other registered names is a package.
    """

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}
        #: file name -> the lines of the source compiled under it, for tracebacks: kept
        #: here too, as linecache.clearcache() empties linecache
        self.lines: dict[str, list[str]] = {}

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
        source, filename = self.sources[name], f"<multipy:{name}>"
        self.lines[filename] = source.splitlines(True)
        self.show_lines()
        exec(compile(source, filename, "exec"), module.__dict__)

    def show_lines(self) -> None:
        """Puts the registered modules' sources in linecache, where tracebacks read lines
        (a name in <> is never read from disk, and an mtime of None is never checked)."""
        for filename, lines in self.lines.items():
            entry = linecache.cache.get(filename)
            if entry is None or entry[2] is not lines:
                linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


class _Unpickler(_sharing.AliasingUnpickler):
    """Unpickles a request's arguments: a handle becomes the object the host holds, a
    lent tensor or array becomes an alias of the host's memory."""

    def __init__(self, data, objects: dict[int, object], aliased: list[int]) -> None:
        super().__init__(data, aliased=aliased)
        self._objects = objects

    def find_class(self, module: str, name: str):
        if module == _sharing.__name__ and name == "handle":
            return functools.partial(_object, self._objects)  # not a method: see AliasingUnpickler
        if module == "__main__":  # the host's main script, not this interpreter's __main__
            _import_host_main(name)
            module = "__mp_main__"
        return super().find_class(module, name)


#: The host's main script: (its path, its module name if it ran with -m), or None.
_host_main: tuple[str, str | None] | None = None
_host_main_lock = threading.Lock()


def _import_host_main(wanted: str) -> None:
    """Imports this interpreter's copy of the host's main script once, as
    ``__mp_main__`` (as multiprocessing's spawn does, so that its ``if __name__ ==
    "__main__":`` part does not run); AttributeError saying what to do if the host has
    none (``wanted``: the name looked up in it)."""
    with _host_main_lock:  # another thread may be in the middle of importing it
        if "__mp_main__" not in sys.modules:
            _run_host_main(wanted)


def _run_host_main(wanted: str) -> None:
    if _host_main is None:
        raise AttributeError(
            f"Can't get attribute {wanted!r} of the host's __main__: the host runs no "
            f"main script (an interactive session, -c, or an embedding program), so an "
            f"interpreter cannot import it. Define it in a module that both can import, "
            f"or register its source with register_module_source")
    path, module_name = _host_main
    module = type(sys)("__mp_main__")
    module.__file__ = path
    if module_name is not None:  # run with -m: its relative imports need its package
        import runpy  # here: every interpreter's start-up pays for what is imported above

        module.__dict__.update(runpy.run_module(module_name, run_name="__mp_main__",
                                                alter_sys=True))
        sys.modules["__mp_main__"] = module
        return
    sys.modules["__mp_main__"] = module  # while it runs too, as for any import
    try:
        with open(path, "rb") as source:
            exec(compile(source.read(), path, "exec"), module.__dict__)
    except BaseException:
        del sys.modules["__mp_main__"]
        raise


def _object(objects: dict[int, object], number: int):
    """The object behind a handle the host sent."""
    try:
        return objects[number]
    except KeyError:
        raise LookupError(f"object #{number} is gone from this interpreter: it was "
                          f"released, or the manager it came from closed") from None


class _Interpreter:
    """This interpreter as the host sees it: its objects and the requests it runs."""

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.epoch = 0  # resets so far (see multipy._protocol)
        self._names: dict = {}  # handle, or (module, name) -> its name in crash reports
        # Handles and lent tensors share one numbering, never reused, so that a release
        # names one thing and a late release is harmless.
        self._ids = itertools.count(1)
        self.exports = _sharing.Exports(self._ids)  # outlives managers: the host may hold aliases
        self.sources = _SourceFinder()
        sys.meta_path.insert(0, self.sources)
        #: (intra-op threads, grad enabled, a CUDA stream of this interpreter's own) for
        #: torch, set by the manager; torch keeps all three per thread, so each thread
        #: gets them on its first call once torch is in (and again once CUDA starts)
        #: (which settings object each thread was given: _multipy_bootstrap.thread_torch,
        #: kept in C for the fast path)
        self.torch_settings: tuple[int, bool, bool] | None = None
        self._streams: dict[int, Any] = {}  # CUDA device -> this interpreter's stream
        self._awaiting_cuda = False
        _sharing.settle_thread = self.apply_torch_settings
        #: the operations but the calls, which handle() makes itself (the hot path)
        self._ops = {GLOBAL: self._global, GETATTR: self._getattr, HASATTR: self._hasattr,
                     DEREF: self._deref, RESET: self._reset}

    # -- the operations: a result of GLOBAL, CALL or GETATTR stays here (a new handle) --

    def _global(self, target, module: str, name: str):
        value = importlib.import_module(module)
        for part in name.split("."):
            value = getattr(value, part)
        return value

    def _getattr(self, target, name: str):
        return getattr(target, name)

    def _hasattr(self, target, name: str) -> bool:
        return hasattr(target, name)

    def _deref(self, target):
        return target

    def _reset(self, target) -> None:
        """Forgets the host's objects and sources: the manager that used them closed."""
        self.objects.clear()
        self._names.clear()
        for name in self.sources.sources:
            sys.modules.pop(name, None)
        self.sources.sources = {}
        self.torch_settings = None

    def apply_torch_settings(self) -> None:
        """Gives the calling thread the manager's torch settings, once torch is imported
        and until they change.  A few attribute reads when there is nothing to do."""
        settings = self.torch_settings
        if settings is None or _multipy_bootstrap.thread_torch() is settings:
            return
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "set_grad_enabled"):  # not (yet) imported
            return
        threads, grad, streams = settings
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        if streams:
            self._use_stream(torch.cuda)
        _multipy_bootstrap.set_thread_torch(settings)

    def _use_stream(self, cuda: Any) -> None:
        """Makes this interpreter's CUDA stream on the current device the calling thread's
        current stream, if CUDA has started here and the thread still has the default
        stream (a stream the thread chose stays); before CUDA starts, arranges for every
        thread to come back here once it has.  The stream first waits for the work the
        thread queued on the default stream."""
        if not cuda.is_initialized():
            lazy_call = getattr(cuda, "_lazy_call", None)  # torch's hook for CUDA's start
            if not self._awaiting_cuda and lazy_call is not None:
                self._awaiting_cuda = True
                lazy_call(self._cuda_started)
            return
        device = cuda.current_device()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda.Stream(device)
        current = cuda.current_stream(device)
        if current == cuda.default_stream(device):
            stream.wait_stream(current)
            cuda.set_stream(stream)

    def _cuda_started(self) -> None:
        """CUDA started in this interpreter: a settings object of a new identity makes
        every thread apply them again on its next call (apply_torch_settings)."""
        settings = self.torch_settings
        if settings is not None:
            self.torch_settings = settings[:2] + settings[2:]  # equal, not the same object

    # -- plumbing --

    def handle(self, op: int, handle: int, epoch: int, body: memoryview) -> tuple:
        """Runs one request (multipy._protocol): (status, new object handle or 0,
        payload).  The C entry applies the host's releases to the tables before, and
        sends back the host tokens that aliases here gave back after: a cancel's
        exception loses neither."""
        aliased: list[int] | None = []  # the host's tokens aliased until the request is read
        try:
            if op == CALL_TENSOR:  # the target's call with one lent tensor, its record
                token, address = LENT_TENSOR.unpack(body)
                args = (None, tuple(_sharing.alias_flat(((_sharing.TORCH, token, address),),
                                                        (0,), 0, aliased)), {})
                op = CALL_VALUE
            elif body[0] != _sharing.PICKLED:
                args = marshal.loads(body)
                if op == CALL_LENT:
                    method, values, positions, kwargs = args
                    args = (method, _sharing.alias_flat(values, positions, 0, aliased),
                            kwargs)
                    op = CALL_VALUE
            else:
                args = _Unpickler(body, self.objects, aliased).load()
            aliased = None
            if epoch != self.epoch:
                if op != RESET:  # a request of a manager that closed: refused
                    return CLOSED, 0, b""
                self.epoch = epoch
            target = None
            if handle:
                try:
                    target = self.objects[handle]
                except KeyError:
                    target = _object(self.objects, handle)  # raises what to say
            name = self._names.get(handle if op != GLOBAL else args)
            _multipy_bootstrap.note(_OP_TEXTS[op], name or self._crash_name(op, handle, args))
            if _multipy_bootstrap.thread_torch() is not self.torch_settings:  # (its first check)
                self.apply_torch_settings()
            if op == CALL:
                result = target(*args[0], **args[1])
            elif op == CALL_VALUE:
                method, call_args, kwargs = args
                result = (target if method is None else getattr(target, method))(*call_args,
                                                                                  **kwargs)
            else:
                result = self._ops[op](target, *args)
            if _sharing.cuda_aliases:  # CUDA tensors came in: the caller sees this call's writes
                _sharing.order_after_call()
            if _multipy_bootstrap.thread_torch() is not self.torch_settings:  # the call may
                self.apply_torch_settings()  # have imported torch
            if op in _NEW_OBJECT:
                number = next(self._ids)
                self.objects[number] = result
                return OK, number, b""
            return self.value_reply(result)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: they end a call, not the interpreter
            return self.failed(exc, None if aliased is None else tuple(aliased))

    def value_reply(self, result) -> tuple:
        """The reply that carries a call's result back as a value: (OK, 0, payload) with
        it plain or pickled, or (LENT, 0, payload) with its tensors and arrays lent.
        Whatever this raises, nothing stays lent."""
        if result is None:
            return OK, 0, _NONE
        payload = _sharing.plain(result)
        if payload is not None:
            return OK, 0, payload
        lent = _sharing.Lent(self.exports)
        try:
            flat = _sharing.lend_result(result, lent)
            if flat is not None and (payload := _sharing.plain(flat)) is not None:
                return LENT, 0, payload
            # not flat, or something in it met twice (pickle keeps it shared)
            lent.take_back()
            return OK, 0, _sharing.LendingPickler(lent).dumps(result)
        except BaseException:
            lent.take_back()
            raise

    def failed(self, exc: BaseException, aliased: tuple[int, ...] | None) -> tuple:
        """The ERROR reply for exc, raised by a request once read (aliased None) or
        while it was read (the host's tokens aliased so far); what the call wrote to
        CUDA aliases first ordered before the host's next use."""
        if _sharing.cuda_aliases:
            with contextlib.suppress(Exception):
                _sharing.order_after_call()
        return ERROR, 0, _error_record(exc, aliased)

    def _crash_name(self, op: int, handle: int, args: tuple) -> bytes:
        """The name of what a request acts on, for the fatal-signal report; made once
        per object (or import) and kept: the C report points at it."""
        try:
            text = f"{args[0]}.{args[1]}" if op == GLOBAL else _name(self.objects[handle])
        except Exception:  # user objects may answer attribute lookups in any way
            text = "an object"
        name = self._names[handle if op != GLOBAL else args] = text.encode(errors="replace")[:200]
        return name

    def register_source(self, name: str, source: str) -> None:
        """Makes source importable as module name; unimports only that module."""
        self.sources.sources[name] = source
        sys.modules.pop(name, None)
        importlib.invalidate_caches()


def _error_record(exc: BaseException, aliased: tuple[int, ...] | None) -> bytes:
    """An ERROR reply's payload: the RemoteError for exc (see its ``aliased``), by marshal."""
    try:
        kind = type(exc)
        try:
            text = _user_traceback(exc)
        except Exception:  # the plain traceback, rather than none
            text = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
        pickled = None
        if isinstance(exc, Exception):  # BaseExceptions such as SystemExit must not act in the host
            try:
                pickled = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
                pickle.loads(pickled)
            except BaseException:
                pickled = None
        record = _protocol.RemoteError(pickled, f"{kind.__module__}.{kind.__qualname__}",
                                       str(exc), text, aliased)
    except BaseException:  # the exception cannot even be described (a broken __str__)
        record = _protocol.RemoteError(None, "multipy.InterpreterError", "an exception was "
                                       "raised inside the interpreter, and describing it "
                                       "failed too", "", aliased)
    payload = _sharing.plain(tuple(record))
    if payload is None:  # a str subclass from a __str__, say: plain text instead
        payload = _sharing.plain((record.pickled, str.__str__(record.type_name),
                                  str.__str__(record.message), str.__str__(record.traceback),
                                  aliased))
    return payload


#: multipy's own files (the handler, _inside, _sharing): no frame of theirs is shown
_OWN_FILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
#: the import machinery, whose frames lead to a module that global_ imports
_IMPORT_FILES = (importlib.__file__, "<frozen importlib._bootstrap")


def _user_traceback(exc: BaseException) -> str:
    """exc's traceback as Python prints it, less multipy's own frames and the import
    machinery's frames that come before the user's first frame, with the source lines of
    registered modules (and torch.package modules: linecache reads those lazily)."""
    if _current is not None:
        _current.sources.show_lines()
    described = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    pending, seen = [described], set()
    while pending:
        each = pending.pop()
        if each is None or id(each) in seen:
            continue
        seen.add(id(each))
        frames = [frame for frame in each.stack if not frame.filename.startswith(_OWN_FILES)]
        while frames and frames[0].filename.startswith(_IMPORT_FILES):
            frames.pop(0)
        each.stack = traceback.StackSummary.from_list(frames)
        pending += [each.__cause__, each.__context__, *(getattr(each, "exceptions", None) or ())]
    return "".join(described.format())


_current: _Interpreter | None = None


def stats() -> dict[str, int]:
    """What this interpreter holds for the host: objects behind handles, and tensors and
    arrays lent to the host."""
    return {"objects": len(_current.objects), "lent": len(_current.exports)}


def set_torch_settings(threads: int, grad_enabled: bool, cuda_streams: bool = True) -> None:
    """The intra-op threads, grad mode and CUDA stream (this interpreter's own, or the
    default stream) every thread runs torch with here, from its next call on (see
    _Interpreter.apply_torch_settings)."""
    _current.torch_settings = (threads, grad_enabled, cuda_streams)


def torch_settings() -> dict | None:
    """What the calling thread runs torch with here (None before torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    settings = {"threads": torch.get_num_threads(), "grad_enabled": torch.is_grad_enabled()}
    if torch.cuda.is_initialized():
        settings["cuda_stream"] = torch.cuda.current_stream().cuda_stream
    return settings


def register_source(name: str, source: str) -> None:
    """See _Interpreter.register_source."""
    _current.register_source(name, source)


def thread_states() -> int:
    """How many thread states this interpreter has: its own thread's, and one for each
    host thread that entered it and has not exited."""
    return _multipy_bootstrap.thread_states()


def pthread_keys_in_use() -> int:
    """How many pthread keys this interpreter's libraries hold, of the 1,024 it may
    (docs/design.md, "pthread keys")."""
    return _multipy_bootstrap.keys_in_use()


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


def main(status_fd: int, host_main: tuple[str, str | None] | None = None) -> tuple:
    """Sets this interpreter up; returns the handler the C entry calls, the tables
    where the C entry applies releases (handles, lent tokens, names), and what its fast
    path reads (None with MULTIPY_CALL_PATH=python).  host_main: the
    host's main script, (path, module name if run with -m), if it has one.  On failure
    the traceback goes to status_fd, where the host reads why the interpreter did not
    start."""
    try:
        _strip_rtld_global()
        global _current, _host_main
        _host_main = host_main
        _current = _Interpreter()
        fast_path = None
        if _protocol.C_CALL_PATH:  # what the C fast path reads (_bootstrap.c, fast_call)
            fast_path = (_current, _current.exports.counter, _sharing)
        return (_current.handle, _current.objects, _current.exports.objects, _current._names,
                fast_path)
    except BaseException:
        os.write(status_fd, traceback.format_exc().encode())
        raise
