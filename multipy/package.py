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
    into the host, and every interpreter's objects alias them; loaded with a CUDA
    ``map_location``, they are copied to that device once, by the host, and every
    interpreter's objects alias that copy.
    """

    def __init__(self, manager: Any, path_or_file: str | os.PathLike | IO[bytes]) -> None:
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
            raise ValueError(f"{self.name} is not a torch.package archive: "
                             f"{_not_a_zip(self.path)}")
        try:
            with zipfile.ZipFile(self.path) as archive:
                # records are stored under one top-level folder named after the archive
                self._sizes = {info.filename.split("/", 1)[-1]: info.file_size
                               for info in archive.infolist()}
        except (zipfile.BadZipFile, RuntimeError, OSError) as error:
            raise ValueError(f"{self.name} is not a readable torch.package archive: {error}") from error
        if ".data/version" not in self._sizes:
            raise ValueError(f"{self.name} is not a torch.package archive: "
                             f"{_other_zip(self._sizes)}")
        import torch

        try:
            self._reader = torch._C.PyTorchFileReader(self.path)
        except (RuntimeError, OSError) as error:
            raise ValueError(f"{self.name} is not a readable torch.package archive: {error}") from error
        self._lock = threading.Lock()
        self._storages: dict[str | None, dict[str, object]] = {}  # by device (None: host)
        self._importers: dict[str | None, PerInterpreter] = {}

    def _record(self, package: str, resource: str) -> str:
        name = f"{package.replace('.', '/')}/{resource}"
        if name not in self._sizes:
            raise FileNotFoundError(f"{self.name} has no resource {resource!r} in package "
                                    f"{package!r}: {_resources_like(self._sizes, package, resource)}")
        return name

    def _shared_storages(self, device: str | None = None) -> dict[str, object]:
        """Every storage record (uint8 tensors), read once into host memory, and copied
        once to the CUDA device ``device`` if one is named."""
        import torch

        with self._lock:
            storages = self._storages.get(device)
            if storages is not None:
                return storages
            storages = self._storages.get(None)
            if storages is None:
                storages = self._storages[None] = {}
                for name, size in self._sizes.items():
                    if name.startswith(".data/") and name.endswith(".storage"):
                        record = self._reader.get_storage_from_record(name, size, torch.uint8)
                        # the record comes as an empty tensor over its storage: span it all
                        storages[name] = torch.empty(0, dtype=torch.uint8).set_(
                            record.untyped_storage())
            if device is not None:
                storages = self._storages[device] = {
                    name: storage.to(device) for name, storage in storages.items()}
            return storages

    def importer(self, interpreter: Interpreter, device: str | None = None) -> Obj:
        """This package's PackageImporter in interpreter, made on first use, whose
        storages are in host memory, or on the CUDA device ``device``."""
        with self._lock:
            importers = self._importers.get(device)
            if importers is None:
                importers = self._importers[device] = PerInterpreter(
                    lambda interpreter: self._make_importer(interpreter, device))
        return importers.get(interpreter)

    def _make_importer(self, interpreter: Interpreter, device: str | None) -> Obj:
        make = interpreter.global_(_HELPERS, "importer")
        return make(self.path, self._shared_storages(device))

    def load_pickle(self, package: str, resource: str,
                    map_location: Any = None) -> ReplicatedObj:
        """The pickled object at (package, resource), replicated over the interpreters.
        map_location: None (the tensors where they were saved, which is the CPU for
        packages saved there) or a device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
        torch.device): on a CUDA device, every tensor storage is copied there once and
        every replica aliases it.  ValueError for anything else (torch.package's own
        dicts and functions are not taken)."""
        self._record(package, resource)
        device = _cuda_device(map_location)

        def load(interpreter: Interpreter) -> Obj:
            load_pickle = interpreter.global_(_HELPERS, "load_pickle")
            return load_pickle(self.importer(interpreter, device), package, resource,
                               device or (None if map_location is None else "cpu"))

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


def _cuda_device(map_location: Any) -> str | None:
    """The CUDA device that map_location names, as "cuda:N"; None for None and the CPU."""
    if map_location is None:
        return None
    import torch

    try:
        device = torch.device(map_location)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"map_location must be None or a device, not {map_location!r}: "
                         f"{error}") from None
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"map_location {map_location!r}: only the CPU and CUDA devices "
                         f"are supported")
    return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"


#: The first bytes of a file that torch.save wrote in its legacy (not zip) format: a
#: pickled magic number (torch.serialization.MAGIC_NUMBER).
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_USE_EXPORTER = ("to run a model in interpreters, save it as a torch.package archive "
                 "with torch.package.PackageExporter (its save_pickle) and load that")


def _not_a_zip(path: str) -> str:
    """What the file at path, which is not a zip file, seems to be, and what to do."""
    with open(path, "rb") as file:
        start = file.read(len(_LEGACY_TORCH_SAVE))
    if start == _LEGACY_TORCH_SAVE:
        return (f"it is a file that torch.save wrote in its legacy format: load it with "
                f"torch.load; {_USE_EXPORTER}")
    if not start:
        return "the file is empty"
    if len(start) > 1 and start[0] == 0x80 and 2 <= start[1] <= 5:  # PROTO 2-5
        return (f"it looks like a pickle file: load it with pickle.load or torch.load; "
                f"{_USE_EXPORTER}")
    return f"it is not a zip file (it starts with {start[:8]!r}); {_USE_EXPORTER}"


def _other_zip(records: dict[str, int]) -> str:
    """What a zip file without .data/version (records: names less the top folder) is."""
    if "constants.pkl" in records or any(name.startswith("code/") for name in records):
        return (f"it is a TorchScript archive (saved with torch.jit.save or "
                f"ScriptModule.save): load it with torch.jit.load; "
                f"{_USE_EXPORTER}")
    if "data.pkl" in records:
        return (f"it is a file that torch.save wrote: load it with torch.load; "
                f"{_USE_EXPORTER}")
    return f"it is a zip file without the .data/version record of one; {_USE_EXPORTER}"


def _resources_like(records: dict[str, int], package: str, resource: str, most: int = 8) -> str:
    """The resources that package holds (the closest few to resource if there are many),
    or, if it holds none, the closest (package, resource) pairs of the archive."""
    import difflib

    folder = package.replace(".", "/") + "/"
    own = sorted(name[len(folder):] for name in records
                 if name.startswith(folder) and not name.endswith("/"))
    if own:
        if len(own) <= most:
            return f"it has {', '.join(map(repr, own))}"
        closest = difflib.get_close_matches(resource, own, most, 0) or own[:most]
        return f"the closest of its {len(own)} resources are {', '.join(map(repr, closest))}"
    pairs = {name: f"({name.rpartition('/')[0].replace('/', '.')!r}, "
                   f"{name.rpartition('/')[2]!r})"
             for name in sorted(records)
             if "/" in name and not name.startswith(".data/") and not name.endswith("/")}
    if not pairs:
        return "the archive holds no resources"
    if len(pairs) <= most:
        return f"no resource is in that package; the archive's are {', '.join(pairs.values())}"
    closest = difflib.get_close_matches(folder + resource, list(pairs), most, 0)
    listed = [pairs[name] for name in closest]
    return (f"no resource is in that package; the closest of the archive's {len(pairs)} "
            f"(package, resource) pairs are {', '.join(listed)}")
