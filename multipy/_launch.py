"""Room for interpreters: how ``multipy run`` and ``make_room()`` start a program with the
glibc tunables that let a process hold 15 interpreters.

``multipy run`` execs ``python -m multipy._launch (SCRIPT | -m MODULE | -c CODE) ARGS``
with them in the environment; ``make_room()`` re-executes the running program once with
them.  glibc reads them only when the process starts, so once it has, ``os.environ``
gets the user's own GLIBC_TUNABLES back (or none): the program's child processes
inherit what the user gave, not multipy's reserve.  Standard library only.
"""
from __future__ import annotations

import os
import runpy
import sys
import types
import warnings

#: Extra static TLS for libraries with initial-exec TLS beyond what nns=16 reserves.
#: 15 interpreters with torch and numpy fit with glibc's default 512 bytes once nns is
#: 16 (measured: docs/design.md, "Static TLS"); 16 KiB leaves room for other libraries
#: and costs every thread's stack only that.
LAUNCH_STATIC_TLS = 16 << 10
LAUNCH_TUNABLES = f"glibc.rtld.nns=16:glibc.rtld.optional_static_tls={LAUNCH_STATIC_TLS}"

#: Where the launch keeps the user's GLIBC_TUNABLES: "=value", or "" for none.
SAVED = "MULTIPY_USER_GLIBC_TUNABLES"


def environment_at_start() -> list[str]:
    """The NAME=VALUE entries of the environment this process was exec'd with (where
    glibc read its own variables), from /proc/self/environ; os.environ's where that
    cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return [f"{k}={v}" for k, v in os.environ.items()]


def tunables_at_start() -> dict[str, str]:
    """glibc tunables this process was started with (glibc reads them only at exec time).

    Read from the environment as exec'd (``environment_at_start``): glibc parses
    GLIBC_TUNABLES in place there, leaving a NUL where each ':' was.
    """
    items: list[str] = []
    for entry in environment_at_start():
        if entry.startswith("GLIBC_TUNABLES="):
            items = entry[len("GLIBC_TUNABLES="):].split(":")
        elif items and entry.startswith("glibc."):
            items += entry.split(":")
        elif items:
            break
    return dict(item.partition("=")[::2] for item in items if item)


def launch_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of environ whose GLIBC_TUNABLES lets a process hold 15 interpreters
    (other tunables already set are kept), with the user's own value saved for
    restore_environment to put back once the program has started."""
    env = dict(os.environ if environ is None else environ)
    original = env.get("GLIBC_TUNABLES")
    wanted = dict(item.split("=", 1) for item in LAUNCH_TUNABLES.split(":"))
    kept = [item for item in (original or "").split(":")
            if item and item.split("=", 1)[0] not in wanted]
    env["GLIBC_TUNABLES"] = ":".join(kept + [f"{k}={v}" for k, v in wanted.items()])
    env[SAVED] = "" if original is None else f"={original}"
    return env


def has_room() -> bool:
    """Whether this process started with at least the room that LAUNCH_TUNABLES makes."""
    started = tunables_at_start()
    for name, value in (item.split("=", 1) for item in LAUNCH_TUNABLES.split(":")):
        try:
            if int(started.get(name, "0"), 0) < int(value):
                return False
        except ValueError:
            return False
    return True


def make_room() -> None:
    """Gives this program room for 15 interpreters: if it did not start with it, re-executes
    it at once (``os.execv``, the same Python and command line, ``sys.orig_argv``) with the
    glibc tunables that make it, and does not return; otherwise returns at once.

    For programs that ``multipy run`` does not start (uvicorn, gunicorn, a service
    manager): call it first thing in the main module, before any thread or interpreter
    starts, since whatever ran before runs again.  Warns and returns if glibc ignored
    the tunables (a set-user-ID program, say), rather than loop.
    """
    if has_room():
        restore_environment()
        return
    if SAVED in os.environ:  # already re-executed once, and the tunables did not take
        restore_environment()
        warnings.warn("multipy.make_room(): this process started without the glibc tunables "
                      "it was given; it has glibc's default room for interpreters",
                      RuntimeWarning, stacklevel=2)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, launch_environment())


def restore_environment() -> None:
    saved = os.environ.pop(SAVED, None)
    if saved is None:
        return
    if saved.startswith("="):
        os.environ["GLIBC_TUNABLES"] = saved[1:]
    else:
        os.environ.pop("GLIBC_TUNABLES", None)


def main() -> None:
    """Runs the program that follows, SCRIPT, -m MODULE or -c CODE, then its arguments,
    as python does."""
    restore_environment()
    arguments = sys.argv[1:]
    if arguments[:1] == ["-m"]:
        sys.argv = arguments[1:]  # run_module sets argv[0] to the module's path
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    elif arguments[:1] == ["-c"]:
        sys.argv = ["-c", *arguments[2:]]
        sys.path[0] = ""  # as `python -c`: the current directory
        sys.modules["__main__"] = program = types.ModuleType("__main__")
        exec(compile(arguments[1], "<string>", "exec"), program.__dict__)
    else:
        sys.argv = arguments
        sys.path[0] = os.path.dirname(os.path.abspath(arguments[0]))  # as `python SCRIPT`
        runpy.run_path(arguments[0], run_name="__main__")


if __name__ == "__main__":
    main()
