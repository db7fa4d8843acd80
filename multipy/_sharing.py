"""Zero-copy sharing of tensor and array memory between the host and interpreters.

Host and interpreters share one address space, and one CUDA context, so a tensor (on
the CPU or a CUDA device) or a numpy array crosses a call as a record of its memory
instead of its bytes: the address of a DLPack description (multipy/_dlpack.h).  The
sending side *exports* the object: it keeps the DLPack capsule under a token.  The receiving side builds an *alias* over the same memory;
when the last view of the alias dies, the token goes back to the owner, which drops the
capsule (docs/design.md, "memory": memory is only ever freed by the side that allocated
it).

A CUDA tensor keeps the order of the GPU's work both ways: the receiver's current stream
waits (on the GPU) for an event recorded on the sender's when it was lent, and when the
alias dies the owner's caching allocator is told that the receiver's stream used the
memory (``record_stream``), so that it reuses the memory only after that work is done.

Used on both sides: each has its own ``Exports`` and makes its own aliases.
"""
from __future__ import annotations

import ctypes
import functools
import io
import itertools
import marshal
import pickle
import sys
import threading
import types
from typing import Any, Callable, Iterable, Iterator

from . import _cuda, _protocol

try:  # multipy's C: inside an interpreter its bootstrap module, in the host _host
    import _multipy_bootstrap as _c
    _INSIDE = True
except ImportError:
    from . import _host as _c
    _INSIDE = False

TORCH, NUMPY, CUDA = "torch", "numpy", "cuda"

#: Types that are never lent: the common case, rejected before any other check
#: (functions: a lent object's pickle names the function ``lent``).
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray, tuple,
                    list, dict, set, frozenset, type, types.FunctionType})


class Lent:
    """What one message lent: given back, unless the other side aliased it, when the
    message is not sent or not read whole."""

    def __init__(self, exports: Exports) -> None:
        self.exports = exports
        #: the tokens lent so far; multipy's C lends into these three (_lend.h)
        self.tokens: list[int] = []
        self.objects = exports.objects
        self.counter = exports.counter

    def export(self, obj: Any) -> int:
        """Lends obj for this message: its new token."""
        return self.exports.export(obj, self.tokens)

    def unread(self, status: int, payload: bytes) -> None:
        """Takes back what the other side did not alias, for a reply (status, payload)
        to this message that will not be read: nothing if the call ran."""
        if status == _protocol.CANCELLED or status == _protocol.CLOSED:
            self.take_back()
        elif status == _protocol.ERROR:
            aliased = _protocol.RemoteError(*marshal.loads(payload)).aliased
            if aliased is not None:
                self.take_back(aliased)

    def take_back(self, aliased: Iterable[int] = ()) -> None:
        """Releases what this message lent, but for the tokens the other side aliased."""
        kept = set(aliased)
        for token in self.tokens:
            if token not in kept:
                self.exports.release(token)
        self.tokens = [token for token in self.tokens if token in kept]


class Exports:
    """Objects this side lent out, by token, until the other side releases them.

    No lock: each step is one operation on a dict, list or counter, which the GIL makes
    atomic (and a lock would deadlock a signal handler that lends while its thread
    holds it)."""

    def __init__(self, tokens: Iterator[int] | None = None) -> None:
        """tokens: where tokens come from, to share a numbering with other ids."""
        #: token -> object; the host's C entry drops the tokens an interpreter gives back
        self.objects: dict[int, Any] = {}
        self.counter = itertools.count(1) if tokens is None else tokens

    def export(self, obj: Any, noted: list[int]) -> int:
        """Keeps obj under a new token, appended to noted before obj is kept: an
        exception at any point leaves nothing kept that noted does not name."""
        token = next(self.counter)
        noted.append(token)
        self.objects[token] = obj
        return token

    def release(self, token: int) -> None:
        self.objects.pop(token, None)

    def __len__(self) -> int:
        return len(self.objects)


