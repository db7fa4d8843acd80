"""The host's CUDA driver and CUDA libraries, which every interpreter reaches through
forwarders instead of loading its own.

A process can use one CUDA driver, not one per namespace; each interpreter therefore gets
``_cuda_forward``, a library named ``libcuda.so.1`` whose every entry point jumps to the
driver loaded here, in the host's namespace (docs/design.md, "CUDA").  Without a driver
nothing is loaded anywhere.  Some CUDA libraries cost each namespace that loads them a
copy of their data; those in ``FORWARDERS`` are kept once, in the host's namespace, and
an interpreter's dlopen of one gets its forwarder (docs/design.md, "One copy per
process").  ``call``, ``primary_context`` and ``DeviceCopy`` use the driver directly,
on either side (in an interpreter, through its forwarder), without torch.  Standard
library only.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib.util
import os
import struct
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

#: The driver's soname: what CUDA runtimes load, and the forwarder's own soname.
DRIVER = "libcuda.so.1"

#: Libraries that every interpreter reaches in the host's namespace: each one's soname,
#: and the module of multipy's forwarder of that soname.
FORWARDERS = {"libcublasLt.so.13": "multipy._cublaslt_forward",
              "libnvrtc.so.13": "multipy._nvrtc_forward",
              "libnvJitLink.so.13": "multipy._nvjitlink_forward"}

#: Set to 0, every interpreter loads its own copy of the libraries in FORWARDERS.
FORWARD_VARIABLE = "MULTIPY_FORWARD_LIBRARIES"


@functools.cache
def driver() -> ctypes.CDLL | None:
    """The CUDA driver in the host's namespace, loaded now if it was not (the same copy
    if it was, by torch for instance), or None if this machine has none that loads.
    Never raises."""
    try:
        return ctypes.CDLL(DRIVER)
    except OSError:
        return None


def driver_version() -> int | None:
    """The driver's cuDriverGetVersion (12040 for CUDA 12.4), or None without a driver
    or if it does not answer."""
    cuda = driver()
    if cuda is None:
        return None
    version = ctypes.c_int()
    try:
        failed = cuda.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:  # a library of that name that is no CUDA driver
        return None
    return None if failed else version.value


def call(name: str, *args: Any) -> None:
    """Calls the driver's function name with args; RuntimeError, naming the function and
    the driver's error, if it fails or there is no driver."""
    cuda = driver()
    if cuda is None:
        raise RuntimeError(f"no CUDA driver to call {name}: this machine has none that loads")
    code = getattr(cuda, name)(*args)
    if code:
        text = ctypes.c_char_p()
        cuda.cuGetErrorString(code, ctypes.byref(text))
        raise RuntimeError(f"the CUDA driver's {name} failed with error {code}"
                           + (f" ({text.value.decode()})" if text.value else ""))


#: device ordinal -> its primary context (CUcontext), retained for the process's life:
#: the context torch's CUDA runtime uses, in the host and in every interpreter.
_primary_contexts: dict[int, ctypes.c_void_p] = {}
_retaining = threading.Lock()


@contextlib.contextmanager
def primary_context(device: int) -> Iterator[None]:
    """Makes the primary context of CUDA device ``device`` (an ordinal) current on this
    thread for the block, whichever thread it is; RuntimeError if the driver refuses."""
    with _retaining:
        context = _primary_contexts.get(device)
        if context is None:
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            call("cuInit", 0)
            call("cuDeviceGet", ctypes.byref(handle), device)
            call("cuDevicePrimaryCtxRetain", ctypes.byref(context), handle)
            _primary_contexts[device] = context
    call("cuCtxPushCurrent_v2", context)
    try:
        yield
    finally:
        driver().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


