"""Every interpreter runs on the running CPython's own libpython, found at run time, not
on one that multipy was built against (docs/design.md, "libpython first")."""
from __future__ import annotations

import os

import pytest

from multipy import _glibc, _root
from multipy._runtime import _library_path
from multipy.errors import InterpreterStartError


def _mapped_libpythons() -> dict[str, int]:
    """Each libpython file mapped in this process, and how many times it was loaded (its
    mappings at file offset 0: one per namespace, and the host's own)."""
    loads: dict[str, int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libpython"):
                loads[fields[5]] = loads.get(fields[5], 0) + (int(fields[2], 16) == 0)
    return loads


def test_interpreters_map_this_cpythons_libpython(manager):
    expected = os.path.realpath(_glibc.libpython_path())
    loads = _mapped_libpythons()
    assert set(loads) == {expected}, loads
    # the host maps it too when it runs on it (pyenv's, python.org's), not when it is
    # linked statically (Debian's python3)
    host = _glibc.file_of(_glibc.symbol(0, "Py_Initialize")) == expected
    assert loads[expected] >= len(manager) + host


def test_the_root_copy_names_libpython_by_path():
    with open(_library_path("_keys"), "rb") as file:
        image = file.read()
    copy = _root.with_libpython(image, "/opt/python/lib/libpython3.11.so.1.0")
    assert len(copy) == len(image) and b"/opt/python/lib/libpython3.11.so.1.0\0" in copy
    with pytest.raises(InterpreterStartError, match="no slot"):
        _root.with_libpython(image.replace(_root._SLOT_MARK, b"x" * len(_root._SLOT_MARK)), "/x")
