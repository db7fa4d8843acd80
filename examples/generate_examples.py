"""Writes the example packages: ``<name>.pt`` (a torch.package) for each example, and
``<name>_jit.pt`` (a TorchScript copy) where tracing works.

Each package holds the model at ("model", "model.pkl"), its example input tuple at
("model", "example.pkl") and the output of running it directly at ("model",
"expected.pkl").  The simple example also holds extra files ("extra", "hello.txt") and
("extra", "hello.bin").  Used by the tests and the benchmarks.

    python examples/generate_examples.py [--models simple,resnet] [DIR]
                                                          (default DIR: examples/generated)
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
import zipfile
from typing import Callable

import torch
from torch.package import PackageExporter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_models as models  # noqa: E402

DEFAULT_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generated")


def _examples() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple, bool]]:
    """name -> (model factory, example input, whether a TorchScript copy is made)."""
    return {
        "simple": (models.Simple, (torch.randn(3, 10),), True),
        "resnet": (lambda: models.ResNet18().eval(), (torch.randn(1, 3, 64, 64),), True),
        "multi_return": (models.MultiReturn, (torch.randn(4, 5),), True),
        "batched": (models.Batched, (torch.randn(4, 8),), True),
        "fx": (lambda: torch.fx.symbolic_trace(models.FXSource()), (torch.randn(2, 6),), True),
        "numpy": (models.WithNumpy, (torch.randn(3, 5),), False),
        "autograd": (models.WithAutograd, (torch.randn(2, 4),), False),
        "python_heavy": (models.PythonHeavy, (torch.randn(2, 48, 16),), True),
    }


def example_names() -> list[str]:
    """The names of the examples, in the order they are written."""
    return list(_examples())


def generate(directory: str, names: list[str] | None = None) -> dict[str, str]:
    """Writes the examples (all, or those named) into directory; returns name -> path."""
    os.makedirs(directory, exist_ok=True)
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    torch.manual_seed(0)
    paths = {}
    for name, (factory, example, traceable) in _examples().items():
        if names is not None and name not in names:
            continue
        model = factory()
        with torch.no_grad():
            expected = model(*example)
        path = os.path.join(directory, f"{name}.pt")
        with PackageExporter(path) as exporter:
            exporter.extern(["torch.**", "numpy.**"])
            exporter.mock("iopath.**")
            exporter.intern("**")
            exporter.save_pickle("model", "model.pkl", model)
            exporter.save_pickle("model", "example.pkl", example)
            exporter.save_pickle("model", "expected.pkl", expected)
            if name == "simple":
                exporter.save_text("extra", "hello.txt", "hello")
                exporter.save_binary("extra", "hello.bin", b"hello")
        if traceable:
            torch.jit.trace(model, example, strict=False).save(
                os.path.join(directory, f"{name}_jit.pt"))
        paths[name] = path
    return paths


def _resources(path: str) -> list[tuple[str, str]]:
    """(package, resource) of each file a user loads from the archive at path: its
    pickles and extra files, not its code or storages."""
    with zipfile.ZipFile(path) as archive:
        names = [info.filename.split("/", 1)[1] for info in archive.infolist()]
    return [tuple(name.rsplit("/", 1)) for name in names
            if "/" in name and not name.startswith(".") and not name.endswith(".py")]


_MEANING = {"model.pkl": "the model", "example.pkl": "a tuple of example inputs",
            "expected.pkl": "the model's output for them"}


def main(argv: list[str] | None = None) -> None:
    names = example_names()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Load one with manager.load_package(DIR/NAME.pt).load_pickle(package, "
               "resource); the resources written are printed at the end.")
    parser.add_argument("directory", metavar="DIR", nargs="?", default=DEFAULT_DIRECTORY,
                        help="where to write the packages (default: %(default)s)")
    parser.add_argument("--models", metavar="NAMES", default=",".join(names),
                        help=f"comma-separated examples to write, from {', '.join(names)} "
                             f"(default: all)")
    args = parser.parse_args(argv)
    chosen = [name for name in args.models.split(",") if name]
    unknown = sorted(set(chosen) - set(names))
    if unknown or not chosen:
        parser.error(f"unknown models: {', '.join(unknown) or '(none given)'} "
                     f"(known: {', '.join(names)})")
    written = generate(args.directory, chosen)
    print(f"wrote {len(written)} package(s) to {os.path.abspath(args.directory)}; load one with "
          f"package = manager.load_package(path), then:")
    for name, path in written.items():
        jit = path[:-len(".pt")] + "_jit.pt"
        print(f"{name}: {os.path.abspath(path)}"
              + (f"  (TorchScript copy: {os.path.abspath(jit)})" if os.path.exists(jit) else ""))
        for package, resource in _resources(path):
            load = ("load_pickle" if resource.endswith(".pkl") else
                    "load_text" if resource.endswith(".txt") else "load_binary")
            call = f'package.{load}("{package}", "{resource}")'
            print(f"    {call:45s} {_MEANING.get(resource, '')}".rstrip())


if __name__ == "__main__":
    main()
