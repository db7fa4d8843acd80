"""multipy: many isolated CPython interpreters in one process, each with its own GIL.

Each interpreter is a stock CPython loaded into its own glibc link-map namespace; host
threads enter it directly to run calls (docs/design.md).  See README.md.

The public names load on first use, so that the code inside each interpreter, which
lives in this package too, does not import the host's API.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Environment": "environment", "NoopEnvironment": "environment",
    "PathEnvironment": "environment",
    "InterpreterClosedError": "errors", "InterpreterError": "errors",
    "InterpreterLimitError": "errors", "InterpreterStartError": "errors",
    "MultipyError": "errors", "RemoteTraceback": "errors",
    "UnsupportedPythonError": "errors", "WrongInterpreterError": "errors",
    "Interpreter": "session", "InterpreterSession": "session", "Obj": "session",
    "timeout": "session",
    "InterpreterManager": "manager",
    "Package": "package",
    "PythonMethodWrapper": "replicated", "ReplicatedObj": "replicated",
    "make_room": "_launch", "set_exit_timeout": "_pool",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'multipy' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
