"""A model written as a Python class (``multipy serve MODULE:CLASS`` or
``FILE.py:CLASS``), as the host sees it: named, found and checked without importing it
(the host never imports the model's code, nor torch).  The interpreters load it with
``multipy._inside.classes`` (and ``served_class``, which documents the class's contract).
"""
from __future__ import annotations

import ast
import importlib.machinery
import os
import sys

from ...errors import InterpreterError, RemoteTraceback
from ..request.litserve import API_PATH, clashes


class ClassError(ValueError):
    """The class cannot be served: its module or file, or the class, is missing, or it
    has no ``predict``; or loading it in an interpreter raised (importing its module,
    making the instance, its ``load()``): ``traceback`` is then the interpreter's, as
    Python prints it ("" for the host's own checks)."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


def failed(served: str, error: Exception) -> ClassError:
    """The ClassError for error, raised in an interpreter by loading the class served
    ("FILE.py:CLASS" or "MODULE:CLASS"), with the interpreter's traceback."""
    cause = error.__cause__
    what = str(error) if isinstance(error, InterpreterError) else \
        f"{type(error).__name__}: {error}"
    text = cause.traceback_text if isinstance(cause, RemoteTraceback) else ""
    return ClassError(f"{served}: loading it in an interpreter raised {what}",
                      text if 'File "' in text else "")  # (without frames: what says it all)


def check_paths(models: list[tuple[str, dict | None]]) -> None:
    """ClassError if two of models (each: what it is served from, and its metadata, None
    before it loads) are LitAPIs on one path, or one is on a path of the server's own
    (multipy.serve.request.litserve.clashes)."""
    clash = clashes([(served, described[API_PATH]) for served, described in models
                     if described and described.get(API_PATH)])
    if clash:
        raise ClassError(clash)


def parse(target: str) -> tuple[str, str, str] | None:
    """(path, module, class) that target names, "FILE.py:CLASS" (path absolute, module
    the file's stem) or "MODULE:CLASS" (path ""); None if it names no class (an
    archive's path)."""
    where, colon, name = target.rpartition(":")
    if not colon or not name.isidentifier():
        return None
    if where.endswith(".py"):
        path = os.path.abspath(where)
        return path, os.path.splitext(os.path.basename(path))[0], name
    if all(part.isidentifier() for part in where.split(".")):
        return "", where, name
    return None


def check(path: str, module: str, name: str) -> None:
    """ClassError unless the file at path (or, without one, module on sys.path) defines
    class name at its top level, with a ``predict`` of its own or bases that may give
    one (``litserve.LitAPI`` and ``torch.nn.Module``, which the interpreters recognise
    as they load it, do: multipy._inside.classes)."""
    source = path or _module_file(module)
    if not os.path.isfile(source):
        raise ClassError(f"{source}: no such file")
    try:
        with open(source, "rb") as f:
            tree = ast.parse(f.read(), source)
    except SyntaxError as error:
        raise ClassError(f"{source}, line {error.lineno}: {error.msg}") from None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found = classes.get(name)
    if found is None:
        raise ClassError(f"{source} has no class {name} at its top level (its classes: "
                         f"{', '.join(classes) or 'none'})")
    methods = {node.name for node in found.body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    bases = [base for base in found.bases if not (isinstance(base, ast.Name)
                                                  and base.id == "object")]
    if "predict" not in methods and not bases:
        raise ClassError(f"class {name} of {source} has no predict method: it takes a dict "
                         f"of input name -> numpy array and returns the outputs")


def _module_file(module: str) -> str:
    """The file of module, found on sys.path without importing it or its packages."""
    search, spec = None, None
    parts = module.split(".")
    for k in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:k + 1]), search)
        if spec is None:
            raise ClassError(f"no module {module!r} on the server's Python path "
                             f"({os.pathsep.join(sys.path)}); give a FILE.py:CLASS instead, "
                             f"or set PYTHONPATH")
        search = spec.submodule_search_locations
    if spec.origin is None or not spec.origin.endswith(".py"):
        raise ClassError(f"module {module!r} is not a Python file ({spec.origin})")
    return spec.origin
