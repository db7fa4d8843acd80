"""Builds multipy's C bootstrap; all other metadata lives in pyproject.toml."""
from setuptools import Extension, setup

# A plain shared library loaded into each interpreter's namespace with dlmopen, never
# imported: it resolves Py* symbols from that namespace's libpython.
setup(ext_modules=[Extension("multipy._bootstrap", ["multipy/_bootstrap.c"])])
