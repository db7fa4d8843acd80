"""multipy: many isolated CPython interpreters in one process, each with its own GIL.

Each interpreter is a stock CPython loaded into its own glibc link-map namespace and
run by its own thread; host threads drive it through a channel.  See README.md.
"""
from .environment import Environment, NoopEnvironment, PathEnvironment
from .errors import (InterpreterClosedError, InterpreterError, InterpreterLimitError,
                     InterpreterStartError, MultipyError, RemoteTraceback,
                     UnsupportedPythonError, WrongInterpreterError)
from .interpreter import Interpreter, timeout
from .manager import InterpreterManager
from .package import Package
from .replicated import PythonMethodWrapper, ReplicatedObj
from .session import InterpreterSession, Obj

__all__ = [
    "Environment", "Interpreter", "InterpreterClosedError", "InterpreterError",
    "InterpreterLimitError", "InterpreterManager", "InterpreterSession",
    "InterpreterStartError", "MultipyError", "NoopEnvironment", "Obj", "Package",
    "PathEnvironment", "PythonMethodWrapper", "RemoteTraceback", "ReplicatedObj",
    "UnsupportedPythonError", "WrongInterpreterError", "timeout",
]
__version__ = "0.1.0"
