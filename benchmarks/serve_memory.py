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
"""
from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
    parser.add_argument("arguments", nargs="+", metavar="ARGUMENTS",
                        help="what `multipy serve` serves (after --)")
    args = parser.parse_args()
    counts = [int(count) for count in args.counts.split(",")]
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    for round_ in range(args.rounds):
        for n in (counts if round_ % 2 == 0 else counts[::-1]):
            runs[n].append(measure(args.arguments, n, args.request))
    print(f"\nmultipy serve {' '.join(args.arguments)}: median of {args.rounds} round(s); "
          f"{os.cpu_count()} cores")
    print(f"{'N':>2s} {'PSS MiB':>8s} {'start s':>8s}")
    medians = {n: (statistics.median(pss for pss, _ in runs[n]),
                   statistics.median(ready for _, ready in runs[n])) for n in counts}
    for n, (pss, ready) in medians.items():
        print(f"{n:2d} {pss:8.1f} {ready:8.1f}")
    if len(counts) > 1:
        low, high = min(counts), max(counts)
        print(f"each interpreter more adds "
              f"{(medians[high][0] - medians[low][0]) / (high - low):.1f} MiB")


if __name__ == "__main__":
    main()