def describe(obj: Any, lent: Lent) -> tuple | None:
    """The record that lends obj's memory to the other side, or None if obj is pickled
    as usual instead: anything but a strided tensor (CPU or CUDA) or a numpy array, and the cases
    an alias could not represent faithfully (lazy conjugate or negative views; arrays
    that DLPack cannot describe: read-only, byte-swapped, structured or of objects).
    Tensors that require grad cross detached.  The owner must not resize a tensor or
    array while it is lent.  Few calls into torch: this runs for every value pickled."""
    kind = type(obj)
    if kind in _PLAIN:
        return None
    # getattr: another thread may be importing torch or numpy (its module not complete yet;
    # a value made before the module names its class is pickled as usual)
    if kind is getattr(sys.modules.get("torch"), "Tensor", None):  # subclasses are copied
        if _dlpack is None:
            _use_torch()
        if obj.is_cuda:
            return _cuda_record(obj, lent)
        return _c.lend_tensor(obj, lent)  # None: lazy views, sparse (_lend.h)
    if kind is getattr(sys.modules.get("numpy"), "ndarray", None):
        return _array_record(obj, lent)
    return None


#: (to_dlpack, from_dlpack) of this side's torch, once it is imported: torch's C
#: functions (torch.from_dlpack first asks a capsule for __dlpack__, and so on), which
#: multipy's C lends and aliases tensors with (_lend.h).
_dlpack: tuple[Callable, Callable] | None = None


def _use_torch() -> tuple[Callable, Callable]:
    global _dlpack
    import torch

    dlpack = (torch.utils.dlpack.to_dlpack,
              getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack)
    _c.use_torch(torch.Tensor, *dlpack)
    _dlpack = dlpack
    return dlpack


class _CudaLoan:
    """A CUDA tensor lent: its capsule and detached view, the event recorded on the
    sender's stream when it was lent, and where the receiver notes its own stream
    (-1 until it aliases).  Dropped when the token comes back: then the owner's caching
    allocator is told that the receiver's stream used the memory."""

    __slots__ = ("capsule", "tensor", "event", "stream")

    def __init__(self, capsule: Any, tensor: Any, event: Any) -> None:
        self.capsule = capsule
        self.tensor = tensor
        self.event = event
        self.stream = (ctypes.c_int64 * 1)(-1)

    def __del__(self) -> None:
        stream = self.stream[0]
        torch = sys.modules.get("torch")
        if stream < 0 or torch is None or sys.is_finalizing():  # never aliased, or exiting
            return
        device = self.tensor.device
        self.tensor.record_stream(torch.cuda.ExternalStream(stream, device=device) if stream
                                  else torch.cuda.default_stream(device))


def _cuda_record(tensor: Any, lent: Lent) -> tuple | None:
    """describe for a CUDA tensor: (CUDA, token, (address, event, stream slot, device,
    sender's stream))."""
    if tensor.is_conj() or tensor.is_neg():  # lazy views, which DLPack would not describe
        return None
    import torch

    view = tensor.detach()
    try:
        capsule = _dlpack[0](view)
    except (RuntimeError, BufferError, TypeError):  # sparse, quantized, nested...
        return None
    device = view.device.index
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(stream)
    loan = _CudaLoan(capsule, view, event)
    details = (_c.lent_address(capsule), event.cuda_event, ctypes.addressof(loan.stream), device,
               stream.cuda_stream)
    return (CUDA, lent.export(loan), details)


class _CallerStreams(threading.local):
    """Per thread, inside an interpreter: the (stream, device) of the host threads whose
    CUDA tensors the running call aliased (a class default: reading never raises)."""

    pending: tuple = ()


_caller_streams = _CallerStreams()
#: CUDA tensors aliased on this side so far: while 0, a call has nothing to order
cuda_aliases = 0
#: Inside an interpreter: gives the calling thread the interpreter's torch settings (its
#: CUDA stream among them), before a CUDA alias is made on that stream
settle_thread: Callable[[], None] | None = None


