"""The example models, defined here because torchvision is not available.

They mirror the original's example set: a simple model, ResNet-18, a model with nested
multiple returns and an in-place op, a batched model with ``make_prediction``, an
FX-traced model with a leaf function, a model that uses numpy, and one that runs
autograd in its forward; plus a model whose time goes to eager-mode Python overhead, and
a text classifier that takes text (BYTES) and tokenizes it itself.
"""

import numpy as np
import torch
from torch import nn


class Simple(nn.Module):
    """A weight and a bias: ``relu(x @ weight + bias)``."""

    def __init__(self, features: int = 10) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, features))
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight + self.bias)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 as torchvision defines it (BasicBlock, layers 2-2-2-2)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, inplanes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride),
                                        BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class MultiReturn(nn.Module):
    """Nested tuple results and an in-place op on a copy of the input."""

    def forward(self, x: torch.Tensor):
        y = x.clone()
        y.add_(1)
        return (x * 2, (y, x.sum()), [x.mean(dim=0)])


class Batched(nn.Module):
    """A model with batching helpers: ``make_batch`` and ``make_prediction``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def make_batch(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(inputs)

    def make_prediction(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.forward(self.make_batch(inputs)).unbind(0))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(batch), dim=-1)


def leaf_scale(x: torch.Tensor) -> torch.Tensor:
    """Kept as one call by FX tracing (torch.fx.wrap)."""
    return x * float(x.shape[-1]) ** -0.5


torch.fx.wrap("leaf_scale")


class FXSource(nn.Module):
    """Traced with torch.fx; ``leaf_scale`` stays a leaf of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(leaf_scale(self.linear(x)))


class WithNumpy(nn.Module):
    """Round-trips through numpy in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = np.asarray(x.detach().numpy(), dtype=np.float64)
        return torch.from_numpy(np.cumsum(values, axis=-1)).float() * self.scale


class WithAutograd(nn.Module):
    """Returns the input gradient of a scalar function, computed with backward()."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            (torch.tanh(x @ self.weight) ** 2).sum().backward()
        return x.grad


class PythonHeavy(nn.Module):
    """Eager-mode Python overhead dominates: a small recurrent cell unrolled in a Python
    loop, a dozen tiny ops per step (the kind of model multipy exists for)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.input = nn.Linear(hidden, hidden)
        self.recurrent = nn.Linear(hidden, hidden)
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros(x.shape[0], self.hidden, device=x.device, dtype=x.dtype)
        outputs = []
        for step in range(x.shape[1]):
            state = torch.tanh(self.input(x[:, step]) + self.recurrent(state))
            if step % 2:
                state = 0.5 * state + 0.5 * state.roll(1, dims=-1)
            outputs.append(state)
        return torch.stack(outputs, 1).mean(1)


class TextClassifier(nn.Module):
    """Classifies texts: BYTES in, a numpy array of ``bytes`` of shape [batch] (what
    ``multipy serve`` gives a model for a BYTES input; ``str`` elements are taken too);
    out, the class probabilities (float32 [batch, classes]) and each text's most likely
    label (a numpy array of ``bytes`` [batch], which answers as BYTES).

    It tokenizes the texts itself with a Hugging Face ``tokenizers`` tokenizer, given as
    its JSON (``Tokenizer.to_str()``): the JSON is what is pickled, so the tokenizer
    travels inside the package, and the ``tokenizers`` module (externed) rebuilds it on
    the first call in each interpreter.  Then token and position embeddings, a
    TransformerEncoder (``layers`` layers of width ``d_model``), the mean over the
    tokens that are not padding, and a linear head.  Texts longer than ``max_length``
    tokens are truncated."""

    def __init__(self, tokenizer_json: str, labels: list[str], d_model: int = 64,
                 layers: int = 2, heads: int = 4, max_length: int = 32) -> None:
        super().__init__()
        import tokenizers

        vocabulary = tokenizers.Tokenizer.from_str(tokenizer_json).get_vocab_size()
        self.tokenizer_json = tokenizer_json
        self.labels = list(labels)
        self.max_length = max_length
        self._tokenizer = None
        self.embedding = nn.Embedding(vocabulary, d_model)
        self.position = nn.Parameter(torch.randn(max_length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, len(self.labels))

    def __getstate__(self) -> dict:
        """The module's state without the rebuilt tokenizer (its JSON is kept)."""
        return {**self.__dict__, "_tokenizer": None}

    def tokenizer(self):
        """The tokenizer, rebuilt from its JSON on first use: padding to the longest text
        of a batch, truncating at max_length."""
        if self._tokenizer is None:
            import tokenizers

            tokenizer = tokenizers.Tokenizer.from_str(self.tokenizer_json)
            tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
            tokenizer.enable_truncation(self.max_length)
            self._tokenizer = tokenizer
        return self._tokenizer

    def forward(self, text) -> tuple[torch.Tensor, np.ndarray]:
        texts = [each.decode("utf-8", errors="replace") if isinstance(each, bytes) else str(each)
                 for each in np.asarray(text, dtype=object).reshape(-1)]
        encodings = self.tokenizer().encode_batch(texts)
        ids = torch.tensor([each.ids for each in encodings], dtype=torch.int64)
        keep = torch.tensor([each.attention_mask for each in encodings], dtype=torch.bool)
        x = self.embedding(ids) + self.position[:ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=~keep)
        weights = keep.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1)
        probabilities = torch.softmax(self.head(pooled), dim=-1)
        labels = np.array([self.labels[i].encode() for i in probabilities.argmax(-1).tolist()],
                          dtype=object)
        return probabilities, labels


if __name__ == "__main__":  # a module, not a program: this only lists the models
    import argparse

    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run examples/generate_examples.py to write them as torch.package archives."
    ).parse_args()
    print(" ".join(name for name, value in list(globals().items())
                   if isinstance(value, type) and issubclass(value, nn.Module)
                   and value.__module__ == __name__))
