"""``multipy shell [PATH] [-c CODE | FILE [ARGS]]``: a Python prompt, or a program, run
inside interpreter 0 of a manager, to look at a package the way it will be served.

The prompt is the standard library's ``code.InteractiveConsole`` on the host: it reads
lines (with readline on a terminal) and sends each complete block to
multipy._inside.shell, which compiles and runs it in a namespace that lives in the
interpreter and prints what Python's prompt prints (results, tracebacks) to the
process's stdout and stderr, which the interpreters share.  A running block is an
ordinary call on the main thread, so Ctrl-C raises KeyboardInterrupt in it and the
prompt goes on.  With PATH, a torch.package archive, ``importer`` is bound to the
package's PackageImporter in that interpreter (the one ``Package`` makes for serving)
and ``model`` to the object at ``--module``/``--resource`` when the archive has it.

``multipy shell`` starts this module through multipy._launch, with room for 15
interpreters; ``python -m multipy.shell`` makes the room itself.
"""
from __future__ import annotations

import argparse
import code
import os
import platform
import sys
import traceback
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from .manager import InterpreterManager
    from .session import Interpreter, Obj

_INSIDE = "multipy._inside.shell"
_DEFAULT_MODULE, _DEFAULT_RESOURCE = "model", "model.pkl"
#: the options that take a value (the rest take none)
_VALUED = ("--interpreters", "--module", "--resource")


def parser() -> argparse.ArgumentParser:
    """The options of ``multipy shell``."""
    parser = argparse.ArgumentParser(
        prog="multipy shell", allow_abbrev=False,
        usage="multipy shell [-h] [-q] [--interpreters N] [--module M] [--resource R] "
              "[PATH] [-c CODE | FILE | -] [ARGS ...]",
        description="A Python prompt inside interpreter 0 of a manager of N interpreters "
                    "(or -c CODE, or the script FILE, run there with ARGS as sys.argv[1:]). "
                    "With PATH, a torch.package archive, `importer` is bound to its "
                    "PackageImporter in that interpreter and `model` to the object pickled "
                    "at --module/--resource, when the archive holds it.  Ctrl-D or exit() "
                    "leaves the prompt; Ctrl-C stops a running statement.  Exits with the "
                    "program's status (SystemExit's, 1 after an uncaught exception).",
        epilog="Everything after -c CODE or FILE belongs to the program, options too.")
    parser.add_argument("path", metavar="PATH", nargs="?",
                        help="a torch.package archive (a zip file) to bind `importer` and "
                             "`model` from")
    parser.add_argument("-c", dest="code", metavar="CODE",
                        help="run CODE (sys.argv is ['-c', *ARGS]) and exit with its status")
    parser.add_argument("file", metavar="FILE", nargs="?",
                        help="run this script (- reads it from stdin) and exit with its status")
    parser.add_argument("args", metavar="ARGS", nargs="*", help="the program's arguments")
    parser.add_argument("--interpreters", type=int, default=1, metavar="N",
                        help="how many interpreters the manager has (default 1); the shell "
                             "runs in interpreter 0, with the torch threads that a manager of "
                             "N gives each")
    parser.add_argument("--module", default=None, metavar="M",
                        help=f"the package of the object to bind to `model` (default "
                             f"{_DEFAULT_MODULE!r})")
    parser.add_argument("--resource", default=None, metavar="R",
                        help=f"its resource (default {_DEFAULT_RESOURCE!r})")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print no banner at the prompt")
    return parser


@dataclass
class Arguments:
    interpreters: int = 1
    path: str | None = None
    module: str | None = None  #: None: the default, and no error if the archive lacks it
    resource: str | None = None
    code: str | None = None
    file: str | None = None
    args: list[str] = field(default_factory=list)
    quiet: bool = False


def is_archive(name: str) -> bool:
    """Whether name is a zip file: PATH (a torch.package archive) rather than a script."""
    try:
        return os.path.isfile(name) and zipfile.is_zipfile(name)
    except OSError:
        return False


