"""Where and when a benchmark ran, for its JSON and its plot's title: the machine, the
date and the commit of the checkout (a figure is committed beside the data that made
it, and names the run that made both)."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """The checkout's commit, short, with "+" if its tracked files have changes."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", ROOT, *words], capture_output=True,
                              text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain",
                                                               "--untracked-files=no") else "")


def provenance() -> dict[str, str]:
    """machine (architecture, cores), date (UTC, to the minute), commit and the command
    that ran."""
    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, shared",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit(), "command": " ".join(sys.argv)}


def run_line(figures: dict) -> str:
    """The plot title's line that names the run: machine, date, commit."""
    return f"{figures['machine']}, {figures['date']}, commit {figures['commit']}"


if __name__ == "__main__":
    import argparse
    import json

    argparse.ArgumentParser(description="Prints where and when a benchmark run here would "
                                        "say it ran (JSON: machine, date, commit).").parse_args()
    print(json.dumps(provenance(), indent=1))
