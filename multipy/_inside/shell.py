"""The inside half of ``multipy shell``: a namespace in this interpreter where the host's
prompt runs statements, and where ``-c CODE`` or a script runs.

The host reads the lines (multipy/shell.py) and sends each complete block here; it is
compiled and run here by the standard library's ``code.InteractiveInterpreter``, which
prints results (``sys.displayhook``) and tracebacks to this interpreter's own
``sys.stdout`` and ``sys.stderr``: the process's file descriptors 1 and 2, which every
interpreter shares.  Standard library only.
"""
from __future__ import annotations

import builtins
import code
import rlcompleter
import sys
import types
from typing import Any


def exit_status(exc: SystemExit) -> int:
    """The process exit status that Python gives SystemExit(code): 0 for None, the code
    if it is an int, else 1 after printing it to stderr."""
    status = exc.code
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    try:
        print(status, file=sys.stderr)
    except Exception:
        pass
    return 1


def _starts_interpreters(exc: BaseException) -> bool:
    """Whether exc is what the program's own multipy raised as the program asked for
    interpreters, which no code inside one can start.  Looked up, not imported: this
    interpreter holds multipy's host API only if the program imported it."""
    errors = sys.modules.get("multipy.errors")
    return errors is not None and isinstance(exc, errors.InterpreterStartError)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream: nothing to flush
            pass


class Console:
    """The shell's state in this interpreter: a ``__main__`` module holding the bound
    names, installed as ``sys.modules["__main__"]`` (so that what is defined at the
    prompt pickles as it does in a plain Python) until ``close()``."""

    def __init__(self, names: dict[str, Any], argv: list[str], path0: str | None) -> None:
        self.main = types.ModuleType("__main__")
        self.main.__dict__.update({"__builtins__": builtins, **names})
        self._saved = (sys.modules.get("__main__"), list(sys.argv), list(sys.path))
        sys.modules["__main__"] = self.main
        sys.argv[:] = argv
        if path0 is not None:  # as python does: the script's folder, or '' for the cwd
            sys.path.insert(0, path0)
        self.interpreter = code.InteractiveInterpreter(self.main.__dict__)
        self.completer = rlcompleter.Completer(self.main.__dict__)
        #: the serial number of the last block that ran to its end here
        self.finished = 0

    def runsource(self, source: str, filename: str, symbol: str,
                  serial: int) -> tuple[bool, int | None]:
        """Compiles and runs one block as Python's prompt does: (more, exit): more if
        the block is incomplete (nothing ran), exit the status to leave with if it
        raised SystemExit, else None.  Errors, Ctrl-C's KeyboardInterrupt too, are
        printed here and end only the block."""
        try:
            more = self.interpreter.runsource(source, filename, symbol)
            return more, None
        except SystemExit as exc:
            return False, exit_status(exc)
        finally:
            _flush()
            self.finished = serial

    def ran(self, serial: int) -> bool:
        """Whether block ``serial`` ran to its end here (so whatever stopped it printed
        its own traceback)."""
        return self.finished == serial

    def run(self, source: str | bytes, filename: str) -> int:
        """Runs a program (``-c`` code or a script's contents) in the namespace, as
        ``python -c`` or ``python FILE`` would: the exit status (SystemExit's, 1 after
        printing the traceback of an uncaught exception, 130 after Ctrl-C's).  Raises,
        unprinted, the error of a program that starts interpreters, for the host to
        say what to run instead."""
        try:
            try:
                compiled = compile(source, filename, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:  # ValueError: a NUL in the source
                exc.__traceback__ = None  # as python shows it: no frame, the line
                sys.excepthook(type(exc), exc, None)
                return 1
            if filename != "<string>":  # a script
                self.main.__file__ = filename
            exec(compiled, self.main.__dict__)
            return 0
        except SystemExit as exc:
            return exit_status(exc)
        except BaseException as exc:  # noqa: B036 - printed as python prints it
            if _starts_interpreters(exc):
                raise
            tb = exc.__traceback__
            # this frame is not the user's (the excepthook prints the exception's own)
            exc.__traceback__ = tb = tb.tb_next if tb is not None else None
            sys.excepthook(type(exc), exc, tb)
            return 130 if isinstance(exc, KeyboardInterrupt) else 1
        finally:
            _flush()

    def complete(self, text: str, state: int) -> str | None:
        """The prompt's tab completion, over this namespace."""
        try:
            return self.completer.complete(text, state)
        except Exception:
            return None

    def close(self) -> None:
        """Puts back what the shell changed: ``__main__``, ``sys.argv``, ``sys.path``."""
        main, argv, path = self._saved
        if main is not None:
            sys.modules["__main__"] = main
        sys.argv[:] = argv
        sys.path[:] = path
        _flush()
