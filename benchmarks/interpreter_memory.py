"""Where one more interpreter's memory goes, with the torch installed here.

Starts interpreters one at a time, each importing torch (and numpy), and reads
/proc/self/smaps after each: the last interpreter's cost is the difference between the
last two readings, which the ones before it (and the host, which imports nothing)
leave out.  Private memory (clean and dirty: what this process alone holds) by mapping:
each library file's own copy (its relocated data, its .bss, and code pages nothing
else maps) and the rest of anonymous memory (heaps, Python's arenas, thread stacks), of which the
interpreter's own libc reports its malloc's share (mallinfo2).  RSS and PSS too.

    multipy run benchmarks/interpreter_memory.py [--interpreters 3] [--imports torch,numpy]
"""
from __future__ import annotations

import argparse
import collections
import functools
import mmap
import os
import re
import struct

import multipy

_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
#: The report's group of anonymous memory (mappings of no file).
ANONYMOUS = "anonymous (heaps, Python's arenas, thread stacks)"

INSIDE = r'''
import ctypes, importlib

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]

def load(names):
    for name in names:
        importlib.import_module(name)

def malloc_in_use():
    """This interpreter's libc's malloc: bytes in use (small blocks and mmapped ones)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
'''


@functools.cache
def _bss_pages(path: str) -> int:
    """Bytes of whole pages that a 64-bit ELF library's writable segment needs beyond
    its file's pages (its .bss, mapped anonymous); 0 for anything else."""
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if header[:4] != b"\x7fELF" or header[4] != 2:
                return 0
            phoff, = struct.unpack_from("<Q", header, 32)
            entry_size, count = struct.unpack_from("<HH", header, 54)
            f.seek(phoff)
            table = f.read(entry_size * count)
    except OSError:
        return 0
    page, extent = mmap.PAGESIZE, 0
    for i in range(count):
        kind, flags, _, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", table,
                                                                        i * entry_size)
        if kind == 1 and flags & 2:  # PT_LOAD, writable
            up = lambda n: -(-n // page) * page  # noqa: E731
            extent += up(vaddr + memsz) - up(vaddr + filesz)
    return extent


def smaps() -> tuple[collections.Counter, dict[str, int]]:
    """kB private per mapping name (a file's path, or [heap], [anonymous], [stack]...; a
    nameless mapping that begins where a library's ends is that library's .bss), and the
    process's Rss and Pss in kB."""
    private: collections.Counter = collections.Counter()
    totals = {"Rss": 0, "Pss": 0}
    name, library, library_end = "[anonymous]", None, None
    with open("/proc/self/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                parts = line.split(maxsplit=5)
                start, end = parts[0].split("-")
                name = parts[5].strip() if len(parts) > 5 else "[anonymous]"
                if name.startswith("/"):
                    library, library_end = name, end
                elif (name == "[anonymous]" and start == library_end
                      and int(end, 16) - int(start, 16) <= _bss_pages(library)):
                    name = f"{library} (.bss)"
            elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                private[name] += int(line.split()[1])
            elif line.startswith(("Rss:", "Pss:")):
                totals[line.split(":")[0]] += int(line.split()[1])
    return private, totals


def kind(name: str) -> str:
    """A mapping's group in the report: a library's file name, or anonymous memory."""
    if name.startswith("[") or not name.startswith("/"):
        return ANONYMOUS
    return os.path.basename(name.removesuffix(" (.bss)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpreters", type=int, default=3,
                        help="how many to start (the last one is measured)")
    parser.add_argument("--imports", default="torch,numpy", help="what each imports")
    parser.add_argument("--top", type=int, default=15, help="libraries listed")
    args = parser.parse_args()
    imports = [name for name in args.imports.split(",") if name]
    readings = [smaps()]
    with multipy.InterpreterManager(args.interpreters) as manager:
        manager.register_module_source("memory_probe", INSIDE)
        for interpreter in manager.all_instances():
            interpreter.global_("memory_probe", "load")(imports)
            readings.append(smaps())
        malloc = manager.all_instances()[-1].global_("memory_probe", "malloc_in_use")().deref()
    (before, totals_before), (after, totals_after) = readings[-2], readings[-1]
    grown: collections.Counter = collections.Counter()
    for name in set(before) | set(after):
        grown[kind(name)] += after[name] - before[name]
    libraries = sorted(((kib, name) for name, kib in grown.items() if name != ANONYMOUS),
                       reverse=True)
    mib = 1024
    print(f"one more interpreter importing {', '.join(imports) or 'nothing'} "
          f"(the last of {args.interpreters}):")
    print(f"  RSS {(totals_after['Rss'] - totals_before['Rss']) / mib:,.1f} MiB, "
          f"PSS {(totals_after['Pss'] - totals_before['Pss']) / mib:,.1f} MiB, "
          f"private {sum(grown.values()) / mib:,.1f} MiB:")
    print(f"  {grown[ANONYMOUS] / mib:8,.1f} MiB  {ANONYMOUS}; of which its libc's malloc "
          f"holds {malloc / 2**20:,.1f} MiB in use")
    print(f"  {sum(k for k, _ in libraries) / mib:8,.1f} MiB  libraries' own copies "
          f"(relocated data, .bss, code no other copy maps), of {len(libraries)} files:")
    for kib, name in libraries[:args.top]:
        print(f"  {kib / mib:12,.1f} MiB  {name}")


if __name__ == "__main__":
    main()
