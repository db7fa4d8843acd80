"""One PyTorch model called from N host threads: on N interpreters with multipy, against
N plain threads calling the same model in the host (one GIL).  Prints calls per second
of each and their ratio.

    multipy run examples/threaded.py [--threads 2] [--seconds 3] [--model python_heavy] [DIR]
"""
import argparse
import os
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.package

import multipy
from multipy._free_cores import describe, measure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_examples import example_names, generate  # noqa: E402

warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch.package's own


def calls_per_second(call, threads: int, seconds: float, setup) -> float:
    """Runs call() in a loop on `threads` threads for `seconds`; each thread runs setup()
    and one untimed call first."""
    done = [0] * threads
    ready = threading.Barrier(threads + 1)
    stop = threading.Event()

    def loop(k: int) -> None:
        setup()
        call()
        ready.wait()
        while not stop.is_set():
            call()
            done[k] += 1

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()
    start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return sum(done) / (time.perf_counter() - start)


def no_grad() -> None:
    """Grad mode is per thread in torch: each host thread turns it off for itself."""
    torch.set_grad_enabled(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, metavar="N",
                        help="host threads, and interpreters (at most 15; default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=3, help="time per run (default: %(default)s)")
    parser.add_argument("--model", choices=example_names(), default="python_heavy",
                        help="example package to run (default: %(default)s)")
    parser.add_argument("dir", nargs="?", metavar="DIR",
                        help="folder written by examples/generate_examples.py (default: the "
                             "model is generated into a temporary folder)")
    args = parser.parse_args()
    if args.threads < 1 or args.seconds <= 0:
        parser.error("--threads and --seconds must be positive")

    print(describe(args.threads, measure(args.threads)))
    with tempfile.TemporaryDirectory() as scratch:
        if args.dir:
            path = os.path.join(args.dir, f"{args.model}.pt")
            if not os.path.isfile(path):
                parser.error(f"no {path}: write it with "
                             f"python examples/generate_examples.py --models {args.model} {args.dir}")
        else:
            path = generate(scratch, [args.model])[args.model]
        importer = torch.package.PackageImporter(path)
        host_model = importer.load_pickle("model", "model.pkl")
        inputs = importer.load_pickle("model", "example.pkl")  # a tuple of arguments

        # Interpreters run torch with the cores shared among them (intra-op threads) and,
        # here, grad off: the manager gives every thread that calls in these settings.
        with multipy.InterpreterManager(args.threads, grad_enabled=False) as manager:
            model = manager.load_package(path).load_pickle("model", "model.pkl")
            model.warm_up(*inputs)  # load it on every interpreter at once, call it once
            inside = calls_per_second(lambda: model(*inputs), args.threads, args.seconds,
                                      lambda: None)
        plain = calls_per_second(lambda: host_model(*inputs), args.threads, args.seconds,
                                 no_grad)

    print(f"{args.model}, {args.threads} threads, {args.seconds:g} s each:")
    print(f"  {f'multipy, {args.threads} interpreters:':28s} {inside:9.1f} calls/s")
    print(f"  {'plain host threads:':28s} {plain:9.1f} calls/s")
    print(f"  {'ratio:':28s} {inside / plain:9.2f}x")


if __name__ == "__main__":
    main()
