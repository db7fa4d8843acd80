"""The host's view of glibc: link-map namespaces (dlmopen) and the tunables that size them.

Everything here runs in the host process and its main namespace.  docs/design.md
explains each limit this module reports.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import struct
import sys
import sysconfig
import threading

from . import _host
from ._launch import (LAUNCH_STATIC_TLS, LAUNCH_TUNABLES, environment_at_start,
                      tunables_at_start)
from .errors import UnsupportedPythonError

LM_ID_NEWLM = -1
RTLD_NOW = 0x2
RTLD_DI_LMID = 1
M_ARENA_MAX = -8

#: glibc's compile-time DL_NNS is 16, and the main namespace takes one of them (the
#: number lives in _entry.h, which sizes the C's tables).
MAX_NAMESPACES = _host.MAX_INTERPRETERS

_libc = ctypes.CDLL(None, use_errno=True)
_dlmopen = _libc.dlmopen
_dlmopen.restype = ctypes.c_void_p
_dlmopen.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_int]
_dlsym = _libc.dlsym
_dlsym.restype = ctypes.c_void_p
_dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_dlinfo = _libc.dlinfo
_dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
_dlerror = _libc.dlerror
_dlerror.restype = ctypes.c_char_p


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


_dladdr = _libc.dladdr
_dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]


class NamespaceError(OSError):
    """dlmopen or dlsym failed inside a namespace; the message is glibc's."""


def _fail(what: str) -> NamespaceError:
    message = _dlerror()
    return NamespaceError(f"{what}: {message.decode(errors='replace') if message else 'unknown error'}")


def libpython_path() -> str:
    """Path of the running CPython's shared libpython: the one mapped in this process where
    the host runs on it, else the one its build installed (Debian's python3 is linked
    statically and ships a libpython beside it).  UnsupportedPythonError, in one line
    that says what to do, for a CPython without one."""
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        mapped = file_of(ctypes.cast(ctypes.pythonapi.Py_Initialize, ctypes.c_void_p).value)
        if mapped and os.path.basename(mapped).startswith("libpython"):
            return mapped
        name = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
        for directory in (sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LIBPL")):
            if os.path.exists(os.path.join(directory or "", name)):
                return os.path.join(directory, name)
    raise UnsupportedPythonError(
        f"multipy needs a CPython with a shared libpython, and {platform.python_implementation()} "
        f"{platform.python_version()} at {os.path.realpath(sys.executable)} has none "
        f"(built without --enable-shared): use one that has (Debian's and Ubuntu's python3, "
        f"the official python container images), or rebuild it with "
        f"PYTHON_CONFIGURE_OPTS=--enable-shared (pyenv) or ./configure --enable-shared")


def open_namespace(root: str) -> tuple[int, int]:
    """Loads root as the root object of a new namespace; returns (handle, namespace id)."""
    handle = _dlmopen(LM_ID_NEWLM, root.encode(), RTLD_NOW)
    if not handle:
        raise _fail(f"dlmopen({root})")
    lmid = ctypes.c_long()
    if _dlinfo(handle, RTLD_DI_LMID, ctypes.byref(lmid)) != 0:
        raise _fail("dlinfo(RTLD_DI_LMID)")
    return handle, lmid.value


def one_arena(root: int) -> bool:
    """Has the libc of root's namespace (just opened: no thread but this one has
    allocated there) keep one malloc arena for every thread, unless the process started
    with the user's choice of how many (a MALLOC_ARENA_MAX that is not empty, or the
    glibc.malloc.arena_max tunable, which every namespace's libc reads; glibc reads
    neither later); whether it does (docs/design.md, "memory")."""
    chosen = any(entry.startswith("MALLOC_ARENA_MAX=") and entry != "MALLOC_ARENA_MAX="
                 for entry in environment_at_start())
    if chosen or "glibc.malloc.arena_max" in tunables_at_start():
        return False
    mallopt = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int)(symbol(root, "mallopt"))
    return mallopt(M_ARENA_MAX, 1) == 1


def load_into(lmid: int, path: str) -> int:
    """Loads path into an existing namespace; returns its handle."""
    handle = _dlmopen(lmid, path.encode(), RTLD_NOW)
    if not handle:
        raise _fail(f"dlmopen({path}) into namespace {lmid}")
    return handle


def symbol(handle: int, name: str) -> int:
    """Address of a symbol looked up from handle (so inside that handle's namespace)."""
    address = _dlsym(handle, name.encode())
    if not address:
        raise _fail(f"dlsym({name})")
    return address


