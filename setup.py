"""Builds multipy's C; all other metadata lives in pyproject.toml."""
import platform

from setuptools import Extension, setup

HEADERS = ["multipy/_entry.h", "multipy/_dlpack.h", "multipy/_lend.h", "multipy/_plain.h"]  # shared by both

extensions = [
    # The host's side: an ordinary extension module (multipy._host).
    Extension("multipy._host", ["multipy/_host.c"], depends=[*HEADERS, "multipy/_occupancy.h"]),
    # A plain shared library loaded into each interpreter's namespace with dlmopen,
    # never imported: it resolves Py* symbols from that namespace's libpython.
    Extension("multipy._bootstrap", ["multipy/_bootstrap.c"], depends=HEADERS),
]
# The root object of each namespace (docs/design.md, "pthread keys"; it also gives the
# namespace a dlopen without RTLD_GLOBAL, "RTLD_GLOBAL", and a free that gives the host
# what is the host's, "Stacks from another libc"): a plain shared library, built without
# libpython.  The host loads a copy of it that needs the running CPython's libpython by its
# path (multipy/_root.py, "libpython first"), written into a spare entry of its dynamic
# section, which GNU ld leaves (named here, since the host relies on it).
extensions.append(Extension(
    "multipy._keys", ["multipy/_keys.c", "multipy/_dlopen.c", "multipy/_free.c"], libraries=["dl"],
    extra_link_args=["-Wl,--no-as-needed", "-Wl,--spare-dynamic-tags=5"]))
if platform.machine() == "x86_64":
    # Libraries each interpreter reaches in the host's namespace instead of loading its own
    # (docs/design.md, "CUDA" and "One copy per process"): plain shared libraries with the
    # real one's soname, whose x86-64 trampolines (_forward.h) jump to the host's copy.
    # Elsewhere they are not built, and interpreters load their own (and get no driver).
    extensions.append(Extension(
        "multipy._cuda_forward", ["multipy/_cuda_forward.c"],
        depends=["multipy/_forward.h", "multipy/_cuda_names.h"], libraries=["dl"],
        extra_link_args=["-Wl,-soname,libcuda.so.1"]))
    # These carry their real library's one symbol version, named as its soname, which
    # the libraries that need them require.
    for name, soname in [("cublaslt", "libcublasLt.so.13"), ("nvrtc", "libnvrtc.so.13"),
                         ("nvjitlink", "libnvJitLink.so.13")]:
        extensions.append(Extension(
            f"multipy._{name}_forward", [f"multipy/_{name}_forward.c"],
            depends=["multipy/_forward.h", f"multipy/_{name}_names.h"], libraries=["dl"],
            extra_link_args=[f"-Wl,-soname,{soname}", "-Wl,--default-symver"]))

setup(ext_modules=extensions)
