"""Exceptions that multipy raises in the host."""
from __future__ import annotations


class MultipyError(Exception):
    """Base class of multipy's own errors."""


class UnsupportedPythonError(MultipyError):
    """The running CPython cannot host interpreters (no shared libpython, wrong platform)."""


class InterpreterLimitError(MultipyError):
    """More interpreters were asked for than this process can hold."""


class InterpreterStartError(MultipyError):
    """An interpreter failed to start; the message carries what it reported."""


class InterpreterClosedError(MultipyError):
    """The interpreter, or the manager an object came from, is closed or shutting down."""


class WrongInterpreterError(MultipyError):
    """An object was used in an interpreter that does not own it."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised inside an interpreter; set as the __cause__
    of the exception the host raises, so that it is printed with it (as
    concurrent.futures does for a worker process's exceptions).

    ``traceback_text`` holds only the user's frames: multipy's own code inside, and the
    import machinery that leads to a module, are left out.
    """

    def __init__(self, traceback_text: str):
        super().__init__(traceback_text)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        text = self.traceback_text.strip("\n")
        if not text:
            return ("the exception below was raised inside an interpreter (its traceback "
                    "there could not be described)")
        return "the exception below was raised inside an interpreter:\n\n" + text


class InterpreterError(MultipyError):
    """An exception raised inside an interpreter whose type the host cannot re-create
    (or one, such as SystemExit, that must not act in the host).

    ``type_name`` is its qualified type name and ``remote_traceback`` its traceback text.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