class DeviceCopy:
    """Copies of host buffers in the memory of CUDA device ``device`` (an ordinal), made
    through the driver in the device's primary context, which torch uses too: one
    allocation, each buffer at an offset aligned to 256 bytes, copied before the
    constructor returns.  ``places`` maps each buffer's name to (device address, size);
    an empty buffer gets (0, 0).  ``close()`` frees the memory (once; later calls do
    nothing).  RuntimeError if there is no driver or it refuses (nothing is kept then).

    buffers: name -> an object of the buffer protocol, C-contiguous (a numpy array)."""

    def __init__(self, buffers: Mapping[str, Any], device: int = 0) -> None:
        self.device = device
        self.places: dict[str, tuple[int, int]] = {}
        views = {name: memoryview(buffer).cast("B") for name, buffer in buffers.items()}
        offsets, total = {}, 0
        for name, view in views.items():
            if view.nbytes:
                offsets[name], total = total, total + (view.nbytes + 255) // 256 * 256
        self._base = ctypes.c_uint64()
        with primary_context(device):
            if total:
                call("cuMemAlloc_v2", ctypes.byref(self._base), ctypes.c_size_t(total))
            try:
                for name, view in views.items():
                    if not view.nbytes:
                        self.places[name] = (0, 0)
                        continue
                    address = self._base.value + offsets[name]
                    buffer = ctypes.c_char * view.nbytes  # (a read-only one copied first)
                    source = buffer.from_buffer_copy(view) if view.readonly else \
                        buffer.from_buffer(view)
                    call("cuMemcpyHtoD_v2", ctypes.c_uint64(address), source,
                         ctypes.c_size_t(view.nbytes))
                    self.places[name] = (address, view.nbytes)
                call("cuCtxSynchronize")  # a copy from pageable memory may still be in flight
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        base, self._base = self._base, ctypes.c_uint64()
        if base.value:
            with primary_context(self.device):
                call("cuMemFree_v2", base)


def _module_path(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None and spec.origin else None


def forwarder() -> str | None:
    """Path of the forwarder to load into each new interpreter's namespace before any
    code runs there: None when the host has no driver, or when the forwarder is not
    built (it is built on x86-64 only)."""
    if driver() is None:
        return None
    return _module_path("multipy._cuda_forward")


@functools.cache
def exported_symbols(path: str) -> frozenset[str]:
    """The names that the shared library at path exports: the defined global and weak
    symbols of its dynamic symbol table (functions, data, any kind), without their
    versions, less the absolute ones that name a version.  Empty for a file that is no
    64-bit little-endian ELF file.  Raises OSError if it cannot be read."""
    with open(path, "rb") as library:
        header = library.read(64)
        if len(header) < 64 or header[:6] != b"\x7fELF\x02\x01":
            return frozenset()
        (table,), (size, count) = struct.unpack_from("<Q", header, 0x28), struct.unpack_from(
            "<HH", header, 0x3A)
        library.seek(table)
        raw = library.read(size * count)
        # Each section: name, type, flags, address, offset, size, link, ...
        sections = [struct.unpack_from("<IIQQQQI", raw, i * size) for i in range(count)]
        for _, kind, _, _, offset, length, link in sections:
            if kind != 11:  # SHT_DYNSYM
                continue
            library.seek(offset)
            symbols = library.read(length)
            library.seek(sections[link][4])
            names = library.read(sections[link][5])
            exported = set()
            for at in range(0, len(symbols), 24):  # Elf64_Sym
                name, info, _, section = struct.unpack_from("<IBBH", symbols, at)
                if section not in (0, 0xFFF1) and info >> 4 in (1, 2):  # UNDEF, ABS; GLOBAL, WEAK
                    exported.add(names[name:names.index(b"\0", name)].decode())
            return frozenset(exported)
    return frozenset()


def forwarded_libraries() -> list[tuple[str, str]]:
    """(library, its forwarder), resolved paths, for each installed copy of a library in
    FORWARDERS that interpreters should reach in the host's namespace: those found as
    torch finds them (``nvidia/*/lib/`` under an entry of sys.path) whose every exported
    name the forwarder has (it has functions only).  Empty when MULTIPY_FORWARD_LIBRARIES
    is 0 or no forwarder is built."""
    if os.environ.get(FORWARD_VARIABLE, "1").strip() == "0":
        return []
    found = []
    for soname, module in FORWARDERS.items():
        stub = _module_path(module)
        if stub is None:
            continue
        for entry in sys.path:
            for path in glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", soname)):
                real = os.path.realpath(path)
                try:
                    covered = exported_symbols(real) <= exported_symbols(stub)
                except OSError:
                    continue
                if covered and (real, stub) not in found:
                    found.append((real, stub))
    return found


def describe() -> str:
    """One line for ``multipy info``: whether there is a driver, its version, and
    whether interpreters share it."""
    if driver() is None:
        return "none (CPU only)"
    version = driver_version()
    found = (f"found, version {version // 1000}.{version % 1000 // 10}" if version is not None
             else "found, version unknown (cuDriverGetVersion failed)")
    if forwarder() is None:
        return (f"{found}; multipy's forwarder is not built (it is on x86-64 only), so "
                f"CUDA works in one namespace at most, the host's or one interpreter's")
    return f"{found} (forwarded to every interpreter)"
