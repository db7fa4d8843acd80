"""Builds multipy's C; all other metadata lives in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[
    # The host's side: an ordinary extension module (multipy._host).
    Extension("multipy._host", ["multipy/_host.c"], depends=["multipy/_entry.h", "multipy/_dlpack.h"]),
    # A plain shared library loaded into each interpreter's namespace with dlmopen,
    # never imported: it resolves Py* symbols from that namespace's libpython.
    Extension("multipy._bootstrap", ["multipy/_bootstrap.c"], depends=["multipy/_entry.h", "multipy/_dlpack.h"]),
])
