"""A Triton Python-backend model (``REPO/MODEL/config.pbtxt`` and ``REPO/MODEL/N/model.py``
defining ``TritonPythonModel``), as the host sees it: found in a model repository, its
version chosen and its config.pbtxt read, without importing the model's code.  The
interpreters load it with ``multipy._inside.served_triton``.

config.pbtxt is read with protobuf's text format parser against model_config.proto (a
part of Triton's ModelConfig, with its names and numbers).  Fields that Triton knows and
multipy does not read (``optimization``, ``model_warmup``, ...) are skipped, with a
warning that names them.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from .model_config_pb2 import ModelConfig

logger = logging.getLogger("multipy.serve")

#: The file a model's version folder holds, unless default_model_filename names another.
MODEL_FILE = "model.py"
#: The config's name in a model's folder.
CONFIG_FILE = "config.pbtxt"
_INTEGERS = (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64)


class ModelConfigError(ValueError):
    """A model folder that cannot be served: no config.pbtxt or no version with a
    model.py, a config.pbtxt that does not parse, or one for another backend."""


@dataclass(frozen=True)
class TritonModel:
    """A model folder, read: its name, folder, the version served, its model file, its
    config as Triton gives it to ``initialize`` (``args["model_config"]``, a dict of
    ModelConfig's fields by their proto names, every field present), and its instances
    (instance_group's counts summed; None where it sets none)."""

    name: str
    directory: str
    version: str
    model_file: str
    config: dict[str, Any]
    instances: int | None


def is_model_directory(path: str) -> bool:
    """Whether path is a Triton model's folder: it holds a config.pbtxt."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def models_in(repository: str) -> list[str]:
    """The model folders of a Triton model repository, by name; ModelConfigError if it
    holds none."""
    found = sorted(os.path.join(repository, entry) for entry in os.listdir(repository)
                   if is_model_directory(os.path.join(repository, entry)))
    if not found:
        raise ModelConfigError(f"{repository}: no model folder (MODEL/{CONFIG_FILE} with "
                               f"MODEL/1/{MODEL_FILE}) in this model repository")
    return found


def read(directory: str) -> TritonModel:
    """The model in directory, its config.pbtxt read and its version chosen (see
    ``version``); ModelConfigError saying what is wrong.  Read once while the folder
    and its config are unchanged (its warnings said once)."""
    directory = os.path.abspath(directory)
    path = os.path.join(directory, CONFIG_FILE)
    try:
        stamps = (os.stat(directory).st_mtime_ns, os.stat(path).st_mtime_ns)
    except FileNotFoundError:
        raise ModelConfigError(f"{directory}: no {CONFIG_FILE}, which multipy needs to "
                               f"serve a Triton model") from None
    return _read(directory, stamps)


@functools.lru_cache(maxsize=64)
def _read(directory: str, stamps: tuple[int, int]) -> TritonModel:
    name = os.path.basename(directory.rstrip(os.sep))
    path = os.path.join(directory, CONFIG_FILE)
    with open(path) as f:
        text = f.read()
    message = parse(text, path)
    if message.name and message.name != name:
        raise ModelConfigError(f"{path}: name {message.name!r} is not the folder's name "
                               f"{name!r}: a model's name is its folder's, as in Triton")
    backend = message.backend or message.platform
    if backend not in ("", "python"):
        raise ModelConfigError(f"{path}: backend {backend!r}: multipy serves Triton's "
                               f"Python backend only (backend: \"python\")")
    chosen = version(directory, message)
    model_file = os.path.join(directory, chosen, message.default_model_filename or MODEL_FILE)
    if not os.path.isfile(model_file):
        raise ModelConfigError(f"{model_file}: no such file")
    message.name = name
    message.backend = "python"
    groups = message.instance_group
    instances = sum(max(group.count, 1) for group in groups) if groups else None
    return TritonModel(name, directory, chosen, model_file, as_dict(message), instances)


def parse(text: str, where: str) -> ModelConfig:
    """The ModelConfig that text (config.pbtxt's) holds; fields that model_config.proto
    does not have are skipped, with their values, and named in a warning.
    ModelConfigError if it does not parse."""
    try:
        kept, skipped = _known_only(text)
        if skipped:
            logger.warning("%s: multipy does not read %s (skipped)", where,
                           ", ".join(name for name, _ in skipped))
            text = "\n".join(kept)
        config = text_format.Parse(text, ModelConfig())
    except text_format.ParseError as error:
        raise ModelConfigError(f"{where}: {error}") from None
    return config


def _known_only(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(text's tokens less the fields, with their values, that ModelConfig's messages do
    not have where they stand; those fields: each one's name, dotted from the top, and
    its value's tokens)."""
    tokens = []
    tokenizer = text_format.Tokenizer(text.splitlines())
    while not tokenizer.AtEnd():
        tokens.append(tokenizer.token)
        tokenizer.NextToken()
    kept: list[str] = []
    skipped: list[tuple[str, list[str]]] = []
    if _message(tokens, 0, ModelConfig.DESCRIPTOR, kept, skipped, "") != len(tokens):
        raise text_format.ParseError("a '}' closes no message")
    return kept, skipped


def _message(tokens: list[str], i: int, descriptor: Descriptor, kept: list[str],
             skipped: list[tuple[str, list[str]]], path: str) -> int:
    """Copies the fields of a message of descriptor from tokens[i:] into kept, up to the
    '}' or '>' that closes it (or the end); returns that token's index."""
    while i < len(tokens) and tokens[i] not in ("}", ">"):
        name = tokens[i]
        if name in (",", ";"):
            i += 1
            continue
        field = descriptor.fields_by_name.get(name)
        end = _value_end(tokens, i + 1)
        if field is None:
            skipped.append((path + name, tokens[i + 1:end]))
            i = end
            continue
        if field.message_type is None:
            kept.extend(tokens[i:end])
            i = end
            continue
        kept.append(name)
        i += 1
        while i < end:
            token = tokens[i]
            kept.append(token)
            i += 1
            if token in ("{", "<"):
                i = _message(tokens, i, field.message_type, kept, skipped, f"{path}{name}.")
                kept.append(tokens[i])
                i += 1
    return i


def _value_end(tokens: list[str], i: int) -> int:
    """The index just past the value of a field whose name is at i - 1: a scalar (strings
    that follow one another are one), or a bracketed block or list."""
    if i < len(tokens) and tokens[i] == ":":
        i += 1
    if i >= len(tokens):
        raise text_format.ParseError("a field without a value at the end")
    if tokens[i] not in ("{", "<", "["):
        i += 1
        while i < len(tokens) and tokens[i][:1] in ("'", '"') and tokens[i - 1][:1] in ("'", '"'):
            i += 1
        return i
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j] in ("{", "<", "["):
            depth += 1
        elif tokens[j] in ("}", ">", "]"):
            depth -= 1
            if not depth:
                return j + 1
    raise text_format.ParseError(f"{tokens[i]!r} is not closed")


def version(directory: str, config: ModelConfig) -> str:
    """The version of the model in directory that is served: the highest numbered
    folder, of those ``version_policy`` names where it is ``specific`` (``latest`` and
    ``all``: the highest too, as one version is served).  ModelConfigError if none."""
    numbered = sorted((int(entry) for entry in os.listdir(directory)
                       if entry.isdigit() and os.path.isdir(os.path.join(directory, entry))),
                      reverse=True)
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") == "specific":
        wanted = set(policy.specific.versions)
        numbered = [number for number in numbered if number in wanted]
    if not numbered:
        raise ModelConfigError(f"{directory}: no version folder (1/{MODEL_FILE}, ...)" +
                               (" that version_policy names" if policy.HasField("specific")
                                else ""))
    return str(numbered[0])


def as_dict(config: ModelConfig) -> dict[str, Any]:
    """config as Triton gives it to a model in JSON: every field, by its proto name,
    enums by name, 64-bit integers as numbers (protobuf's JSON writes them as strings)."""
    found = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True)
    return _numbers(config.DESCRIPTOR, found)


def _numbers(descriptor: Descriptor, value: dict[str, Any]) -> dict[str, Any]:
    """value (a message of descriptor as a dict) with its 64-bit integers as numbers."""
    for field in descriptor.fields:
        if field.name not in value:
            continue
        item = value[field.name]
        if field.type in _INTEGERS:
            value[field.name] = [int(x) for x in item] if isinstance(item, list) else int(item)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for each in item if isinstance(item, list) else [item]:
                _numbers(field.message_type, each)
    return value

