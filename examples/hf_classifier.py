"""A text classifier written as a class, as ``multipy serve FILE.py:CLASS`` serves it: a
Hugging Face ``transformers`` model and a ``tokenizers`` tokenizer, loaded in ``load()``
from the folder that examples/generate_hf_classifier.py writes (``HF_CLASSIFIER_DIR``,
default examples/generated/hf_classifier).

    python examples/generate_hf_classifier.py
    multipy serve examples/hf_classifier.py:Classifier --grpc-port 8001

Each interpreter of the server makes one ``Classifier`` and runs its ``load()``.  The
weights are a safetensors file, which ``from_pretrained`` maps into memory rather than
reads: the interpreters' tensors are views of the same pages of the page cache, so the
weights are in memory once however many interpreters serve them.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

FOLDER = os.environ.get("HF_CLASSIFIER_DIR", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "generated", "hf_classifier"))


class Classifier:
    """Texts (BYTES, UTF-8) in; each text's class probabilities (FP32 [batch, classes])
    and most likely label (BYTES [batch]) out."""

    inputs = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    outputs = [{"name": "probabilities", "datatype": "FP32", "shape": [-1, -1]},
               {"name": "label", "datatype": "BYTES", "shape": [-1]}]

    def load(self) -> None:
        """The model and tokenizer, from FOLDER."""
        from tokenizers import Tokenizer
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging

        logging.disable_progress_bar()  # one per interpreter, on the server's log
        self.model = AutoModelForSequenceClassification.from_pretrained(FOLDER).eval()
        config = self.model.config
        self.labels = [config.id2label[k].encode() for k in range(config.num_labels)]
        self.tokenizer = Tokenizer.from_file(os.path.join(FOLDER, "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=config.pad_token_id, pad_token="[PAD]")
        self.tokenizer.enable_truncation(config.max_position_embeddings)

    def predict(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        texts = [text.decode("utf-8", errors="replace") for text in inputs["text"].reshape(-1)]
        encodings = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([each.ids for each in encodings], dtype=torch.int64)
        mask = torch.tensor([each.attention_mask for each in encodings], dtype=torch.int64)
        with torch.inference_mode():
            probabilities = torch.softmax(self.model(input_ids=ids, attention_mask=mask).logits, -1)
        labels = np.array([self.labels[k] for k in probabilities.argmax(-1).tolist()],
                          dtype=object)
        return {"probabilities": probabilities, "label": labels}


if __name__ == "__main__":  # a module for `multipy serve`, not a program: this only says so
    import argparse

    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Write its folder with examples/generate_hf_classifier.py, then serve it with "
               "multipy serve examples/hf_classifier.py:Classifier.").parse_args()
    print(f"multipy serve {os.path.relpath(os.path.abspath(__file__))}:Classifier "
          f"(its model and tokenizer from {FOLDER})")
