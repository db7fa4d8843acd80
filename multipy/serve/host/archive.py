"""A torch.package archive, read in the host without torch (and without numpy):
checked, and where its tensor storages lie in the file.

torch's archive writer stores records uncompressed and aligned to 64 bytes, so each
storage is a span of the file (``records``): each interpreter maps the file itself, a
private (copy-on-write) mapping, and its model's tensors alias those spans
(multipy._inside.package.mapped).  The pages are the page cache's, shared by every
interpreter that maps them (and by every process that maps the file), so the weights are
in memory once whatever the number of interpreters; a page that a model writes to
becomes its interpreter's own.  A compressed record, which torch does not write, is
left to each interpreter's importer to read.  For a model served on a CUDA device,
``on_device`` copies the storages (``storages``) once to the device's memory, through
the driver, for every interpreter to alias there.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
import weakref
import zipfile
from typing import Any

from ... import _cuda

#: A zip local file header: its fixed size and where the name and extra lengths are.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_MAGIC = b"PK\x03\x04"


#: How to make an archive, as the errors say it: the model's own code goes in (intern),
#: the libraries it imports stay outside (extern).
_RECIPE = ("save the model with torch.package: with torch.package.PackageExporter(PATH) as "
           "exporter: exporter.intern('your_models.**'); exporter.extern(['torch.**', "
           "'numpy.**']); exporter.save_pickle('model', 'model.pkl', model)")


class ArchiveError(ValueError):
    """The file is not a torch.package archive holding the model asked for."""


def check(path: str, module: str, resource: str) -> None:
    """ArchiveError unless path is a torch.package archive with (module, resource)."""
    if os.path.isdir(path):
        raise ArchiveError(f"{path} is a folder, not a torch.package archive (a file), nor a "
                           f"Triton model's folder (one with a config.pbtxt): {_RECIPE}")
    if not os.path.isfile(path):
        raise ArchiveError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise ArchiveError(f"{path} is not a torch.package archive (not a zip file): {_RECIPE}")
    with zipfile.ZipFile(path) as archive:
        records = {info.filename.split("/", 1)[-1] for info in archive.infolist()}
    if ".data/version" not in records:
        raise ArchiveError(f"{path} is a zip file but not a torch.package archive: {_RECIPE}")
    wanted = f"{module.replace('.', '/')}/{resource}"
    if wanted not in records:
        pickles = sorted(name for name in records
                         if name.endswith(".pkl") and not name.startswith("."))
        raise ArchiveError(f"{path} has no resource {resource!r} in package {module!r} "
                           f"(--module, --resource); its pickles are "
                           f"{', '.join(pickles) or 'none'}")


def find(directories: tuple[str, ...], relative: str) -> str | None:
    """The real path of the regular file that relative names in the first of directories
    (each a real path) that has one, or None: None too for a path that leaves its
    directory (``..``, an absolute path elsewhere, a symbolic link out of it) or names
    anything but a regular file (a device, a directory, a FIFO), so that a caller can
    refuse them all alike and say nothing of the file system."""
    if not relative or "\0" in relative:
        return None
    for directory in directories:
        found = os.path.realpath(os.path.join(directory, relative))
        if os.path.commonpath([found, directory]) != directory:
            continue
        try:
            if stat.S_ISREG(os.stat(found).st_mode):
                return found
        except OSError:
            continue
    return None


def records(path: str) -> dict[str, tuple[int, int]]:
    """Where each storage record of the archive at path lies in the file: record name
    (".data/N.storage") -> (offset, size), for every record stored uncompressed (torch
    writes no other)."""
    found: dict[str, tuple[int, int]] = {}
    with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            if not (name.startswith(".data/") and name.endswith(".storage")) \
                    or info.compress_type != zipfile.ZIP_STORED:
                continue
            start = _data_offset(file, info)
            if start is not None:
                found[name] = (start, info.file_size)
    return found


def storages(path: str, spans: dict[str, tuple[int, int]]) -> dict[str, memoryview]:
    """The storage records at spans (as ``records`` gives them) of the archive at path,
    each a view of one private (copy-on-write) mapping of the file: what ``on_device``
    copies, in place (a read-only view would be copied in memory first)."""
    if not spans:
        return {}
    with open(path, "rb") as file:
        mapping = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY))
    return {name: mapping[start:start + size] for name, (start, size) in spans.items()}


def on_device(storages: dict[str, Any], device: str
              ) -> tuple[dict[str, tuple[int, int]], str, Any]:
    """The storages copied once to the memory of CUDA device ``device`` ("cuda" or
    "cuda:N"), as ``multipy._inside.serving.load`` takes them: (record name -> (device
    address, size), device, keeper).  keeper is a one-byte array that each interpreter
    keeps an alias of (lent, as arrays are) for as long as its model lives: the device
    memory is freed once the host's keeper and every alias of it are gone, so no model
    outlives its weights.  RuntimeError if the driver refuses."""
    import numpy as np  # (for a CUDA device only: the keeper is lent, as arrays are)

    copy = _cuda.DeviceCopy(storages, int(device.partition(":")[2] or 0))
    keeper = np.zeros(1, np.uint8)
    weakref.finalize(keeper, copy.close).atexit = False  # at exit the process's end frees it
    return copy.places, device, keeper


def _data_offset(file, info: zipfile.ZipInfo) -> int | None:
    """Where a record's bytes start in the file (past its local header), or None."""
    file.seek(info.header_offset)
    header = file.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
        return None
    fields = _LOCAL_HEADER.unpack(header)
    name_length, extra_length = fields[-2], fields[-1]
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
