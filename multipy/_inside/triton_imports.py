"""Each Triton model's own modules, inside an interpreter.  Triton runs each model in a
process of its own, its version folder on sys.path; here models share interpreters, so
a model's ``model.py`` and the modules beside it are imported as modules of a package
that is that model's alone (``_triton_models.m_<model>``, whose path is the version
folder), and ``import utils`` or ``from utils import x`` in any of them finds that
model's ``utils`` where its folder has one (their ``__import__`` is the model's), each
compiled from its source as it is now (multipy._inside.model_files).  Two models that
each have a ``utils.py`` each get their own.  ``importlib.import_module("utils")`` is
not redirected: the folder is not on sys.path, so it fails rather than find another
model's.
"""
from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from . import model_files

#: The package under which each model's package is.
ROOT = "_triton_models"
#: Each model package's builtins, by the package's name.
_NAMESPACES: dict[str, dict[str, Any]] = {}


def load_module(model: str, model_file: str) -> ModuleType:
    """model_file (model's ``model.py``) imported as a module of model's own package,
    the modules of its folder that it imports its own too; what importing it raises
    propagates, and then none of the package's modules are kept.  Loading a model again
    (reloaded, another version) forgets its modules first."""
    package = f"{ROOT}.{_identifier(model)}"
    folder = os.path.dirname(os.path.abspath(model_file))
    _forget(package)
    if ROOT not in sys.modules:
        sys.modules[ROOT] = _package(ROOT, [])
        sys.meta_path.insert(0, _Finder())
    _NAMESPACES[package] = _namespace(package, folder)
    sys.modules[package] = _package(package, [folder])
    name = os.path.splitext(os.path.basename(model_file))[0]
    try:
        return importlib.import_module(f"{package}.{name}")
    except BaseException:
        _forget(package)
        raise


def _identifier(model: str) -> str:
    """model's name as one component of a module's name, different for each name:
    "m_" and the name where it is an identifier, else "x_" and its UTF-8 in hex."""
    return "m_" + model if model.isidentifier() else "x_" + model.encode().hex()


def _package(name: str, path: list[str]) -> ModuleType:
    module = importlib.util.module_from_spec(
        importlib.machinery.ModuleSpec(name, None, is_package=True))
    module.__path__ = path
    return module


def _forget(package: str) -> None:
    for name in [name for name in sys.modules
                 if name == package or name.startswith(package + ".")]:
        del sys.modules[name]


def _namespace(package: str, folder: str) -> dict[str, Any]:
    """The builtins of package's modules: the interpreter's, but for an ``__import__``
    that takes an absolute import of a module of folder (a ``.py`` file or a folder with
    an ``__init__.py``, as found now) as package's module of that name."""
    beside = {entry[:-3] for entry in os.listdir(folder) if entry.endswith(".py")} | {
        entry for entry in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, entry, "__init__.py"))}
    real = builtins.__import__

    def __import__(name: str, globals: Any = None, locals: Any = None,
                   fromlist: Any = (), level: int = 0) -> ModuleType:
        top = name.partition(".")[0]
        if level or top not in beside:
            return real(name, globals, locals, fromlist, level)
        module = real(f"{package}.{name}", globals, locals, fromlist, 0)
        return module if fromlist else sys.modules[f"{package}.{top}"]

    return {**builtins.__dict__, "__import__": __import__}


class _Finder:
    """Finds the modules of each model's package in its folder, as Python's own path
    finder does, and gives each source module its model's builtins before it runs."""

    @staticmethod
    def find_spec(fullname: str, path: Any, target: Any = None) -> Any:
        parts = fullname.split(".")
        if len(parts) < 3 or parts[0] != ROOT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _Loader(fullname, spec.origin, _NAMESPACES[f"{ROOT}.{parts[1]}"])
        return spec


class _Loader(model_files.SourceAsNow):
    """A source file's loader that compiles the file as it is now and runs the module
    with the builtins given."""

    def __init__(self, fullname: str, path: str, namespace: dict[str, Any]) -> None:
        super().__init__(fullname, path)
        self._namespace = namespace

    def exec_module(self, module: ModuleType) -> None:
        module.__builtins__ = self._namespace
        super().exec_module(module)