def host_free() -> int:
    """Address of the main program's free: the one that the dynamic linker looks up to
    allocate threads' TLS with (docs/design.md, "Stacks from another libc")."""
    return symbol(_libc._handle, "free")


def process_keys() -> tuple[int, int] | None:
    """(in use, in all) of the process's pthread key slots, read from the host libc's
    table of them, or None where glibc does not describe that table as this expects.

    Reads glibc's private ``__pthread_keys``, laid out as its thread_db descriptors say
    (each entry a sequence number, odd while the key is in use, then a destructor).
    """
    table = _descriptor("_thread_db___pthread_keys")
    seq = _descriptor("_thread_db_pthread_key_struct_seq")
    try:
        address = ctypes.addressof(ctypes.c_char.in_dll(_libc, "__pthread_keys"))
    except ValueError:
        return None
    if table is None or seq is None:
        return None
    entry_bits, count, _ = table
    seq_bits, _, seq_offset = seq
    if entry_bits % 8 or seq_bits != 64 or not 0 < count <= 1 << 16:
        return None
    step = entry_bits // 8
    in_use = sum(ctypes.c_uint64.from_address(address + i * step + seq_offset).value & 1
                 for i in range(count))
    return in_use, count


def environment() -> int:
    """The address of the host's array of environment strings, as it is now (glibc's
    ``environ``, which setenv may move)."""
    return ctypes.c_void_p.in_dll(_libc, "environ").value


def file_of(address: int) -> str | None:
    """The file of the loaded library that holds address, or None."""
    info = _DlInfo()
    if not _dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def glibc_version() -> str:
    return platform.libc_ver()[1] or "unknown"


#: What importing torch adds to a namespace's static TLS: libgomp's initial-exec TLS
#: (120 bytes), aligned.  An estimate: glibc also places other libraries' TLS in the
#: area while it lasts.  Measured with glibc's defaults: 6 interpreters that import torch
#: fit (this says 6), and with nns=8, 10 (this says 11; docs/design.md, "Static TLS").
_TORCH_STATIC_TLS = 128

_PT_DYNAMIC, _PT_TLS, _DT_FLAGS, _DF_STATIC_TLS = 2, 7, 30, 0x10


def _tunable(tunables: dict[str, str], name: str, default: int) -> int:
    try:
        return int(tunables.get(name, str(default)), 0)
    except ValueError:
        return default


def _descriptor(name: str) -> tuple[int, int, int] | None:
    """One of glibc's thread_db descriptors (bits or size, count, offset), or None."""
    try:
        return tuple((ctypes.c_uint32 * 3).in_dll(_libc, name))
    except ValueError:
        return None


def _measure_free_static_tls() -> int | None:
    """On a thread started after every library was loaded: the bytes of static TLS that
    glibc can still place libraries in, or None where glibc does not say.

    A new thread's DTV (glibc's table of where each module's TLS block is) points into
    the thread's static TLS area for every block placed there, in every namespace; the
    lowest of them, or the rseq area where glibc keeps it below the thread pointer
    (2.42 and later), marks the area's used end.
    """
    report = _host.static_tls()
    tcb, dtv_at = _descriptor("_thread_db_sizeof_pthread"), _descriptor("_thread_db_pthread_dtvp")
    entry, value = _descriptor("_thread_db_dtv_dtv"), _descriptor("_thread_db_dtv_t_pointer_val")
    if report is None or None in (tcb, dtv_at, entry, value) or entry[0] % 64:
        return None
    size, pointer = report
    area = size - tcb[0]  # the thread's static TLS blocks lie in [pointer - area, pointer)
    step = entry[0] // 8
    dtv = ctypes.c_uint64.from_address(pointer + dtv_at[2]).value
    length = ctypes.c_uint64.from_address(dtv - step).value  # its entry -1 counts the rest
    used = 0
    for module in range(1, length + 1):
        block = ctypes.c_uint64.from_address(dtv + module * step + value[2]).value
        if pointer - area <= block < pointer:
            used = max(used, pointer - block)
    try:
        rseq = ctypes.c_ssize_t.in_dll(_libc, "__rseq_offset").value
    except ValueError:
        rseq = 0
    return area - max(used, -rseq)


def _free_static_tls() -> int | None:
    measured: list[int | None] = []
    thread = threading.Thread(target=lambda: measured.append(_measure_free_static_tls()),
                              name="multipy-static-tls")
    thread.start()
    thread.join()
    return measured[0] if measured else None


