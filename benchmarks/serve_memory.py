"""Memory and start-up of `multipy serve` as the interpreters grow: for each count N of
--counts, a server of N interpreters serving the given models (any `multipy serve`
arguments: archives, FILE.py:CLASS), its PSS (the process's, shared pages divided among
those that map them) once it is ready, and the seconds from its start to ready; the
median of --rounds rounds, the counts taking turns; then what each interpreter more
adds.  With a model whose weights are mapped from a file (a safetensors file that
`from_pretrained` maps, an archive's storages), the weights are counted once whatever
N; what grows is each interpreter's own Python, torch and buffers.  With --request, every
interpreter answers that request first (the pages that a model touches only as it runs
count then).

    multipy run benchmarks/serve_memory.py [--counts 1,2] [--rounds 3]
        [--request MODEL JSON] -- ARGUMENTS...
    python examples/generate_hf_classifier.py /tmp/hf --dim 768 --layers 6   # ~170 MB
    HF_CLASSIFIER_DIR=/tmp/hf multipy run benchmarks/serve_memory.py --request classifier \\
        '{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}' \\
        -- examples/hf_classifier.py:Classifier
    multipy run benchmarks/serve_memory.py --replot FILE.json --plot FILE.png

--json keeps the figures with the machine, the date and the commit; --plot draws PSS and
the seconds to ready against N, with those three in its title.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import provenance, run_line  # noqa: E402
from serve_load import _stop, _wait_ready, free_port, pss_tree  # noqa: E402


def started(command: list[str], port: int, then: Callable[[], None] = lambda: None
            ) -> tuple[float, float]:
    """(PSS in MiB once ready and then() has run, seconds from start to ready) of
    command, a server that serves HTTP on port; it is stopped then."""
    began = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        _wait_ready(port, process)
        ready = time.monotonic() - began
        then()
        return pss_tree(process.pid) / (1 << 20), ready
    finally:
        _stop(process)


def infer_on_each(port: int, model: str, body: str, connections: int) -> None:
    """Sends body (a JSON inference request) to model on connections connections open at
    once, so that each interpreter answers (the server hands a new connection to the
    front end with the fewest open); RuntimeError unless every answer is a 200."""
    opened = [http.client.HTTPConnection("127.0.0.1", port, timeout=120)
              for _ in range(connections)]
    try:
        for connection in opened:
            connection.connect()
        for connection in opened:
            connection.request("POST", f"/v2/models/{model}/infer", body,
                               {"Content-Type": "application/json"})
        for connection in opened:
            answer = connection.getresponse()
            text = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"{model} answered {answer.status}: {text[:200]!r}")
    finally:
        for connection in opened:
            connection.close()


def measure(arguments: list[str], n: int, request: tuple[str, str] | None) -> tuple[float, float]:
    """started's figures for `multipy serve ARGUMENTS --interpreters n`, after request
    (model, JSON body), if any, has run on every interpreter."""
    port = free_port()
    then = (lambda: None) if request is None else \
        (lambda: infer_on_each(port, *request, connections=2 * n))
    return started([sys.executable, "-m", "multipy", "serve", *arguments, "--interpreters",
                    str(n), "--port", str(port)], port, then)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,2",
                        help="interpreters of each server, comma-separated (1,2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, taking turns (3)")
    parser.add_argument("--request", nargs=2, metavar=("MODEL", "JSON"),
                        help="an inference request that every interpreter answers before the "
                             "PSS is read (the pages a model touches only when it runs count "
                             "then); default: none, the PSS once ready")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plot", help="also plot the figures into this PNG")
    parser.add_argument("--replot", help="plot (--plot) and print this --json file's figures; "
                                         "run nothing")
    parser.add_argument("arguments", nargs="*", metavar="ARGUMENTS",
                        help="what `multipy serve` serves (after --)")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            figures = json.load(f)
    elif not args.arguments:
        parser.error("what to serve is missing: -- ARGUMENTS")
    else:
        figures = measured(args)
    report(figures)
    if args.json and not args.replot:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.plot:
        plot(figures, args.plot)


def measured(args: argparse.Namespace) -> dict:
    """The figures of a run: per N, the median PSS (MiB) and seconds to ready over the
    rounds, each round's too, with where and when it ran."""
    counts = [int(count) for count in args.counts.split(",")]
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    for round_ in range(args.rounds):
        for n in (counts if round_ % 2 == 0 else counts[::-1]):
            runs[n].append(measure(args.arguments, n, args.request))
    return {**provenance(), "served": " ".join(args.arguments),
            "setting": f"median of {args.rounds} round(s)"
                       + (", after a request on each interpreter" if args.request else
                          ", once ready"),
            "rows": [{"n": n, "pss_mib": statistics.median(pss for pss, _ in runs[n]),
                      "ready_s": statistics.median(ready for _, ready in runs[n]),
                      "rounds": runs[n]} for n in counts]}


def report(figures: dict) -> None:
    """Prints the figures: PSS and start per N, and what each interpreter more adds."""
    print(f"\nmultipy serve {figures['served']}: {figures['setting']}; {figures['machine']}")
    print(f"{'N':>2s} {'PSS MiB':>8s} {'start s':>8s}")
    rows = sorted(figures["rows"], key=lambda row: row["n"])
    for row in rows:
        print(f"{row['n']:2d} {row['pss_mib']:8.1f} {row['ready_s']:8.1f}")
    if len(rows) > 1:
        low, high = rows[0], rows[-1]
        print(f"each interpreter more adds "
              f"{(high['pss_mib'] - low['pss_mib']) / (high['n'] - low['n']):.1f} MiB")


def plot(figures: dict, path: str) -> None:
    """A PNG at path: PSS (MiB) and seconds to ready against N, titled with what was
    served, the machine, the date and the commit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(figures["rows"], key=lambda row: row["n"])
    ns = [row["n"] for row in rows]
    fig, (memory, start) = plt.subplots(1, 2, figsize=(10, 4))
    memory.plot(ns, [row["pss_mib"] for row in rows], marker="o")
    memory.set_ylabel("PSS of the server, MiB")
    start.plot(ns, [row["ready_s"] for row in rows], marker="o", color="C1")
    start.set_ylabel("seconds from start to ready")
    for ax in (memory, start):
        ax.set_xlabel("N (interpreters)")
        ax.set_xticks(ns)
        ax.set_ylim(bottom=0)
    served = figures["served"] if len(figures["served"]) < 70 else figures["served"][:67] + "..."
    fig.suptitle(f"multipy serve {served}: {figures['setting']}\n" + run_line(figures),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