def parse_arguments(argv: list[str]) -> Arguments:
    """The shell's arguments.  Options come first; a first positional that is a zip file
    is PATH; then ``-c CODE`` or FILE, after which everything is the program's."""
    parse = parser()
    options: list[str] = []
    positionals: list[str] = []
    program: list[str] | None = None  # [-c, CODE, *args] or [FILE, *args]
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest = argv[i + 1:]
            if rest and not positionals and is_archive(rest[0]):
                positionals.append(rest.pop(0))
            program = rest or None
            break
        if arg == "-c" or (arg.startswith("-c") and not arg.startswith("--")):
            if arg == "-c" and i + 1 >= len(argv):
                parse.error("argument -c: expected one argument")
            program = (["-c", arg[2:], *argv[i + 1:]] if arg != "-c"
                       else ["-c", *argv[i + 1:]])
            break
        if arg.startswith("-") and arg != "-":
            options.append(arg)
            if arg in _VALUED:
                if i + 1 >= len(argv):
                    parse.error(f"argument {arg}: expected one argument")
                options.append(argv[i + 1])
                i += 1
        elif not positionals and is_archive(arg):
            positionals.append(arg)
        else:
            program = argv[i:]
            break
        i += 1
    parsed = parse.parse_args(options + positionals)
    result = Arguments(interpreters=parsed.interpreters, path=parsed.path, module=parsed.module,
                       resource=parsed.resource, quiet=parsed.quiet)
    if result.interpreters < 1:
        parse.error(f"--interpreters must be at least 1, not {result.interpreters}")
    if result.path is None and (result.module or result.resource):
        parse.error("--module and --resource need PATH, a torch.package archive")
    if program and program[0] == "-c":
        result.code, result.args = program[1], program[2:]
    elif program:
        result.file, result.args = program[0], program[1:]
    return result


def _fail(message: str, status: int = 1) -> NoReturn:
    print(f"multipy shell: {message}", file=sys.stderr)
    sys.exit(status)


def _bind(manager: InterpreterManager, interpreter: Interpreter,
          arguments: Arguments) -> tuple[dict[str, Obj], list[str]]:
    """The names to bind in the shell (importer, model) and a line about each for the
    banner.  Exits with a message if PATH cannot be opened or the --module/--resource
    asked for are not in it; a model that fails to load is reported, not bound."""
    if arguments.path is None:
        return {}, []
    try:
        package = manager.load_package(arguments.path)
    except ImportError as error:
        _fail(f"PATH needs torch, which does not import here: {error}")
    except (OSError, ValueError) as error:
        _fail(str(error))
    names = {"importer": package.importer(interpreter)}
    lines = [f"importer = the PackageImporter of {package.path} in this interpreter (the "
             f"one serving uses)"]
    module = arguments.module or _DEFAULT_MODULE
    resource = arguments.resource or _DEFAULT_RESOURCE
    explicit = arguments.module is not None or arguments.resource is not None
    try:
        package._record(module, resource)
    except FileNotFoundError as error:
        if explicit:
            _fail(str(error))
        lines.append(f"model: not bound, the archive has no {module}/{resource} (pass "
                     f"--module/--resource to name the object to bind)")
        return names, lines
    try:
        names["model"] = package.load_pickle(module, resource).instance(interpreter)
    except Exception:
        traceback.print_exc()
        lines.append(f"model: not bound, loading {module}/{resource} failed (above); "
                     f"importer.load_pickle({module!r}, {resource!r}) tries again")
        return names, lines
    kind = names["model"].attr("__class__")
    kind = f"{kind.attr('__module__').deref()}.{kind.attr('__qualname__').deref()}"
    lines.append(f"model = importer.load_pickle({module!r}, {resource!r}), as serving "
                 f"loads it: a {kind}")
    return names, lines


class Prompt(code.InteractiveConsole):
    """Python's prompt, reading on the host and running each block inside (see the
    module's docstring)."""

    def __init__(self, console: Obj) -> None:
        super().__init__(filename="<console>")
        self.console = console
        self.serial = 0
        self.terminal = sys.stdin.isatty() and sys.stdout.isatty()
        if self.terminal:
            try:
                import readline
            except ImportError:  # line editing is a comfort, not a need
                pass
            else:
                readline.set_completer(self._complete)
                readline.parse_and_bind("tab: complete")

    def runsource(self, source: str, filename: str = "<console>", symbol: str = "single") -> bool:
        self.serial += 1
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            more, status = self.console.call_value("runsource",
                                                   (source, filename, symbol, self.serial))
        except KeyboardInterrupt:
            # Ctrl-C: the block printed KeyboardInterrupt's traceback if it ran to its
            # end inside; if the interrupt came before or after it, say so here.
            if not self.console.call_value("ran", (self.serial,)):
                self.write("KeyboardInterrupt\n")
            return False
        if status is not None:
            raise SystemExit(status)
        return more

    def raw_input(self, prompt: str = "") -> str:
        if self.terminal:
            return input(prompt)
        # Not a terminal: the prompt goes to stderr, as Python's own prompt does, so
        # that stdout holds only what the code printed.
        sys.stderr.write(prompt)
        sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line[:-1] if line.endswith("\n") else line

    def _complete(self, text: str, state: int) -> str | None:
        try:
            return self.console.call_value("complete", (text, state))
        except Exception:
            return None