def _static_tls_block(path: str) -> tuple[int, int, int] | None:
    """The (size, alignment, first-byte offset) that the ELF object at path takes from
    static TLS when it is loaded after start (it has initial-exec TLS), else None."""
    with open(path, "rb") as elf:
        header = elf.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2:  # 64-bit objects only
            return None
        (table,) = struct.unpack_from("<Q", header, 32)  # e_phoff, then e_phentsize, e_phnum
        entry_size, count = struct.unpack_from("<HH", header, 54)
        elf.seek(table)
        entries = [struct.unpack_from("<IIQQQQQQ", elf.read(entry_size))
                   for _ in range(count)]
        tls = next((e for e in entries if e[0] == _PT_TLS), None)
        dynamic = next((e for e in entries if e[0] == _PT_DYNAMIC), None)
        if tls is None or dynamic is None:
            return None
        elf.seek(dynamic[2])
        tags = struct.iter_unpack("<qQ", elf.read(dynamic[5]))
        flags = next((v for tag, v in tags if tag == _DT_FLAGS), 0)
    if not flags & _DF_STATIC_TLS:
        return None  # dynamic TLS, allocated per thread outside the area
    _, _, _, vaddr, _, _, memsz, align = tls
    align = max(align, 1)
    return memsz, align, vaddr & (align - 1)


@functools.cache
def _namespace_blocks() -> tuple[tuple[int, int, int], ...]:
    """The static TLS blocks a bare interpreter's namespace takes, in load order."""
    libc = file_of(ctypes.cast(_dlmopen, ctypes.c_void_p).value)
    paths = [libc] if libc else []
    with contextlib.suppress(UnsupportedPythonError):
        paths.append(libpython_path())
    blocks = (_static_tls_block(path) for path in paths)
    return tuple(block for block in blocks if block)


def _place(free: int, block: tuple[int, int, int]) -> int | None:
    """What is left of free bytes after glibc places block in them, or None if it cannot
    (glibc's _dl_try_allocate_static_tls: the block ends where its alignment allows)."""
    size, align, first = block
    if free < size + first:
        return None
    return (free - size - first) // align * align + first


def namespaces_that_fit(started: int) -> int:
    """How many more interpreters this process can start, having started ``started``.

    Bare interpreters are bounded by the static TLS area that glibc sized at exec time
    (by the tunables) and by what the process has placed in it so far, both as glibc
    reports them now; libraries with initial-exec TLS, such as torch's libgomp, take
    more of it, which the interpreter reports when it imports them.  Where glibc does
    not report its static TLS, only the namespace limit bounds the answer.
    """
    limit = max(0, MAX_NAMESPACES - started)
    free = _free_static_tls()
    if free is None:
        return limit
    for fit in range(limit):
        for block in _namespace_blocks():
            free = _place(free, block)
            if free is None:
                return fit
    return limit


def static_tls_room() -> tuple[int, int] | None:
    """(bytes of static TLS free now, bytes a bare interpreter takes of them), as glibc
    reports them, or None where it does not."""
    free = _free_static_tls()
    if free is None:
        return None
    return free, sum(-(-size // align) * align for size, align, _ in _namespace_blocks())


def torch_interpreters_that_fit() -> int:
    """About how many interpreters that import torch this process can still start (an
    estimate: see _TORCH_STATIC_TLS)."""
    room = static_tls_room()
    if room is None:
        return MAX_NAMESPACES
    free, each = room
    return min(MAX_NAMESPACES, free // (each + _TORCH_STATIC_TLS))


def static_tls_advice() -> str:
    """How to get more room for interpreters, given the tunables in force."""
    optional = _tunable(tunables_at_start(), "glibc.rtld.optional_static_tls", 512)
    if optional < LAUNCH_STATIC_TLS:
        return (f"glibc sized this process's room for interpreters and the libraries they "
                f"load when it started (about {torch_interpreters_that_fit()} that import "
                f"torch fit). For room for {MAX_NAMESPACES}: call multipy.make_room() first "
                f"thing in the program, or start it with `multipy run SCRIPT`, or put "
                f"GLIBC_TUNABLES={LAUNCH_TUNABLES} in its environment (a systemd unit: "
                f"Environment=GLIBC_TUNABLES=...; a Dockerfile: ENV GLIBC_TUNABLES=...)")
    return (f"this process has no static TLS left even with "
            f"glibc.rtld.optional_static_tls={optional}; start it with a larger value in "
            f"GLIBC_TUNABLES (for example {optional * 4})")
