"""Start-up progress: one log line per stage, and rich's progress bar on the terminal.

The bar is drawn on stderr only when stderr is a terminal; in a log file or a pipe there
are only the stage lines, which say the same thing.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _Bar


class Progress:
    """Counts done steps out of ``total``; ``stage(text)`` logs a line, ``advance(n,
    what)`` moves the bar.  Safe from several threads."""

    def __init__(self, total: int, logger: logging.Logger, stream: TextIO | None = None) -> None:
        console = Console(file=sys.stderr if stream is None else stream)
        self._logger = logger
        self._lock = threading.Lock()
        self._bar = _Bar(BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         TextColumn("{task.description}"), console=console, transient=True,
                         redirect_stdout=False, redirect_stderr=False,
                         disable=not console.is_terminal)
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
