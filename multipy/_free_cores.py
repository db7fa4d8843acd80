"""How many cores this machine gives n programs at once, now: measured with n plain
processes of pure Python, against one alone.  Interpreters cannot run faster together
than separate processes do, so a busy machine caps the speed-up that multipy's demo,
benchmark and examples show; they measure this first and say so."""
from __future__ import annotations

import subprocess
import sys

#: Each process: waits for a byte on stdin (so that all start together), then counts
#: loop rounds of pure Python for a fixed wall time and prints the count.
_COUNT = """\
import sys, time
sys.stdin.read(1)
end = time.perf_counter() + {seconds}
rounds = 0
while time.perf_counter() < end:
    for i in range(1000):
        pass
    rounds += 1
print(rounds)
"""


def _rounds(processes: int, seconds: float) -> int:
    """The rounds that ``processes`` processes counted in all, running at once."""
    code = _COUNT.format(seconds=seconds)
    children = [subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    for child in children:
        child.stdin.write("go")
        child.stdin.close()
    counted = [int(child.stdout.read()) for child in children]
    for child in children:
        child.wait(timeout=60)
    return sum(counted)


def measure(processes: int, seconds: float = 0.5) -> float:
    """The work that ``processes`` processes do at once, in units of what one does
    alone: ``processes`` on an idle machine with that many cores, less when busy."""
    return _rounds(processes, seconds) / max(1, _rounds(1, seconds))


def describe(processes: int, found: float) -> str:
    """One or two lines to print before a measurement of ``processes`` interpreters, given
    what ``measure(processes)`` found: it and, where it is well short of ``processes``,
    that the speed-up shown cannot exceed it."""
    said = (f"free cores: {processes} plain Python processes at once did {found:.2f}x the "
            f"work of one alone (at most {processes}x)")
    if found < 0.8 * processes:
        said += (f"\n  this machine is busy or has fewer free cores: {processes} interpreters "
                 f"cannot run faster than about {found:.1f}x one here either")
    return said