def banner(manager: InterpreterManager, interpreter: Interpreter, lines: list[str]) -> str:
    """What the prompt says first: where it runs, what is bound (lines), how to leave."""
    ordinal = interpreter._runtime.ordinal
    text = [f"Python {platform.python_version()} on {sys.platform}, multipy shell: this prompt "
            f"runs inside interpreter {interpreter.index} of a manager of {len(manager)} "
            f"(#{ordinal} of this process)"]
    text += lines
    text.append("Ctrl-D or exit() leaves; Ctrl-C stops a running statement.")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> NoReturn:
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    source: bytes | None = None
    if arguments.file is not None:
        try:
            if arguments.file == "-":
                source = sys.stdin.buffer.read()
            else:
                with open(arguments.file, "rb") as script:
                    source = script.read()
        except OSError as error:
            _fail(f"can't open file {arguments.file!r}: {error}", 2)
        if b"\0" in source[:4096] and arguments.file != "-":  # say what it is instead
            from .package import _not_a_zip

            _fail(f"{arguments.file} is neither a Python script nor a torch.package archive "
                  f"(a zip file): {_not_a_zip(arguments.file)}", 2)

    from .errors import MultipyError
    from .manager import InterpreterManager

    try:
        manager = InterpreterManager(arguments.interpreters)
    except MultipyError as error:
        _fail(str(error))
    with manager:
        interpreter = manager[0]
        with interpreter.acquire_session() as session:
            names, lines = _bind(manager, interpreter, arguments)
            if arguments.code is not None:
                argv_inside, path0 = ["-c", *arguments.args], ""
            elif arguments.file is not None:
                argv_inside = [arguments.file, *arguments.args]
                path0 = (os.getcwd() if arguments.file == "-"
                         else os.path.dirname(os.path.abspath(arguments.file)))
            else:
                argv_inside, path0 = [""], ""
            console = session.global_(_INSIDE, "Console")(names, argv_inside, path0)
            try:
                status = _session(manager, interpreter, console, arguments, lines, source)
            finally:
                try:
                    console.call_value("close")
                except Exception:
                    pass
    sys.stdout.flush()
    sys.exit(status)


def _session(manager: InterpreterManager, interpreter: Interpreter, console: Obj,
             arguments: Arguments, lines: list[str], source: bytes | None) -> int:
    """Runs the program or the prompt; the exit status.  Exits with status 2 and one
    line if the program starts interpreters, which it cannot inside one."""
    from .errors import InterpreterStartError

    if arguments.code is not None or source is not None:
        if arguments.code is not None:
            program, filename = arguments.code, "<string>"
        else:
            program = source
            filename = "<stdin>" if arguments.file == "-" else os.path.abspath(arguments.file)
        try:
            return console.call_value("run", (program, filename))
        except KeyboardInterrupt:  # the program printed its traceback inside
            return 130
        except InterpreterStartError:  # raised by the program's own multipy, inside
            instead = ("run it with `multipy run -c CODE`" if arguments.code is not None else
                       "save it as FILE and run `multipy run FILE`" if arguments.file == "-"
                       else f"run it with `multipy run {arguments.file}`")
            _fail(f"the program starts interpreters of its own, which a program run inside "
                  f"an interpreter cannot: {instead} instead", 2)
    prompt = Prompt(console)
    try:
        text = "" if arguments.quiet else banner(manager, interpreter, lines)
        prompt.interact(banner=text, exitmsg="")
    except SystemExit as leaving:  # exit() inside: its status, already made an int there
        return leaving.code if isinstance(leaving.code, int) else 1
    return 0


if __name__ == "__main__":
    from ._launch import make_room

    make_room()
    main()
