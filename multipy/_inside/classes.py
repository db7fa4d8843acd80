"""Finding a model written as a class, inside one interpreter, and serving it as its
kind says: a ``kserve.Model`` subclass as KServe serves it (``served_kserve``), a
``litserve.LitAPI`` subclass as LitServe does (``served_litserve``), a
``torch.nn.Module`` subclass as an archive's model (``served_module``), any other class
with a ``predict`` as ``served_class`` does."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from . import model_files, served_class, served_kserve, served_litserve, served_module


def load(path: str, module: str, name: str, served_as: str, device: str = "cpu",
         max_batch_size: int = 1) -> Any:
    """An instance of class name of module (imported by name, or from the file at path
    as it is now: multipy._inside.model_files), loaded and ready to serve as model
    served_as, on device (a LitAPI's and an nn.Module's; other classes choose their
    own), batching up to max_batch_size requests (a LitAPI's).  TypeError if module
    has no such class, or the class no ``predict`` (and is neither a LitAPI nor an
    nn.Module), or is an nn.Module that cannot be made without arguments."""
    if path:
        found = model_files.import_file(path, module)
    else:
        found = importlib.import_module(module)
    kind = getattr(found, name, None)
    if not inspect.isclass(kind):
        raise TypeError(f"{module} has no class {name}")
    if served_litserve.is_lit_api(kind):
        return served_litserve.load(kind, device, max_batch_size)
    if served_module.is_module(kind):
        return served_module.load(kind, f"{module}.{name}", device)
    if not callable(getattr(kind, "predict", None)):
        raise TypeError(f"{module}.{name} has no predict method")
    if served_kserve.is_kserve_model(kind):
        return served_kserve.load(kind, served_as)
    return served_class.load(kind, f"{module}.{name}")
