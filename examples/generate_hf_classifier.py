"""Writes the Hugging Face text classifier that examples/hf_classifier.py serves as a
class: a ``transformers`` DistilBERT for sequence classification, made from a config
with random weights (it is an example of serving, not of classifying: its labels are
as good as chance) and saved with ``save_pretrained`` (config.json, model.safetensors),
and beside it tokenizer.json, a WordPiece tokenizer of Hugging Face ``tokenizers``
trained in memory on examples/generate_examples.py's corpus.  Nothing is downloaded.

    python examples/generate_hf_classifier.py [DIR] [--dim D] [--layers L]
                                            (default DIR: examples/generated/hf_classifier)

The defaults make a small model (about 0.5 MB of weights); ``--dim 768 --layers 6``,
DistilBERT-base's shape with this small vocabulary, about 170 MB.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_examples import LABELS, train_tokenizer  # noqa: E402

DEFAULT_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generated",
                                 "hf_classifier")
#: The most tokens of a text the model reads (the tokenizer truncates at it).
MAX_TOKENS = 64


def generate(directory: str, dim: int = 64, layers: int = 2) -> str:
    """Writes the model (hidden size dim, layers transformer layers, random weights from
    seed 0) and its tokenizer into directory; returns directory."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    from transformers.utils import logging

    logging.disable_progress_bar()
    os.makedirs(directory, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = DistilBertConfig(
        vocab_size=tokenizer.get_vocab_size(), dim=dim, n_layers=layers,
        n_heads=max(1, dim // 64), hidden_dim=4 * dim, max_position_embeddings=MAX_TOKENS,
        pad_token_id=tokenizer.token_to_id("[PAD]"), num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={label: k for k, label in enumerate(LABELS)})
    torch.manual_seed(0)
    DistilBertForSequenceClassification(config).eval().save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", metavar="DIR", nargs="?", default=DEFAULT_DIRECTORY,
                        help="where to write the model (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=64,
                        help="hidden size, a multiple of 64 (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2,
                        help="transformer layers (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.dim < 64 or args.dim % 64 or args.layers < 1:
        parser.error("--dim must be a multiple of 64, and --layers at least 1")
    directory = os.path.abspath(generate(args.directory, args.dim, args.layers))
    weights = os.path.getsize(os.path.join(directory, "model.safetensors"))
    print(f"wrote {directory}: config.json, model.safetensors ({weights / 2**20:.1f} MiB), "
          f"tokenizer.json")


if __name__ == "__main__":
    main()
