"""A model's own source files, inside one interpreter, run as they are now.

Python's bytecode cache (``__pycache__``) takes a source file as unchanged while its
size and its modification time, in whole seconds, are: a model file rewritten within the
second it was last written, at the same size (``VERSION = 1`` made ``VERSION = 2``), would
run as it was before.  A server deployed again (SIGHUP, a reload) must run what its files
say now, so a model's files are compiled from their source each time they are imported,
and no cache is read or written beside them: the file named as the model
(``import_file``), the modules directly in its folder (a package's ``__init__.py``
too), and a Triton model's modules (``multipy._inside.triton_imports``).  The modules
inside a package of that folder, and everything else, import as Python imports them.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import linecache
import os
import sys
from types import ModuleType
from typing import Any

#: The folders whose modules are compiled from their source, as absolute paths.
_FOLDERS: set[str] = set()


class SourceAsNow(importlib.machinery.SourceFileLoader):
    """A source file's loader that compiles the file as it is now, without Python's
    bytecode cache, and forgets the lines linecache kept of it (which tracebacks and
    ``inspect.getsource`` read, and take as unchanged as the cache does)."""

    def path_stats(self, path: str) -> dict:
        """OSError: with no modification time, Python's loader neither reads nor writes
        a bytecode cache, and compiles the source."""
        raise OSError(f"{path} is compiled as it is now")

    def get_code(self, fullname: str) -> Any:
        linecache.cache.pop(self.get_filename(fullname), None)
        return super().get_code(fullname)


def import_file(path: str, module: str) -> ModuleType:
    """The file at path, compiled as it is now and run as module (a new module, in
    sys.modules under that name), its folder first on sys.path with the modules directly
    in it compiled as they are now too.  What running it raises propagates, and then
    sys.modules keeps no module of that name."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if folder not in _FOLDERS:
        if not _FOLDERS:
            sys.path_hooks.insert(0, _finder)
        _FOLDERS.add(folder)
        sys.path_importer_cache.pop(folder, None)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module, path,
                                                  loader=SourceAsNow(module, path))
    found = importlib.util.module_from_spec(spec)
    sys.modules[module] = found
    try:
        spec.loader.exec_module(found)
    except BaseException:
        del sys.modules[module]
        raise
    return found


def _finder(entry: str) -> importlib.machinery.FileFinder:
    """sys.path_hooks' finder for a folder of import_file's (ImportError for any other
    entry, which the next hook takes): Python's own, but for its source files' loader."""
    if entry not in _FOLDERS:
        raise ImportError("not a model's folder")
    return importlib.machinery.FileFinder(
        entry, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        (SourceAsNow, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES))
