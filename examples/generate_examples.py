"""Writes the example packages: ``<name>.pt`` (a torch.package) for each example, and
``<name>_jit.pt`` (a TorchScript copy) where tracing works.

Each package holds the model at ("model", "model.pkl"), its example input tuple at
("model", "example.pkl") and the output of running it directly at ("model",
"expected.pkl").  The simple example also holds extra files ("extra", "hello.txt") and
("extra", "hello.bin").  Used by the tests and the benchmarks.

    python examples/generate_examples.py [OUTPUT_DIR]     (default: examples/generated)
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

import torch
from torch.package import PackageExporter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_models as models  # noqa: E402


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


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "generated")
    for example, written in generate(out).items():
        print(f"{example:13s} {written}")
