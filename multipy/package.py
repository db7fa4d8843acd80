"""Package: a torch.package archive loaded into every interpreter of a manager."""
from __future__ import annotations

import os
import tempfile
import threading
import zipfile
from typing import IO, TYPE_CHECKING, Any

from .replicated import PerInterpreter, ReplicatedObj

if TYPE_CHECKING:
    from .session import Interpreter, InterpreterSession, Obj

_HELPERS = "multipy._inside.package"


class Package:
    """A torch.package archive, opened once in the host.

    Each interpreter gets its own ``PackageImporter``, made on first use; extern modules
    come from the manager's environment.  The archive's tensor storages are read once,
    into the host, and every interpreter's objects alias them.
    """

    def __init__(self, manager: Any, path_or_file: str | os.PathLike | IO[bytes]) -> None:
        import torch

        self._manager = manager
        self._spool = None
        if isinstance(path_or_file, (str, os.PathLike)):
            self.path = self.name = os.path.abspath(os.fspath(path_or_file))
            if not os.path.isfile(self.path):
                raise FileNotFoundError(f"no package file at {self.path}")
        else:  # a file-like object: interpreters open archives by path, so spool it
            self._spool = tempfile.NamedTemporaryFile(prefix="multipy-", suffix=".pt")
            self._spool.write(path_or_file.read())
            self._spool.flush()
            self.path = self._spool.name
            self.name = f"the package read from {path_or_file!r}"
        if not zipfile.is_zipfile(self.path):
            raise ValueError(f"{self.name} is not a torch.package archive: not a zip file")
        try:
            with zipfile.ZipFile(self.path) as archive:
                # records are stored under one top-level folder named after the archive
                self._sizes = {info.filename.split("/", 1)[-1]: info.file_size
                               for info in archive.infolist()}
            self._reader = torch._C.PyTorchFileReader(self.path)
        except (zipfile.BadZipFile, RuntimeError, OSError) as error:
            raise ValueError(f"{self.name} is not a readable torch.package archive: {error}") from error
        if ".data/version" not in self._sizes:
            raise ValueError(f"{self.name} is a zip file but not a torch.package archive "
                             f"(it has no .data/version)")
        self._lock = threading.Lock()
        self._storages: dict[str, object] | None = None
        self._importers = PerInterpreter(self._make_importer)

    def _record(self, package: str, resource: str) -> str:
        name = f"{package.replace('.', '/')}/{resource}"
        if name not in self._sizes:
            raise FileNotFoundError(f"{self.name} has no resource {resource!r} in "
                                    f"{package!r}")
        return name

    def _shared_storages(self) -> dict[str, object]:
        """Every storage record, read once into host memory (uint8 tensors)."""
        import torch

        with self._lock:
            if self._storages is None:
                self._storages = {}
                for name, size in self._sizes.items():
                    if name.startswith(".data/") and name.endswith(".storage"):
                        record = self._reader.get_storage_from_record(name, size, torch.uint8)
                        # the record comes as an empty tensor over its storage: span it all
                        self._storages[name] = torch.empty(0, dtype=torch.uint8).set_(
                            record.untyped_storage())
            return self._storages

    def importer(self, interpreter: Interpreter) -> Obj:
        """This package's PackageImporter in interpreter, made on first use."""
        return self._importers.get(interpreter)

    def _make_importer(self, interpreter: Interpreter) -> Obj:
        make = interpreter.global_(_HELPERS, "importer")
        return make(self.path, self._shared_storages())

    def load_pickle(self, package: str, resource: str) -> ReplicatedObj:
        """The pickled object at (package, resource), replicated over the interpreters."""
        self._record(package, resource)

        def load(interpreter: Interpreter) -> Obj:
            load_pickle = interpreter.global_(_HELPERS, "load_pickle")
            return load_pickle(self.importer(interpreter), package, resource)

        return ReplicatedObj(self._manager, load, package=self)

    def load_text(self, package: str, resource: str, encoding: str = "utf-8") -> str:
        return self.load_binary(package, resource).decode(encoding)

    def load_binary(self, package: str, resource: str) -> bytes:
        return self._reader.get_record(self._record(package, resource))

    def acquire_session(self) -> InterpreterSession:
        """A session on an interpreter the load balancer picks, whose ``self`` is this
        package's importer there."""
        return self._manager.acquire_one().about(self.importer, self)

    def __repr__(self) -> str:
        return f"<multipy.Package {self.name}>"
