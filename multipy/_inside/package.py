"""torch.package support that runs inside each interpreter.

The host calls these functions through ordinary requests (``global_`` and a call).
Weights are never copied: an importer reads each storage record from the host's one
copy (lent as aliases, see _sharing; on a CUDA device, the host's one copy there), or
from the page cache's (``mapped``: multipy serve's archives), and
a movable object's storages stay in the interpreter that made it and are aliased by the
others.
"""
from __future__ import annotations

import inspect
import io
import mmap
import pickle
import warnings
from typing import Any

import torch
from torch.package import PackageImporter, sys_importer
from torch.package.importer import OrderedImporter
from torch.package._package_pickler import PackagePickler


class _SharedStorageReader:
    """An importer's zip reader whose storage records come from shared memory."""

    def __init__(self, reader: Any, storages: dict[str, torch.Tensor]) -> None:
        self._reader = reader
        self._storages = storages

    def get_storage_from_record(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        shared = self._storages.get(name)
        if shared is None:
            return self._reader.get_storage_from_record(name, numel, dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return shared[:numel * itemsize].view(dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def importer(path: str, storages: dict[str, torch.Tensor]) -> PackageImporter:
    """A PackageImporter for the archive at path whose storages alias ``storages``
    (record name -> uint8 tensor over the host's copy, or a mapping of the file)."""
    package_importer = PackageImporter(path)
    package_importer.zip_reader = _SharedStorageReader(package_importer.zip_reader, storages)
    return package_importer


def mapped(path: str, spans: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The storage records at spans (record name -> (offset, size)) of the file at path,
    as uint8 tensors, each with a storage of its own, over one private (copy-on-write)
    mapping of it, made here: the page cache's pages, which every interpreter and
    process that maps the file shares.  The mapping lasts as long as any of them."""
    if not spans:
        return {}
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    return {name: torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=start)
            if size else torch.empty(0, dtype=torch.uint8)
            for name, (start, size) in spans.items()}


def load_pickle(package_importer: PackageImporter, package: str, resource: str,
                map_location: str | None = None) -> Any:
    """The object pickled at (package, resource), its tensors on map_location (a device:
    the importer's storages are there already, so nothing is copied); FileNotFoundError,
    naming the resources that the archive has, if it has none there."""
    try:
        with warnings.catch_warnings():  # torch.package itself still uses TypedStorage
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            return package_importer.load_pickle(package, resource, map_location=map_location)
    except Exception:
        missing = _missing_resource(package_importer, package, resource)
        if missing is None:
            raise
    raise FileNotFoundError(missing)


def _missing_resource(package_importer: PackageImporter, package: str,
                      resource: str) -> str | None:
    """None if the archive holds (package, resource), else what it holds instead: the
    package's resources, or the archive's if the package has none (the closest few)."""
    try:
        records = package_importer.zip_reader.get_all_records()
    except Exception:  # a reader without a listing: say nothing more than torch did
        return None
    folder = package.replace(".", "/") + "/"
    if folder + resource in records:
        return None
    own = sorted(name[len(folder):] for name in records if name.startswith(folder))
    if own:
        closest = _closest(resource, own)
        where = (f"it has {', '.join(map(repr, closest))}" if len(closest) == len(own) else
                 f"the closest of its {len(own)} resources are {', '.join(map(repr, closest))}")
    else:
        pairs = {name: f"({name.rpartition('/')[0].replace('/', '.')!r}, "
                       f"{name.rpartition('/')[2]!r})"
                 for name in sorted(records) if "/" in name and not name.startswith(".data/")}
        closest = [pairs[name] for name in _closest(folder + resource, list(pairs))]
        if not pairs:
            where = "the archive holds no resources"
        elif len(closest) == len(pairs):
            where = f"no resource is in that package; the archive's are {', '.join(closest)}"
        else:
            where = (f"no resource is in that package; the closest of the archive's "
                     f"{len(pairs)} (package, resource) pairs are {', '.join(closest)}")
    return (f"the package archive {package_importer.filename!r} has no resource "
            f"{resource!r} in package {package!r}: {where}")


def _closest(wanted: str, names: list[str], most: int = 8) -> list[str]:
    """names if there are few, else the few closest to wanted."""
    if len(names) <= most:
        return names
    import difflib

    return difflib.get_close_matches(wanted, names, most, 0)


def _importers(package_importer: PackageImporter | None) -> OrderedImporter:
    return OrderedImporter(package_importer, sys_importer) if package_importer else sys_importer


class _MovablePickler(PackagePickler):
    """Pickles an object with its storages set aside (they are lent, not copied)."""

    def __init__(self, importers: OrderedImporter, file: io.BytesIO) -> None:
        super().__init__(importers, file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, torch.uint8
        else:
            return None
        key = untyped.data_ptr() if untyped.nbytes() else -1 - len(self.storages)
        if key not in self._seen:
            self._seen[key] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=untyped.device)
                                 .set_(untyped))
        return ("storage", self._seen[key], str(dtype).split(".")[-1])

    def reducer_override(self, obj):
        reduce_deploy = getattr(type(obj), "__reduce_deploy__", None)
        if reduce_deploy is not None and not isinstance(obj, type):
            return reduce_deploy(obj, self.importer)
        return NotImplemented


def movable(obj: Any, package_importer: PackageImporter | None = None) -> tuple[bytes, list]:
    """obj as (pickle, storages) for from_movable in any interpreter.  Objects may define
    ``__reduce_deploy__(self, importer)`` to choose how they are rebuilt."""
    buffer = io.BytesIO()
    pickler = _MovablePickler(_importers(package_importer), buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.storages


def from_movable(data: bytes, storages: list[torch.Tensor],
                 package_importer: PackageImporter | None = None) -> Any:
    """Rebuilds what movable() made, over the same storages."""

    def persistent_load(saved):
        _, index, dtype = saved
        return torch.storage.TypedStorage(wrap_storage=storages[index].untyped_storage(),
                                          dtype=getattr(torch, dtype), _internal=True)

    if package_importer is not None:
        unpickler = package_importer.Unpickler(io.BytesIO(data))  # a pure-Python unpickler
        unpickler.persistent_load = persistent_load
    else:
        unpickler = _StorageUnpickler(io.BytesIO(data))
        unpickler.load_storage = persistent_load
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        return unpickler.load()


class _StorageUnpickler(pickle.Unpickler):
    load_storage: Any

    def persistent_load(self, saved):
        return self.load_storage(saved)


def argument_names(target: Any, method: str) -> list[str]:
    return list(inspect.signature(getattr(target, method)).parameters)
