"""A ``torch.nn.Module`` subclass served as it is, inside one interpreter: what
``multipy serve FILE.py:CLASS`` serves when CLASS subclasses ``torch.nn.Module``.

The class is made once per interpreter, with no arguments, moved to the device and put
in eval mode; then it is served as an archive's model is (``serving.Served``):
``forward`` gets the inputs by name where they name its parameters (else in request
order), under ``torch.no_grad()``, and its outputs go back as tensors.  Class attributes
``inputs`` (and ``outputs``) declare them, as for any class (``served_class``); where a
declared name is none of forward's parameters (and forward takes no ``**kwargs``),
forward gets them by position, in the declared order, as a traced model's inputs are
named apart from its parameters.  A class whose constructor needs arguments is refused,
saying how to wrap it.

torch is never imported here: a class that subclasses ``torch.nn.Module`` has imported it.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

from ..serve.request.messages import ProtocolError
from .serving import Served, declaration


def is_module(kind: type) -> bool:
    """Whether kind subclasses ``torch.nn.Module`` (false where torch was not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and issubclass(kind, torch.nn.Module)


def load(kind: type, described_as: str, device: str) -> Served:
    """An instance of kind, an ``nn.Module`` subclass, on device and in eval mode, ready
    to serve; TypeError, with the wrapper that serves it, if its constructor needs
    arguments."""
    needed = [p.name for p in inspect.signature(kind).parameters.values()
              if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise TypeError(wrapper_advice(described_as, needed))
    config = None
    if getattr(kind, "inputs", None) is not None:
        config = declaration({"inputs": kind.inputs, "outputs": getattr(kind, "outputs", [])},
                             f"{described_as}.inputs and .outputs")
    model = kind()
    if device != "cpu":
        model = model.to(device)
    positional = config is not None and not _takes_by_name(
        model.forward, [spec["name"] for spec in config["inputs"]])
    return (InDeclaredOrder if positional else Served)(model.eval(), None, (), config, device)


def _takes_by_name(forward: Any, names: list[str]) -> bool:
    """Whether forward can be given each of names as a keyword argument."""
    parameters = inspect.signature(forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in parameters) or set(names) <= {
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class InDeclaredOrder(Served):
    """An nn.Module whose declared inputs are not forward's parameters: given by
    position, in the order the class declares them."""

    def infer(self, names: tuple[str, ...] | None, datatypes: tuple[str, ...], *arrays: Any
              ) -> tuple:
        """Served.infer's, the inputs put in declared order; ProtocolError (400) where an
        optional input is left out before one that is given (its place would be lost)."""
        if names is None:
            return super().infer(names, datatypes, *arrays)
        given = dict(zip(names, zip(datatypes, arrays)))
        declared = [spec["name"] for spec in self.config["inputs"]]
        present = [name for name in declared if name in given]
        if present != declared[:len(present)]:
            missing = next(name for name in declared if name not in given)
            raise ProtocolError(f"input {missing!r} is missing: forward takes the inputs "
                                f"by position, in the declared order, so each one before "
                                f"the last given must be given", 400)
        return super().infer(None, tuple(given[name][0] for name in present),
                             *(given[name][1] for name in present))


def wrapper_advice(described_as: str, needed: list[str]) -> str:
    """What says that the nn.Module described_as cannot be made without the arguments
    needed, and the class with a ``predict`` that serves it."""
    name = described_as.rpartition(".")[2]
    return (f"{described_as} cannot be made without arguments ({', '.join(needed)}): "
            f"serve a class that makes it, such as\n\n"
            f"    class Served{name}:\n"
            f"        def __init__(self): self.model = {name}(...).eval()\n"
            f"        def predict(self, inputs): return self.model(*map(torch.from_numpy, "
            f"inputs.values()))\n")