def _alias_cuda(record: tuple, source: int, aliased: list[int] | None) -> Any:
    """alias for a CUDA record: this thread's current stream waits for the sender's
    event first, and the sender learns which stream that is."""
    global cuda_aliases
    import torch

    _, token, (address, event, slot, device, sender) = record
    torch.cuda.init()  # once: CUDA may start here, with the first CUDA tensor to come in
    if settle_thread is not None:
        settle_thread()
    stream = torch.cuda.current_stream(device).cuda_stream
    _stream_wait_event(stream, event, device)
    ctypes.c_int64.from_address(slot).value = stream
    capsule = _c.alias_capsule(address, token, source)
    if aliased is not None:
        aliased.append(token)
    tensor = _dlpack[1](capsule)
    cuda_aliases += 1
    if _INSIDE:
        _caller_streams.pending += ((sender, device),)
    return tensor


def order_after_call() -> None:
    """Inside an interpreter, when a call ends: the stream of each host thread whose CUDA
    tensors the call aliased waits (on the GPU) for the work this thread queued on its
    own, so that what the call wrote into them is seen in order, as a reply's tensors are.
    Cheap to call after every call: nothing to do unless CUDA tensors came in."""
    pending = _caller_streams.pending
    if not pending:
        return
    _caller_streams.pending = ()
    import torch

    for stream, device in set(pending):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        _stream_wait_event(stream, event.cuda_event, device)


def _stream_wait_event(stream: int, event: int, device: int) -> None:
    """Makes ``stream`` (a CUstream; 0 is the legacy default stream) wait, on the GPU, for
    the work recorded before ``event`` (a CUevent) on ``device``: no thread waits.  The
    device's primary context is current for the call, whichever thread this is.  The
    driver is the process's one (in an interpreter, its forwarder: docs/design.md, "CUDA");
    RuntimeError if it refuses."""
    with _cuda.primary_context(device):
        _cuda.call("cuStreamWaitEvent", ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)


def _array_record(array: Any, lent: Lent) -> tuple | None:
    """describe for a numpy.ndarray: lent by DLPack too."""
    if not array.flags.writeable:  # DLPack 0.8 cannot say read-only
        return None
    try:
        capsule = array.__dlpack__()
    except (BufferError, TypeError):  # byte-swapped, structured, objects
        return None
    return (NUMPY, lent.export(capsule), _c.lent_address(capsule))


def lend_flat(values: tuple | list, lent: Lent) -> tuple[tuple, tuple[int, ...]] | None:
    """The fast path for a flat sequence of scalars, tuples of scalars, tensors and
    arrays: values as a tuple, with each tensor's or array's record in its place (an
    equal copy, one token, for one met twice, as pickle's memo would), and those places;
    lent notes the tokens.  None, with nothing lent, if a value is anything else or one
    that describe would not lend; whatever this raises, nothing stays lent.  In C
    (_lend.h), which lends torch tensors itself and asks describe for the rest."""
    return _c.lend_flat(values, lent, describe)


def lend_result(value: Any, lent: Lent) -> tuple | None:
    """A LENT reply's (values, positions, single) for a tensor, an array, or a tuple that
    lend_flat takes, or None."""
    single = type(value) is not tuple
    flat = _c.lend_flat((value,) if single else value, lent, describe)
    return None if flat is None else (*flat, single)


def alias_flat(values: tuple, positions: tuple[int, ...], source: int,
               aliased: list[int]) -> list:
    """values (from lend_flat) with an alias in place of each record (one alias for a
    record met twice); aliased as for alias.  In C (_lend.h), which aliases torch
    tensors itself and asks alias for the rest."""
    return _c.alias_flat(values, positions, source, aliased, alias)


#: A message is a marshal when its values are plain (``plain``), and lent records are
#: (``lend_flat``): the fast path; any other is a pickle, written by a LendingPickler
#: (MESSAGE_PROTOCOL) and read by an AliasingUnpickler.  A pickle's first byte is always
#: PICKLED (its PROTO opcode), which a marshal's never is: the first byte tells them apart.
PICKLED = 0x80
MESSAGE_PROTOCOL = pickle.HIGHEST_PROTOCOL  # 5: numpy keeps read-only arrays read-only

#: plain(value) -> bytes | None: value marshalled if it is plain (scalars, and tuples,
#: lists and dicts of plain values, of exact types, nested a little), else None.
plain = _c.plain

