"""The host's CUDA driver, forwarded to every interpreter (docs/design.md, "CUDA").

Tested on CPU with a fake driver built here: a library named libcuda.so.1 that counts
its calls, found through LD_LIBRARY_PATH.  Each scenario starts its own interpreters,
so it runs in a fresh process, with a timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HANG = 90

pytestmark = pytest.mark.timeout(HANG + 30)

NAMES = Path(__file__).resolve().parent.parent / "multipy" / "_cuda_names.h"
FORWARDER = importlib.util.find_spec("multipy._cuda_forward")
needs_forwarder = pytest.mark.skipif(FORWARDER is None,
                                     reason="the forwarder is built on x86-64 only")

FAKE_DRIVER = r"""
#include <stdlib.h>
#include <string.h>
static int calls, contexts, allocations, frees;

int cuInit(unsigned int flags) { __atomic_fetch_add(&calls, 1, __ATOMIC_SEQ_CST); return flags; }
int cuDriverGetVersion(int *version) { *version = 12040; return 0; }
int cuDeviceGetCount(int *count) { *count = 3; return 0; }
int fake_calls(void) { return calls; }

/* Device memory is host memory here; at most 1 MiB at a time. */
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal < 3 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void **context, int device) { *context = (void *)(long)(device + 1); return 0; }
int cuCtxPushCurrent_v2(void *context) { contexts++; return 0; }
int cuCtxPopCurrent_v2(void **context) { contexts--; return 0; }
int cuCtxSynchronize(void) { return 0; }
int cuMemAlloc_v2(unsigned long long *address, size_t size)
{
    if (size > (1 << 20)) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    allocations++;
    *address = (unsigned long long)malloc(size);
    return 0;
}
int cuMemcpyHtoD_v2(unsigned long long address, const void *from, size_t size)
{
    memcpy((void *)address, from, size);
    return 0;
}
int cuMemFree_v2(unsigned long long address) { frees++; free((void *)address); return 0; }
int cuGetErrorString(int error, const char **text) { *text = error == 2 ? "out of memory" : 0; return 0; }
int fake_memory(void) { return allocations * 1000 + frees * 10 + contexts; }
"""

#: Registered in each interpreter: what the CUDA driver looks like from inside.
PROBE = r"""
import ctypes
import os


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


def loaded():
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def probe():
    cuda = loaded()  # there before any code ran here
    if cuda is None:
        return None
    count = ctypes.c_int()
    where = _DlInfo()
    ctypes.CDLL("libc.so.6").dladdr(ctypes.cast(cuda.cuInit, ctypes.c_void_p), ctypes.byref(where))
    return {"init": cuda.cuInit(0), "devices": cuda.cuDeviceGetCount(ctypes.byref(count)),
            "count": count.value, "missing": cuda.cuModuleLoad(None, None),
            "path": os.path.realpath(where.fname.decode()),
            "fake_visible": hasattr(cuda, "fake_calls")}
"""

#: Starts two interpreters, probes each, and prints what the host saw, as JSON.
SCENARIO = f"""
import ctypes, json, os
import multipy
from multipy import _cuda

with multipy.InterpreterManager(2) as manager:
    manager.register_module_source("cuda_probe", {PROBE!r})
    seen = []
    for interpreter in manager.all_instances():
        with interpreter.acquire_session() as s:
            seen.append(s.global_("cuda_probe", "probe")().deref())
