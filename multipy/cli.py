"""The ``multipy`` command: ``run`` a program with room for 15 interpreters, ``info``,
``bench``, ``serve`` (each of the last two runs its program through ``run``'s launcher,
and imports nothing of it here)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from pathlib import Path

from . import _cuda, _glibc
from ._launch import launch_environment


def _run(target: list[str], args: list[str], environment: dict[str, str] | None = None) -> None:
    """Execs this Python on the launcher, which runs target (SCRIPT, -m MODULE or
    -c CODE) with args as python would, with room for 15 interpreters and environment's
    variables added."""
    argv = [sys.executable, "-m", "multipy._launch", *target, *args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, {**launch_environment(), **(environment or {})})


def _run_options(run: argparse.ArgumentParser, argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """The options of ``multipy run`` that come before its program (--exit-timeout
    SECONDS), as the variables they set in the program's environment, and what follows
    them; exits through run.error if one is wrong."""
    from ._pool import EXIT_TIMEOUT_VARIABLE, exit_seconds

    environment: dict[str, str] = {}
    argv = list(argv)
    while argv and argv[0].partition("=")[0] == "--exit-timeout":
        _, equals, value = argv.pop(0).partition("=")
        if not equals:
            if not argv:
                run.error("argument --exit-timeout: expected one argument")
            value = argv.pop(0)
        try:
            environment[EXIT_TIMEOUT_VARIABLE] = str(exit_seconds(value, "--exit-timeout"))
        except ValueError as error:
            run.error(str(error))
    return environment, argv


#: What a command needs beyond multipy: (the extra that installs it, its modules).
_NEEDS = {"bench": ("bench", ("matplotlib", "rich")),
          "serve": ("serve", ("uvicorn", "starlette", "prometheus_client", "rich", "numpy"))}


def _require(command: str) -> None:
    """Exits with what to install if the command's extra, or torch, is missing."""
    extra, modules = _NEEDS[command]
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    problems = []
    if missing:
        problems.append(f"the {extra!r} extra, which installs {', '.join(missing)}: "
                        f"pip install 'multipy-interpreters[{extra}]' (from a checkout: "
                        f"pip install -e '.[{extra}]')")
    if importlib.util.find_spec("torch") is None:
        problems.append("torch, which multipy does not install: pip install torch")
    if problems:
        sys.exit(f"multipy {command} needs " + "; and ".join(problems))


def _bench_script() -> str:
    """benchmarks/bench.py of the source checkout this package lives in."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.is_file():
        sys.exit(f"multipy bench: {script} not found; the benchmark is part of the source "
                 f"checkout, not of the installed package (pip install -e a checkout)")
    return str(script)


def _info() -> None:
    from ._pool import capacity
    from .manager import cores, default_torch_threads

    tunables = _glibc.tunables_at_start()
    try:
        libpython = _glibc.libpython_path()
    except Exception as error:  # reported, not raised: info is for diagnosing exactly this
        libpython = f"unavailable ({error})"
    fits = capacity()
    print(f"python:       {platform.python_implementation()} {platform.python_version()} "
          f"({sys.executable})")
    print(f"libpython:    {libpython}")
    print(f"glibc:        {_glibc.glibc_version()}")
    print("tunables:     " + (":".join(f"{k}={v}" for k, v in tunables.items()) or "glibc's defaults"))
    print(f"interpreters: {fits['more']} fit in this process (at most {_glibc.MAX_NAMESPACES}), "
          f"about {_glibc.torch_interpreters_that_fit()} that import torch")
    room = _glibc.static_tls_room()
    print("static TLS:   " + (f"{room[0]} bytes free, {room[1]} for each bare interpreter's "
                              f"libraries (glibc's report)" if room else "glibc does not say"))
    if fits["more"] < _glibc.MAX_NAMESPACES:
        print(f"              `multipy run SCRIPT`, or multipy.make_room() first thing in the "
              f"program, gives room for {_glibc.MAX_NAMESPACES}")
    print(f"torch:        each interpreter of a manager of n runs torch with max(1, {cores()} cores "
          f"// n) intra-op threads ({default_torch_threads(2)} for n=2) and grad mode on, "
          f"unless InterpreterManager(torch_threads=, grad_enabled=) says otherwise")
    keys = _glibc.process_keys()
    print("pthread keys: " + (f"{keys[0]} of the process's {keys[1]} in use, {keys[1] - keys[0]} free"
                              if keys else "unknown (this glibc does not describe its table)")
          + "; multipy takes one for threads' exit and one per interpreter, over which each "
            "interpreter keeps its libraries' own keys (up to 1024 in each)")
    print(f"CUDA driver:  {_cuda.describe()}")
    print(f"memory:       {_torch_memory()}")


#: Private memory of one more interpreter importing torch and numpy, by torch build, as
#: benchmarks/interpreter_memory.py measured it (docs/log/micro.md, "Memory of one more
#: interpreter"): CPython 3.11, torch 2.13.0 (CPU wheel) and 2.14.1 (PyPI's CUDA build),
#: the latter with its cuBLASLt, NVRTC and nvJitLink kept once per process (docs/design.md,
#: "One copy per process") and with a copy of each in each interpreter.
_TORCH_MIB = {"cpu": 136, "cuda": 171, "cuda, copies in each": 273}


def _torch_memory() -> str:
    """One line for ``multipy info``: what one more interpreter importing the installed
    torch costs, estimated from the build (CPU or CUDA) without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "torch is not installed: a bare interpreter costs about 9 MiB private"
    library = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not any(library.glob("libtorch_cuda*.so")):
        build, note = "cpu", ""
    elif kept := sorted(os.path.basename(path) for path, _ in _cuda.forwarded_libraries()):
        build, note = "cuda", f"; {', '.join(kept)} kept once per process"
    else:
        build, note = "cuda, copies in each", ("; each interpreter loads its own CUDA libraries "
                                                "(docs/design.md, \"One copy per process\")")
    return (f"one more interpreter that imports torch costs about {_TORCH_MIB[build]} MiB "
            f"of private memory with this {'CPU' if build == 'cpu' else 'CUDA'} build of "
            f"torch{note} (measured with torch 2.13/2.14; `multipy run "
            f"benchmarks/interpreter_memory.py` measures it here)")


