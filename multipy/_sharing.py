"""Zero-copy sharing of tensor and array memory between the host and interpreters.

Host and interpreters share one address space, so a CPU tensor or numpy array crosses
a call as a record of its memory (address, size, dtype, shape, strides) instead of its
bytes.  The sending side *exports* the object: it keeps it alive under a token.  The
receiving side builds an *alias* over the same memory; when the last view of the alias
dies, the token goes back to the owner, whose own thread releases the object
(docs/design.md, "memory": memory is only ever freed by the side that allocated
it).

Used on both sides: each has its own ``Exports`` and makes its own aliases.
"""
from __future__ import annotations

import ctypes
import functools
import io
import itertools
import pickle
import sys
import threading
import types
from typing import Any, Callable, Iterable, Iterator

TORCH, NUMPY = "torch", "numpy"

#: Types that are never lent: the common case, rejected before any other check
#: (functions: a lent object's pickle names the function ``lent``).
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray, tuple,
                    list, dict, set, frozenset, type, types.FunctionType})


class Exports:
    """Objects this side lent out, by token, until the other side releases them."""

    def __init__(self, tokens: Iterator[int] | None = None) -> None:
        """tokens: where tokens come from, to share a numbering with other ids."""
        #: token -> object; the host's C entry drops the tokens an interpreter gives back
        self.objects: dict[int, Any] = {}
        self._tokens = itertools.count(1) if tokens is None else tokens
        self._lock = threading.Lock()

    def export(self, obj: Any) -> int:
        with self._lock:
            token = next(self._tokens)
            self.objects[token] = obj
        return token

    def release(self, token: int) -> None:
        with self._lock:
            self.objects.pop(token, None)

    def __len__(self) -> int:
        return len(self.objects)

    def after_fork(self) -> None:
        """In a forked child: the lock may have been held by a thread that is gone."""
        self._lock = threading.Lock()


def describe(obj: Any, exports: Exports) -> tuple | None:
    """The record that lends obj's memory to the other side, or None if obj is pickled
    as usual instead: anything but a CPU strided tensor or a plain numpy array, and the
    cases an alias could not represent faithfully (lazy conjugate or negative views,
    read-only or structured arrays).  Tensors that require grad cross detached.  The
    owner must not resize or re-point (set_) a tensor while it is lent.  Few calls into
    torch: this runs for every value pickled."""
    if type(obj) in _PLAIN:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and type(obj) is torch.Tensor:  # subclasses (Parameter) are copied
        if (obj.device.type != "cpu" or obj.layout is not torch.strided or obj.is_quantized
                or obj.is_nested or obj.is_conj() or obj.is_neg()):
            return None
        dtype, shape, strides = _dtype_name(obj.dtype), tuple(obj.shape), obj.stride()
        if obj.numel() == 0:
            return (TORCH, 0, 0, 0, dtype, shape, strides, 0)
        storage = obj.untyped_storage()  # lent, not the tensor: set_() cannot free it
        return (TORCH, exports.export(storage), storage.data_ptr(), storage.nbytes(), dtype,
                shape, strides, obj.storage_offset())
    numpy = sys.modules.get("numpy")
    if (numpy is not None and type(obj) is numpy.ndarray and not obj.dtype.hasobject
            and obj.dtype.fields is None and obj.flags.writeable):
        low = sum((n - 1) * s for n, s in zip(obj.shape, obj.strides) if s < 0 and n)
        high = sum((n - 1) * s for n, s in zip(obj.shape, obj.strides) if s > 0 and n)
        nbytes = (high - low + obj.itemsize) if obj.size else 0
        token = exports.export(obj) if nbytes else 0
        return (NUMPY, token, obj.__array_interface__["data"][0] + low, nbytes,
                obj.dtype.str, obj.shape, obj.strides, -low)
    return None


_dtype_names: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rpartition(".")[2]
    return name


#: A message with nothing lent and no handle in it is pickled with PLAIN_PROTOCOL and
#: read by pickle.loads, the fast path; any other with MESSAGE_PROTOCOL and read by an
#: AliasingUnpickler.  The protocol byte (data[1]) tells a reader which it has.
PLAIN_PROTOCOL = 4
MESSAGE_PROTOCOL = pickle.HIGHEST_PROTOCOL  # 5: numpy keeps read-only arrays read-only

_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def is_plain(value: Any) -> bool:
    """Whether value certainly pickles with nothing to lend: a scalar, or a tuple, list
    or dict of scalars.  A quick test, not a walk: deeper values take the general path."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is tuple or kind is list:
        for item in value:
            if type(item) not in _SCALARS:
                return False
        return True
    if kind is dict:
        for key, item in value.items():
            if type(key) not in _SCALARS or type(item) not in _SCALARS:
                return False
        return True
    return False


def lent(record: tuple) -> Any:
    """Stands for a lent tensor or array in a message: only an AliasingUnpickler can
    read one (it makes the alias)."""
    raise pickle.UnpicklingError("a lent tensor or array can only be read by multipy")


def handle(number: int) -> Any:
    """Stands for an object inside an interpreter (a host Obj) in a request: only the
    interpreter's unpickler can read one."""
    raise pickle.UnpicklingError("an object handle can only be read by its interpreter")


