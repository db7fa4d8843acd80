"""The host's view of glibc: link-map namespaces (dlmopen) and the tunables that size them.

Everything here runs in the host process and its main namespace.  docs/design.md
explains each limit this module reports.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sysconfig

from . import _host
from ._launch import LAUNCH_STATIC_TLS, LAUNCH_TUNABLES, tunables_at_start
from .errors import UnsupportedPythonError

LM_ID_NEWLM = -1
RTLD_NOW = 0x2
RTLD_DI_LMID = 1

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
    """Path of the running CPython's shared libpython, or UnsupportedPythonError saying why not."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise UnsupportedPythonError(
            f"multipy needs a CPython built with --enable-shared (a shared libpython), "
            f"and {platform.python_implementation()} {platform.python_version()} at "
            f"{os.path.realpath(os.sys.executable)} was built without it. Use a build with "
            f"libpython{sysconfig.get_python_version()}.so: Debian/Ubuntu's python3 packages, "
            f"conda, or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared.")
    name = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
    for directory in (sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LIBPL")):
        path = os.path.join(directory or "", name)
        if os.path.exists(path):
            return path
    raise UnsupportedPythonError(
        f"the shared library {name} of this CPython was not found in "
        f"{sysconfig.get_config_var('LIBDIR')}; reinstall Python with its libpython")


def open_namespace(root: str) -> tuple[int, int]:
    """Loads root as the root object of a new namespace; returns (handle, namespace id)."""
    handle = _dlmopen(LM_ID_NEWLM, root.encode(), RTLD_NOW)
    if not handle:
        raise _fail(f"dlmopen({root})")
    lmid = ctypes.c_long()
    if _dlinfo(handle, RTLD_DI_LMID, ctypes.byref(lmid)) != 0:
        raise _fail("dlinfo(RTLD_DI_LMID)")
    return handle, lmid.value


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


def process_keys() -> tuple[int, int] | None:
    """(in use, in all) of the process's pthread key slots, read from the host libc's
    table of them, or None where glibc does not describe that table as this expects.

    Reads glibc's private ``__pthread_keys``, laid out as its thread_db descriptors say
    (each entry a sequence number, odd while the key is in use, then a destructor).
    """
    try:
        table = (ctypes.c_uint32 * 3).in_dll(_libc, "_thread_db___pthread_keys")
        seq = (ctypes.c_uint32 * 3).in_dll(_libc, "_thread_db_pthread_key_struct_seq")
        address = ctypes.addressof(ctypes.c_char.in_dll(_libc, "__pthread_keys"))
    except ValueError:
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


#: glibc 2.3x on x86-64 reserves static TLS for (nns - 1) libc copies at this size ...
_LIBC_IE_TLS = 192
#: ... and for nns other libraries at this size, plus optional_static_tls.
_OTHER_IE_TLS = 144
#: What one bare interpreter's namespace takes from that reserve: its libc's TLS block.
_NAMESPACE_STATIC_TLS = 144
#: What importing torch adds: libgomp's initial-exec TLS (120 bytes), aligned.  An
#: estimate: glibc also places other libraries' TLS in the reserve while it lasts.
#: Measured with glibc's defaults: 6 interpreters that import torch fit (this says 6),
#: and with nns=8, 10 (this says 11; docs/design.md, "Static TLS").
_TORCH_STATIC_TLS = 128


def _tunable(tunables: dict[str, str], name: str, default: int) -> int:
    try:
        return int(tunables.get(name, str(default)), 0)
    except ValueError:
        return default


def _reserve() -> int:
    """The static TLS glibc reserved at exec time for namespaces' libraries, in bytes."""
    tunables = tunables_at_start()
    nns = min(_tunable(tunables, "glibc.rtld.nns", 4), MAX_NAMESPACES + 1)
    optional = _tunable(tunables, "glibc.rtld.optional_static_tls", 512)
    return (nns - 1) * _LIBC_IE_TLS + nns * _OTHER_IE_TLS + optional


def namespaces_that_fit(started: int) -> int:
    """How many more interpreters this process can start, having started ``started``.

    The static TLS reserve, fixed at exec time by the tunables, bounds bare interpreters
    (11 with glibc's defaults); libraries with initial-exec TLS, such as torch's libgomp,
    take more of it, which the interpreter reports when it imports them.
    """
    return max(0, min(MAX_NAMESPACES, _reserve() // _NAMESPACE_STATIC_TLS) - started)


def torch_interpreters_that_fit() -> int:
    """About how many interpreters that import torch a fresh process with these tunables
    holds (an estimate: see _TORCH_STATIC_TLS)."""
    return min(MAX_NAMESPACES, _reserve() // (_NAMESPACE_STATIC_TLS + _TORCH_STATIC_TLS))


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
