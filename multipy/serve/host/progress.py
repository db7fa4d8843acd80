"""Start-up progress: one log line per stage, and rich's progress bar on the terminal.

The bar is drawn on stderr only when stderr is a terminal (rich is imported only then);
in a log file or a pipe there are only the stage lines, which say the same thing.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, TextIO


class Progress:
    """Counts done steps out of ``total``; ``stage(text)`` logs a line, ``advance(n,
    what)`` moves the bar.  Safe from several threads."""

    def __init__(self, total: int, logger: logging.Logger, stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self._logger = logger
        self._lock = threading.Lock()
        self._bar = _bar(stream) if stream.isatty() else _NoBar()
        self._task = self._bar.add_task("", total=max(total, 1))
        self._bar.start()

    def stage(self, text: str) -> None:
        """Logs one line for a start-up stage, with the bar taken off the terminal while
        the line is written (the log handler writes to stderr itself)."""
        with self._lock:
            self._bar.stop()
            self._logger.info(text)
            self._bar.start()

    def advance(self, steps: int = 1, what: str = "") -> None:
        with self._lock:
            self._bar.update(self._task, advance=steps, **({"description": what} if what else {}))

    def close(self) -> None:
        """Takes the bar off the terminal."""
        with self._lock:
            self._bar.stop()


def _bar(stream: TextIO) -> Any:
    """rich's progress bar, drawn on stream (a terminal)."""
    from rich.console import Console  # (rich, 2.5 MiB, only where a bar is drawn)
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    return Bar(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"), console=Console(file=stream),
               transient=True, redirect_stdout=False, redirect_stderr=False)


class _NoBar:
    """A progress bar's calls that Progress makes, drawing nothing."""

    def add_task(self, description: str, total: int) -> int:
        return 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update(self, task: int, **changes: object) -> None:
        pass
