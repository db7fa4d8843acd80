"""The host side of multipy's C++ API (multipy/cpp, docs/cpp.md): the few helpers that
the C++ library calls in the CPython it embeds; the rest of it drives the public API."""
from __future__ import annotations

import traceback

from .environment import PathEnvironment
from .manager import InterpreterManager


def make_manager(n_interpreters: int, paths: list[str]) -> InterpreterManager:
    """The manager of multipy::runtime::InterpreterManager(n, env)."""
    return InterpreterManager(n_interpreters, PathEnvironment(*paths) if paths else None)


def describe(error: BaseException) -> str:
    """The message of the c10::Error that error becomes in C++: the exception, with the
    traceback inside the interpreter (its cause) and the host's."""
    return "".join(traceback.format_exception(error)).rstrip("\n")


def from_value(session, value):
    """value (a host value) made an object of session's interpreter."""
    return session.global_("builtins", "eval")("value", {"value": value})


def at_exit() -> None:
    """Run by the C++ library as the program exits (it never finalises the host): the
    host's atexit hooks, as Py_Finalize would run them; multipy's stops the interpreters
    (docs/design.md, "exit")."""
    import atexit

    atexit._run_exitfuncs()