def _cmake_prefix() -> None:
    """Prints where find_package(multipy) and find_package(Torch) look: multipy's
    multipyConfig.cmake, and torch.utils.cmake_prefix_path (found without importing
    torch); exits with advice if torch is missing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("multipy cmake-prefix: multipy's C++ API needs torch, which multipy does "
                 "not install: pip install torch")
    torch_prefix = os.path.join(list(spec.submodule_search_locations)[0], "share", "cmake")
    print(f"{Path(__file__).resolve().parent / 'cpp'};{torch_prefix}")


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``multipy`` command's parser, and its ``run`` command's (whose options come
    before the program's own); the reference of the documentation is made from them."""
    parser = argparse.ArgumentParser(
        prog="multipy", description="Many isolated CPython interpreters in one process.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="run a Python program with room for 15 interpreters",
        description=f"Execs this Python on the program with GLIBC_TUNABLES set to "
                    f"{_glibc.LAUNCH_TUNABLES}, which glibc reads only when a process starts.")
    run.add_argument("--exit-timeout", metavar="SECONDS",
                     help="how long the interpreters get to finalise at exit, which waits for "
                          "the threads started inside that are not daemons (default 30; inf: "
                          "no limit); then the process leaves without finalising them.  Sets "
                          "MULTIPY_EXIT_TIMEOUT for the program")
    run.add_argument("-m", dest="module", help="run a library module as a script, as python -m")
    run.add_argument("-c", dest="code", help="run the program CODE, as python -c")
    run.add_argument("script", nargs="?", help="the program's path")
    run.add_argument("args", nargs="*", help="the program's arguments, passed on untouched")
    commands.add_parser("info", help="what this Python and glibc allow")
    commands.add_parser("bench", help="run benchmarks/bench.py of the source checkout with room "
                                      "for 15 interpreters (options: multipy bench --help)")
    commands.add_parser("serve", help="serve torch.package models over HTTP with the Open "
                                      "Inference Protocol (options: multipy serve --help)")
    commands.add_parser("shell", help="a Python prompt (or -c CODE, or a script) inside an "
                                      "interpreter, with a torch.package's importer and model "
                                      "bound (options: multipy shell --help)")
    commands.add_parser("cmake-prefix", help="print the CMake prefixes of multipy's C++ API "
                                             "and of torch, ';'-separated, for "
                                             "-DCMAKE_PREFIX_PATH (docs/cpp.md)")
    return parser, run


def main(argv: list[str] | None = None) -> None:
    parser, run = parsers()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        environment, program = _run_options(run, argv[1:])
        if len(program) > 1 and program[0] in ("-m", "-c"):
            # Everything after the module, code or script belongs to the program, options too.
            _run(program[:2], program[2:], environment)
        if program and program[0] not in ("-h", "--help", "-m", "-c"):
            if not os.path.exists(program[0]):
                run.exit(2, f"multipy run: can't open file {os.path.abspath(program[0])!r}: no "
                            f"such file (give the program's path, or -m MODULE, or -c CODE)\n")
            _run(program[:1], program[1:], environment)
    if argv[:1] == ["bench"]:  # every argument, --help too, belongs to the benchmark
        _require("bench")
        _run([_bench_script()], argv[1:])
    if argv[:1] == ["serve"]:  # every argument, --help too, belongs to the server
        _require("serve")
        _run(["-m", "multipy.serve"], argv[1:])
    if argv[:1] == ["shell"]:  # every argument, --help too, belongs to the shell
        _run(["-m", "multipy.shell"], argv[1:])
    args = parser.parse_args(argv)
    if args.command == "run":
        run.error("a script, -m MODULE or -c CODE is required")
    if args.command == "cmake-prefix":
        _cmake_prefix()
        return
    try:
        _info()
        sys.stdout.flush()
    except BrokenPipeError:  # `multipy info | head`: its reader stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (for exit's flush)
        sys.exit(1)