host = _cuda.driver()
print("RESULT", json.dumps({{
    "seen": seen,
    "driver": host is not None,
    "calls": host.fake_calls() if hasattr(host, "fake_calls") else None,
    "forwarder": os.path.realpath(_cuda.forwarder()) if _cuda.forwarder() else None,
}}))
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> dict[str, str]:
    """The environment that finds the fake driver: LD_LIBRARY_PATH at its directory."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake CUDA driver")
    directory = tmp_path_factory.mktemp("fake_cuda")
    (directory / "fake_cuda.c").write_text(FAKE_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(directory / "libcuda.so.1"), str(directory / "fake_cuda.c")],
                   check=True, capture_output=True, timeout=60)
    search = [str(directory), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return {"LD_LIBRARY_PATH": os.pathsep.join(search)}


def _result(completed: subprocess.CompletedProcess) -> dict:
    assert completed.returncode == 0, completed.stderr
    line = next(text for text in completed.stdout.splitlines() if text.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _info(env: dict[str, str] | None = None) -> str:
    completed = subprocess.run([sys.executable, "-m", "multipy", "info"], capture_output=True,
                               text=True, timeout=HANG, env={**os.environ, **(env or {})})
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


@needs_forwarder
def test_every_interpreter_reaches_the_one_driver_of_the_host(python, fake_driver):
    result = _result(python(SCENARIO, env=fake_driver, timeout=HANG))
    assert result["forwarder"] == os.path.realpath(FORWARDER.origin)
    assert len(result["seen"]) == 2
    for seen in result["seen"]:
        assert seen is not None, "no libcuda.so.1 was loaded in the interpreter"
        assert seen["path"] == result["forwarder"]  # the forwarder, not a copy of the driver
        assert not seen["fake_visible"]
        assert (seen["init"], seen["devices"], seen["count"]) == (0, 0, 3)
        assert seen["missing"] == 500  # CUDA_ERROR_NOT_FOUND: the fake has no cuModuleLoad
    assert result["calls"] == 2  # both interpreters' cuInit reached the host's copy


@needs_forwarder
def test_info_reports_the_driver_version(fake_driver):
    assert re.search(r"^CUDA driver: +found, version 12\.4 \(forwarded to every interpreter\)$",
                     _info(fake_driver), re.MULTILINE)


def test_without_a_driver_nothing_is_loaded(python):
    result = _result(python(SCENARIO, timeout=HANG))
    if result["driver"]:
        pytest.skip("this machine has a CUDA driver")
    assert result["seen"] == [None, None]  # no libcuda.so.1 in either namespace
    assert result["forwarder"] is None
    assert re.search(r"^CUDA driver: +none \(CPU only\)$", _info(), re.MULTILINE)


@needs_forwarder
def test_the_forwarder_exports_every_listed_name_and_forwards_nothing_in_the_host(python):
    # Loaded in the host's own namespace, libcuda.so.1 could name the forwarder itself,
    # and every call would jump to itself forever: it forwards nothing there instead.
    names = re.findall(r"^NAME\((\w+)\)$", NAMES.read_text(), re.MULTILINE)
    assert {"cuInit", "cuDriverGetVersion", "cuGetProcAddress", "cuGetProcAddress_v2",
            "cuMemAlloc_v2", "cuGetExportTable", "cuLaunchKernel"} <= set(names)
    result = _result(python(f"""
        import ctypes, json
        forwarder = ctypes.CDLL({FORWARDER.origin!r})
        print("RESULT", json.dumps({{n: getattr(forwarder, n)() for n in {names!r}}}))
    """, timeout=HANG))
    assert result == {name: 500 for name in names}


DEVICE_COPY = """
import ctypes, gc, json
import numpy as np
from multipy import _cuda
from multipy.serve.host import archive

host = _cuda.driver()
buffers = {"a": np.arange(10, dtype=np.uint8), "empty": np.zeros(0, np.uint8),
           "b": np.frombuffer(b"weights", np.uint8)}  # (read-only)
copy = _cuda.DeviceCopy(buffers, 1)
base = min(address for address, size in copy.places.values() if size)  # (the fake's malloc)
seen = {name: [(address - base) % 256 == 0 if size else address == 0,  # aligned; empty: (0, 0)
               list(ctypes.string_at(address, size)) if size else []]
        for name, (address, size) in copy.places.items()}