_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def is_plain(value: Any) -> bool:
    """Whether value is certainly plain (see ``plain``): a scalar, or a tuple, list or
    dict of scalars.  A quick test, not a walk: deeper values take the general path."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if (kind is tuple or kind is dict) and not value:  # the empty arguments of most calls
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

    def __init__(self, lent: Lent) -> None:
        """lent: where what this pickler lends is noted (and taken back from if
        pickling fails)."""
        self._buffer = io.BytesIO()
        super().__init__(self._buffer, protocol=MESSAGE_PROTOCOL)
        self.lent = lent

    def dumps(self, value: Any) -> bytes:
        """The message for value; if pickling fails, nothing stays lent."""
        try:
            self.dump(value)
        except BaseException:
            self.lent.take_back()
            raise
        return self._buffer.getvalue()

    def reducer_override(self, obj):
        record = describe(obj, self.lent)
        if record is None:
            return NotImplemented
        return lent, (record,)


class AliasingUnpickler(pickle.Unpickler):
    """Unpickles a message (``load()``), turning what the other side lent into aliases,
    whose tokens go back through multipy's C to interpreter ``source`` (in the host: the
    interpreter that sent the message).  ``aliased`` lists the tokens aliased so far:
    if reading fails, what the other side lent and is not in it may be taken back."""

    def __init__(self, data: bytes, source: int = 0, aliased: list[int] | None = None) -> None:
        """aliased: the list to note aliased tokens in (a new one by default)."""
        super().__init__(io.BytesIO(data))
        self._source = source
        self.aliased: list[int] = [] if aliased is None else aliased

    def find_class(self, module: str, name: str) -> Any:
        # What this returns stays in the memo: it must not refer to the unpickler, or the
        # memo (and every alias in it) would live on in a cycle until a garbage collection.
        if module == __name__ and name == "lent":
            return functools.partial(alias, source=self._source, aliased=self.aliased)
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


def lent_tokens(data: bytes, status: int = _protocol.OK) -> list[int]:
    """The tokens of everything a message (a reply of that status) lends, as far as it
    can be read without the classes it names: what to give back when the message itself
    cannot be read."""
    if status == _protocol.LENT:
        values, positions, _ = marshal.loads(data)
        return [values[position][1] for position in positions]
    if status == _protocol.TENSOR:
        return [_protocol.LENT_TENSOR.unpack(data)[0]]
    if not data or data[0] != PICKLED:  # a plain value lends nothing
        return []
    reader = _TokenReader(data)
    try:
        reader.load()
    except Exception:
        pass  # what was read so far is all there is to give back
    return reader.tokens


class _Exported:
    """A DLPack capsule as numpy.from_dlpack takes it (numpy reads no bare capsule)."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **unused: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # the CPU


#: Whether this side's numpy reads DLPack 1.0 capsules (2.1 and later), whose flags let
#: an alias of a writable array be writable; None until the first array alias.
_numpy_reads_versioned: bool | None = None


def alias(record: tuple, source: int = 0, aliased: list[int] | None = None) -> Any:
    """A tensor or array over the memory a record describes, whose token goes back
    through multipy's C to interpreter ``source`` (in the host) when the alias and every
    view of it are gone.  The token is appended to aliased once it will go back that way."""
    # In this order, an exception at any point (a cancel raises one anywhere) leaves the
    # token either not yet noted (the owner takes it back) or due to be released.
    kind, token, address = record
    if kind == TORCH:
        if _dlpack is None:
            _use_torch()
        return _c.alias_tensor(record, source, aliased)  # in C (_lend.h), the same order
    if kind == CUDA:
        if _dlpack is None:
            _use_torch()
        return _alias_cuda(record, source, aliased)
    import numpy

    global _numpy_reads_versioned
    if _numpy_reads_versioned is None:
        _numpy_reads_versioned = numpy.lib.NumpyVersion(numpy.__version__) >= "2.1.0"
    capsule = _c.alias_capsule(address, token, source, _numpy_reads_versioned)
    if aliased is not None:
        aliased.append(token)
    return numpy.from_dlpack(_Exported(capsule))
