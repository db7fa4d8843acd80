"""How ``multipy run`` starts a program: ``python -m multipy._launch (SCRIPT | -m MODULE)
ARGS``, with the glibc tunables that make room for interpreters in the environment.

glibc reads them only when the process starts, so once it has, ``os.environ`` gets the
user's own GLIBC_TUNABLES back (or none): the program's child processes inherit what
the user gave, not multipy's reserve.  Standard library only.
"""
from __future__ import annotations

import os
import runpy
import sys

#: Where ``multipy run`` keeps the user's GLIBC_TUNABLES: "=value", or "" for none.
SAVED = "MULTIPY_USER_GLIBC_TUNABLES"


def restore_environment() -> None:
    saved = os.environ.pop(SAVED, None)
    if saved is None:
        return
    if saved.startswith("="):
        os.environ["GLIBC_TUNABLES"] = saved[1:]
    else:
        os.environ.pop("GLIBC_TUNABLES", None)


def main() -> None:
    restore_environment()
    arguments = sys.argv[1:]
    if arguments[:1] == ["-m"]:
        sys.argv = arguments[1:]  # run_module sets argv[0] to the module's path
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = arguments
        sys.path[0] = os.path.dirname(os.path.abspath(arguments[0]))  # as `python SCRIPT`
        runpy.run_path(arguments[0], run_name="__main__")


if __name__ == "__main__":
    main()
