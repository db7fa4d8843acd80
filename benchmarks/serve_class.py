"""The same model served as a torch.package archive and as a class
(`multipy serve FILE.py:CLASS`, docs/serve/classes.md), measured
in one run: requests/s, p50/p99 and the PSS of the server with 2N closed-loop HTTP
clients (benchmarks/serve_load.py's), the two taking turns for --rounds rounds, and the
time from start to ready; with several --counts of interpreters, the PSS that each
interpreter more adds.  The class loads the same archive in its load() and calls the
model in predict, so the difference is the class's path: a dict of inputs in, a dict of
outputs back, no torch.package metadata.

    multipy run benchmarks/serve_class.py [--model simple] [--counts 1,2] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from serve_load import _medians, example, free_port, run_server  # noqa: E402
from serve_memory import started  # noqa: E402

CLASS = '''
import torch
import torch.package

PATH = {path!r}


class Wrapped:
    """The archive's model, as a class: inputs by position of the request's order, as
    tensors (BYTES: the arrays of bytes as they come, as the archive's model gets them)."""

    def load(self):
        self.model = torch.package.PackageImporter(PATH).load_pickle("model", "model.pkl")
        self.model.eval()

    def predict(self, inputs):
        with torch.no_grad():
            return self.model(*(array if array.dtype == object else torch.from_numpy(array)
                                for array in inputs.values()))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="simple",
                        help="example model: simple, python_heavy or text_classifier (simple)")
    parser.add_argument("--counts", default="2",
                        help="interpreters N of each server, comma-separated (2); with two "
                             "or more, the PSS that each interpreter more adds too")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, taking turns (3)")
    parser.add_argument("--seconds", type=float, default=5, help="timed seconds per run (5)")
    parser.add_argument("--warm-up", type=float, default=2, help="untimed seconds first (2)")
    args = parser.parse_args()
    counts = [int(count) for count in args.counts.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        path, inputs, expected = example(directory, args.model)
        wrapped = os.path.join(directory, "wrapped.py")
        with open(wrapped, "w") as f:
            f.write(CLASS.format(path=path))
        targets = {"archive": [path], "class": [f"{wrapped}:Wrapped", "--name", args.model]}
        rounds = {(name, n): [] for name in targets for n in counts}
        starts = {(name, n): [] for name in targets for n in counts}
        for round_ in range(args.rounds):
            for n in counts:
                for name in (("archive", "class") if round_ % 2 == 0 else ("class", "archive")):
                    port = free_port()
                    command = [sys.executable, "-m", "multipy", "serve", *targets[name],
                               "--interpreters", str(n), "--port", str(port)]
                    starts[name, n].append(started(command, port)[1])
                    measured = run_server(command, {"http": port}, ("http",), args.model,
                                          2 * n, args.seconds, args.warm_up, inputs, expected)
                    rounds[name, n].append(measured["http"])
    print(f"\n{args.model}, 2N HTTP clients, {args.seconds:g} s after {args.warm_up:g} s, "
          f"median of {args.rounds} round(s); {os.cpu_count()} cores")
    print(f"{'N':>2s} {'served as':10s} {'req/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s} "
          f"{'PSS MiB':>8s} {'start s':>8s} {'wrong':>5s}")
    medians = {key: _medians(runs) for key, runs in rounds.items()}
    for (name, n), f in medians.items():
        began = sorted(starts[name, n])[len(starts[name, n]) // 2]
        print(f"{n:2d} {name:10s} {f['requests_per_second']:8.1f} {f['p50_ms']:7.2f} "
              f"{f['p99_ms']:7.2f} {f['pss_mib']:8.1f} {began:8.1f} {f['wrong']:5d}")
    for n in counts:
        one, other = medians["class", n], medians["archive", n]
        print(f"N={n}, class / archive: requests/s "
              f"{one['requests_per_second'] / other['requests_per_second']:.2f}x, memory "
              f"{one['pss_mib'] / other['pss_mib']:.2f}x (req/s by round, class/archive: "
              + ", ".join(f"{a['requests_per_second']:.0f}/{b['requests_per_second']:.0f}"
                          for a, b in zip(rounds["class", n], rounds["archive", n])) + ")")
    if len(counts) > 1:
        low, high = min(counts), max(counts)
        print(f"PSS each interpreter more adds (N={low} to N={high}): " + ", ".join(
            f"{name} {(medians[name, high]['pss_mib'] - medians[name, low]['pss_mib']) / (high - low):.1f} MiB"
            for name in targets))


if __name__ == "__main__":
    main()