after_copy = host.fake_memory()
copy.close()
copy.close()
after_close = host.fake_memory()
try:
    _cuda.DeviceCopy({"big": np.zeros(2 << 20, np.uint8)})
    refused = None
except RuntimeError as error:
    refused = str(error)
places, device, keeper = archive.on_device(buffers, "cuda:2")
before_drop = host.fake_memory()
del keeper
gc.collect()
print("RESULT", json.dumps({"seen": seen, "after_copy": after_copy, "after_close": after_close,
                            "refused": refused, "device": device, "before_drop": before_drop,
                            "after_drop": host.fake_memory()}))
"""


def test_a_device_copy_holds_the_bytes_until_it_is_closed_or_its_keeper_dies(python, fake_driver):
    pytest.importorskip("numpy")  # (the buffers here, and the keeper, are arrays)
    result = _result(python(DEVICE_COPY, env=fake_driver, timeout=HANG))
    assert result["seen"] == {"a": [True, list(range(10))], "empty": [True, []],
                              "b": [True, list(b"weights")]}
    # fake_memory: allocations * 1000 + frees * 10 + contexts current: one allocation,
    # freed once by two closes, the context popped after each use
    assert (result["after_copy"], result["after_close"]) == (1000, 1010)
    assert result["refused"] == ("the CUDA driver's cuMemAlloc_v2 failed with error 2 "
                                 "(out of memory)")
    assert result["device"] == "cuda:2"
    assert (result["before_drop"], result["after_drop"]) == (2010, 2020)


ARCHIVE_ON_DEVICE = """
import ctypes, json, zipfile
from multipy.serve.host import archive

path = PATH
with zipfile.ZipFile(path, "w") as out:  # as torch writes them, and one it does not
    out.writestr("model/.data/version", "3")
    out.writestr("model/.data/0.storage", bytes(range(100)), zipfile.ZIP_STORED)
    out.writestr("model/.data/1.storage", b"", zipfile.ZIP_STORED)
    out.writestr("model/.data/2.storage", b"packed" * 50, zipfile.ZIP_DEFLATED)
spans = archive.records(path)
places, device, keeper = archive.on_device(archive.storages(path, spans), "cuda:1")
print("RESULT", json.dumps({"names": sorted(spans), "device": device, "copied": {
    name: list(ctypes.string_at(address, size)) if size else [] for name, (address, size)
    in places.items()}}))
"""


def test_an_archives_records_are_found_and_copied_to_the_device_once(python, fake_driver,
                                                                     tmp_path):
    """The host finds the uncompressed storage records of an archive (a compressed one
    is left to each interpreter's importer) and copies them to the device from its
    mapping of the file."""
    pytest.importorskip("numpy")  # (the keeper is an array)
    code = ARCHIVE_ON_DEVICE.replace("PATH", repr(str(tmp_path / "model.pt")))
    result = _result(python(code, env=fake_driver, timeout=HANG))
    assert result["names"] == [".data/0.storage", ".data/1.storage"]
    assert result["device"] == "cuda:1"
    assert result["copied"] == {".data/0.storage": list(range(100)), ".data/1.storage": []}


def test_serve_on_a_cuda_device_needs_a_driver_and_says_which_devices(tmp_path):
    pytest.importorskip("uvicorn")  # (the serve extra)
    for device, said in (("gpu", "--device must be cpu, cuda or cuda:N (a GPU's index), not 'gpu'"),
                         ("cuda:0", "--device cuda:0: this machine has no CUDA driver that loads")):
        completed = subprocess.run(
            [sys.executable, "-m", "multipy", "serve", str(tmp_path / "model.pt"), "--device",
             device], capture_output=True, text=True, timeout=HANG)
        if device != "gpu" and "CUDA driver" not in completed.stderr:
            pytest.skip("this machine has a CUDA driver")
        assert completed.returncode == 2 and said in completed.stderr, completed.stderr
