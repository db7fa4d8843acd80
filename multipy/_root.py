"""The root object of every namespace, made for the CPython that is running.

``_keys.so`` is built without libpython, so that one build (one wheel) serves every
installation of its CPython version.  Before the first namespace opens, the host copies it
into a memory file with one dependency more: the running CPython's libpython, by its full
path, written into the slot that ``_keys.c`` reserves and named by a spare entry of the
dynamic section (GNU ld leaves some).  Loaded as a namespace's root, that copy brings the
libpython into the namespace's global scope behind it, where extension modules find
CPython's symbols (docs/design.md, "libpython first").  glibc gives no other way: it
refuses ``dlmopen`` with ``RTLD_GLOBAL``, and crashes on ``dlopen`` with it inside a
namespace other than the main one.
"""
from __future__ import annotations

import functools
import os
import struct

from .errors import InterpreterStartError

_SLOT_MARK = b"multipy: libpython's path goes here\0"  # _keys.c's multipy_libpython_slot
_SLOT_SIZE = 4096
_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5
_MFD_CLOEXEC, _MFD_EXEC = 0x1, 0x10


def _program_headers(image: bytes) -> list[tuple[int, ...]]:
    (table,) = struct.unpack_from("<Q", image, 32)  # e_phoff, then e_phentsize, e_phnum
    entry_size, count = struct.unpack_from("<HH", image, 54)
    return [struct.unpack_from("<IIQQQQQQ", image, table + i * entry_size) for i in range(count)]


def with_libpython(image: bytes, libpython: str) -> bytes:
    """A copy of the ELF object ``image`` (``_keys.so``) that also needs ``libpython``, by
    its path; InterpreterStartError if ``image`` has no spare dynamic entry or no slot for it."""
    copy = bytearray(image)
    path = os.fsencode(libpython) + b"\0"
    slot = copy.find(_SLOT_MARK)
    if image[:5] != b"\x7fELF\x02" or slot < 0 or len(path) > _SLOT_SIZE:
        raise InterpreterStartError("multipy's _keys library has no slot for libpython's path (rebuild it)")
    headers = _program_headers(image)
    _, _, offset, _, _, size, _, _ = next(h for h in headers if h[0] == _PT_DYNAMIC)
    entries = list(struct.iter_unpack("<qQ", image[offset:offset + size]))
    tags = [tag for tag, _ in entries]
    strtab = next(value for tag, value in entries if tag == _DT_STRTAB)
    end = tags.index(_DT_NULL)
    if tags[end + 1:end + 2] != [_DT_NULL]:
        raise InterpreterStartError("multipy's _keys library has no spare dynamic entry (link it with GNU ld)")
    load = next(h for h in headers if h[0] == _PT_LOAD and h[2] <= slot < h[2] + h[5])
    address = load[3] + slot - load[2]  # the slot's address, to which the entry points
    copy[slot:slot + len(path)] = path
    struct.pack_into("<qQ", copy, offset + 16 * end, _DT_NEEDED, address - strtab)
    return bytes(copy)


@functools.cache
def root_path(keys: str, libpython: str) -> str:
    """A path under which ``keys`` loads needing ``libpython`` (a memory file, kept open for
    the process's life: each namespace knows its root by this path)."""
    with open(keys, "rb") as file:
        image = with_libpython(file.read(), libpython)
    try:  # executable where the kernel would make memory files sealed against it
        descriptor = os.memfd_create("multipy-root", _MFD_CLOEXEC | _MFD_EXEC)
    except OSError:  # a kernel before 6.3, which has no such flag
        descriptor = os.memfd_create("multipy-root", _MFD_CLOEXEC)
    os.write(descriptor, image)
    return f"/proc/self/fd/{descriptor}"
