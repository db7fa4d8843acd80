"""Builds multipy's C; all other metadata lives in pyproject.toml."""
import platform

from setuptools import Extension, setup

HEADERS = ["multipy/_entry.h", "multipy/_dlpack.h", "multipy/_lend.h", "multipy/_plain.h"]  # shared by both

extensions = [
    # The host's side: an ordinary extension module (multipy._host).
    Extension("multipy._host", ["multipy/_host.c"], depends=HEADERS),
    # A plain shared library loaded into each interpreter's namespace with dlmopen,
    # never imported: it resolves Py* symbols from that namespace's libpython.
    Extension("multipy._bootstrap", ["multipy/_bootstrap.c"], depends=HEADERS),
]
if platform.machine() == "x86_64":
    # The CUDA driver each interpreter sees (docs/design.md, "CUDA"): a plain shared
    # library named libcuda.so.1 whose x86-64 trampolines jump to the host's driver.
    # Elsewhere it is not built, and interpreters get no forwarder.
    extensions.append(Extension(
        "multipy._cuda_forward", ["multipy/_cuda_forward.c"], depends=["multipy/_cuda_names.h"],
        libraries=["dl"], extra_link_args=["-Wl,-soname,libcuda.so.1"]))

setup(ext_modules=extensions)
