"""The host's CUDA driver, and the forwarder that gives every interpreter that one driver.

A process can use one CUDA driver, not one per namespace; each interpreter therefore gets
``_cuda_forward``, a library named ``libcuda.so.1`` whose every entry point jumps to the
driver loaded here, in the host's namespace (docs/design.md, "CUDA").  Without a driver
nothing is loaded anywhere.  Standard library only.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util

#: The driver's soname: what CUDA runtimes load, and the forwarder's own soname.
DRIVER = "libcuda.so.1"


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


def forwarder() -> str | None:
    """Path of the forwarder to load into each new interpreter's namespace before any
    code runs there: None when the host has no driver, or when the forwarder is not
    built (it is built on x86-64 only)."""
    if driver() is None:
        return None
    spec = importlib.util.find_spec("multipy._cuda_forward")
    return spec.origin if spec is not None and spec.origin else None


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
