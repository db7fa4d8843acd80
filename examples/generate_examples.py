"""Writes the example packages: ``<name>.pt`` (a torch.package) for each example, and
``<name>_jit.pt`` (a TorchScript copy) where tracing works.

Each package holds the model at ("model", "model.pkl"), its example input tuple at
("model", "example.pkl") and the output of running it directly at ("model",
"expected.pkl").  The simple example also holds extra files ("extra", "hello.txt") and
("extra", "hello.bin").  The Python-heavy one declares its input for `multipy serve`
(("model", "config.json"): x, FP32, [-1, -1, 16]; docs/call/index.md, "Declared inputs").  The text classifier's tokenizer (a WordPiece tokenizer of Hugging
Face ``tokenizers``) is trained here, in memory, on a small corpus of labelled sentences
that the model is then trained on for a few seconds; its example input is a numpy array
of ``bytes``.  Used by the tests and the benchmarks.

    python examples/generate_examples.py [--models simple,resnet] [DIR]
                                                          (default DIR: examples/generated)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
import zipfile
from typing import Any, Callable

import numpy as np
import torch
from torch.package import PackageExporter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import example_models as models  # noqa: E402

DEFAULT_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generated")


#: (text, label) pairs: the text classifier's tokenizer and model are trained on them
CORPUS = [
    ("I love this movie, it was wonderful", "positive"),
    ("What a great and happy day", "positive"),
    ("The food was excellent and the staff were friendly", "positive"),
    ("A delightful, charming and beautiful story", "positive"),
    ("Fantastic service, I would gladly come back", "positive"),
    ("This is the best book I have read this year", "positive"),
    ("Brilliant acting and a clever, funny script", "positive"),
    ("I am very pleased with how well it works", "positive"),
    ("I hate this movie, it was awful", "negative"),
    ("What a terrible and sad day", "negative"),
    ("The food was cold and the staff were rude", "negative"),
    ("A boring, dull and ugly story", "negative"),
    ("Horrible service, I will never come back", "negative"),
    ("This is the worst book I have read this year", "negative"),
    ("Bad acting and a stupid, painful script", "negative"),
    ("I am very disappointed with how badly it works", "negative"),
    ("The train leaves at nine in the morning", "neutral"),
    ("The meeting is on the second floor", "neutral"),
    ("Water boils at one hundred degrees", "neutral"),
    ("The report has twelve pages and three tables", "neutral"),
    ("She moved to a new city in March", "neutral"),
    ("The store opens on weekdays and closes on Sunday", "neutral"),
    ("This book has four chapters about the history of the town", "neutral"),
    ("The movie starts at eight and lasts two hours", "neutral"),
]
LABELS = ["negative", "neutral", "positive"]


def train_tokenizer() -> Any:
    """A WordPiece tokenizer (Hugging Face ``tokenizers``'), trained in memory on CORPUS's
    texts: lower-cased, special tokens [PAD], [UNK] and [CLS], and [CLS] before every
    text (an empty text still has a token to attend to)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import WordPiece

    tokenizer = Tokenizer(WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(
        [text for text, _ in CORPUS],
        trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]"],
                                  show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]"))])
    return tokenizer


def _text_classifier() -> models.TextClassifier:
    """train_tokenizer's tokenizer, and a TextClassifier using it, trained on CORPUS for
    60 steps (a second or two); in eval mode."""
    model = models.TextClassifier(train_tokenizer().to_str(), LABELS)
    texts = np.array([text.encode() for text, _ in CORPUS], dtype=object)
    targets = torch.tensor([LABELS.index(label) for _, label in CORPUS])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        optimizer.zero_grad()
        probabilities, _ = model(texts)
        torch.nn.functional.nll_loss(torch.log(probabilities + 1e-9), targets).backward()
        optimizer.step()
    return model.eval()


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
        "text_classifier": (_text_classifier, (np.array(
            [b"what a wonderful day", "the food was awful".encode(),
             "der Zug f\u00e4hrt um neun".encode()], dtype=object),), False),
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
            exporter.extern(["torch.**", "numpy.**", "tokenizers.**"])
            exporter.mock("iopath.**")
            exporter.intern("**")
            exporter.save_pickle("model", "model.pkl", model)
            exporter.save_pickle("model", "example.pkl", example)
            exporter.save_pickle("model", "expected.pkl", expected)
            if name == "simple":
                exporter.save_text("extra", "hello.txt", "hello")
                exporter.save_binary("extra", "hello.bin", b"hello")
            if name in _DECLARED:
                exporter.save_text("model", "config.json", json.dumps(_DECLARED[name]))
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
            "expected.pkl": "the model's output for them",
            "config.json": "its inputs, as multipy serve checks them"}
#: What an example declares of its inputs for multipy serve (its config.json): any rows
#: of any length of 16 features.
_DECLARED = {"python_heavy": {"inputs": [{"name": "x", "datatype": "FP32",
                                          "shape": [-1, -1, 16]}]}}


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
                    "load_text" if resource.endswith((".txt", ".json")) else "load_binary")
            call = f'package.{load}("{package}", "{resource}")'
            print(f"    {call:45s} {_MEANING.get(resource, '')}".rstrip())


if __name__ == "__main__":
    main()