class LendingPickler(pickle.Pickler):
    """Pickles a message, lending CPU tensors and arrays (see describe) instead of
    copying them; remembers what it lent, so that a message that is not sent can take
    it back.

    Lent objects are written as a reduction to ``lent(record)``: pickle consults
    ``reducer_override`` only for objects that are not of a built-in type, so plain
    values cost nothing extra, and an object met twice is lent once (the memo).
    """

    def __init__(self, exports: Exports) -> None:
        self._buffer = io.BytesIO()
        super().__init__(self._buffer, protocol=MESSAGE_PROTOCOL)
        self._exports = exports
        self._lent: list[int] = []

    def dumps(self, value: Any) -> bytes:
        """The message for value; if pickling fails, nothing stays lent."""
        try:
            self.dump(value)
        except BaseException:
            self.take_back()
            raise
        return self._buffer.getvalue()

    def reducer_override(self, obj):
        record = describe(obj, self._exports)
        if record is None:
            return NotImplemented
        if record[1]:
            self._lent.append(record[1])
        return lent, (record,)

    def take_back(self, aliased: Iterable[int] = ()) -> None:
        """Releases what this pickler lent, but for the tokens the other side aliased."""
        kept = set(aliased)
        for token in self._lent:
            if token not in kept:
                self._exports.release(token)


class AliasingUnpickler(pickle.Unpickler):
    """Unpickles a message (``load()``), turning what the other side lent into aliases;
    on_release(token) runs when an alias and all its views are gone.  ``aliased`` lists
    the tokens aliased so far (each before its alias exists): if reading fails, what the
    other side lent and is not in it may be taken back."""

    def __init__(self, data: bytes, on_release: Callable[[int], None]) -> None:
        super().__init__(io.BytesIO(data))
        self._on_release = on_release
        self.aliased: list[int] = []

    def find_class(self, module: str, name: str) -> Any:
        # What this returns stays in the memo: it must not refer to the unpickler, or the
        # memo (and every alias in it) would live on in a cycle until a garbage collection.
        if module == __name__ and name == "lent":
            return functools.partial(alias, on_release=self._on_release, on_alias=self.aliased.append)
        return super().find_class(module, name)


class _Anything:
    """Stands for every class while a message is read only for the tokens it lends."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Anything:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _TokenReader(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.tokens: list[int] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "lent":
            return self._lent
        return _Anything

    def _lent(self, record: tuple) -> None:
        if record[1]:
            self.tokens.append(record[1])


def lent_tokens(data: bytes) -> list[int]:
    """The tokens of everything a message lends, as far as it can be read without the
    classes it names: what to give back when the message itself cannot be read."""
    reader = _TokenReader(data)
    try:
        reader.load()
    except Exception:
        pass  # what was read so far is all there is to give back
    return reader.tokens


class _Release:
    """Rides on the buffer under an alias: when the last view of the alias is gone, the
    buffer dies and this gives the token back to the owner."""

    __slots__ = ("due",)

    def __init__(self, token: int, callback: Callable[[int], None]) -> None:
        self.due = (callback, token)  # one store: an interrupted __init__ leaves nothing due

    def __del__(self) -> None:
        due = getattr(self, "due", None)
        if due is not None:
            due[0](due[1])


def alias(record: tuple, on_release: Callable[[int], None],
          on_alias: Callable[[int], None] = lambda token: None) -> Any:
    """An object over the memory a record describes; on_release(token) runs when the
    alias and every view of it are gone."""
    kind, token, address, nbytes, dtype, shape, strides, offset = record
    buffer = None
    if nbytes:
        # In this order, an exception at any point (a cancel raises one anywhere) leaves
        # the token either not yet noted (the owner takes it back) or due to be released.
        release = _Release(token, on_release)
        on_alias(token)
        buffer = (ctypes.c_char * nbytes).from_address(address)
        buffer.release = release
    if kind == TORCH:
        import torch

        dtype = getattr(torch, dtype)
        if buffer is None:
            return torch.empty_strided(shape, strides, dtype=dtype)
        flat = torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize)
        return flat.as_strided(shape, strides, offset)
    import numpy

    if buffer is None:
        return numpy.empty(shape, dtype=numpy.dtype(dtype))
    return numpy.ndarray(shape, numpy.dtype(dtype), buffer=buffer, offset=offset, strides=strides)
