"""Environments: where the interpreters of a manager find modules that are not packaged."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import InterpreterSession


class Environment:
    """Base class: configures each interpreter a manager uses.

    Subclass it and override ``configure`` (and ``unconfigure`` to undo it when the
    manager closes, since interpreters outlive managers).  Both run in the host, with a
    session on the interpreter; use ``session.global_`` to act inside it.
    """

    def configure(self, session: InterpreterSession) -> None:
        """Called once per interpreter when a manager starts using it."""

    def unconfigure(self, session: InterpreterSession) -> None:
        """Called once per interpreter when the manager closes."""


class NoopEnvironment(Environment):
    """The interpreters see the host's own environment (its sys.path at start-up)."""


class PathEnvironment(Environment):
    """Adds directories (for example a site-packages with extern modules) at the front
    of ``sys.path`` in every interpreter."""

    def __init__(self, *paths: str | os.PathLike) -> None:
        self.paths = [os.path.abspath(os.fspath(p)) for p in paths]

    def configure(self, session: InterpreterSession) -> None:
        insert = session.global_("sys", "path.insert")
        for path in reversed(self.paths):
            insert(0, path)
        session.global_("importlib", "invalidate_caches")()

    def unconfigure(self, session: InterpreterSession) -> None:
        """Removes the paths, and unimports the modules that came from them."""
        session.global_("multipy._inside", "forget_paths")(self.paths)

    def __repr__(self) -> str:
        return f"PathEnvironment({', '.join(map(repr, self.paths))})"
