"""What the host and the code inside interpreters agree on: operations, statuses, and
the record of an error raised inside.  Standard library only: both sides import it.

A request is (op, target, epoch, body): ``target`` is the handle of the object the
operation acts on (0 for none); ``epoch`` counts the resets of the interpreter, and a
request of an earlier epoch (from a manager that closed) is refused with CLOSED;
``body`` holds the operation's arguments, by marshal when they are plain, else by
pickle (``multipy._sharing``: the first byte tells which).  The reply is (status,
handle, payload).  The C that carries both is in ``_entry.h``, whose numbers these
mirror.
"""
from __future__ import annotations

import os
import struct
from typing import NamedTuple

#: The call path: "c", the common call's fast path in C on both sides (the default), or
#: "python", the reference path, every request by the Python code alone; read once, at
#: import, from the environment variable MULTIPY_CALL_PATH (docs/design.md, "The call
#: path").  Interpreters read the host's environment, so both sides agree.
C_CALL_PATH = os.environ.get("MULTIPY_CALL_PATH", "c") != "python"

# -- operations: what a request asks the interpreter to do --
GLOBAL = 0      #: args (module, name): import module, follow the dotted name; a new object
CALL = 1        #: args (args, kwargs): call target; the result stays inside, a new object
CALL_VALUE = 2  #: args (method or None, args, kwargs): call target or its method; a value
GETATTR = 3     #: args (name,): the attribute, a new object
HASATTR = 4     #: args (name,): bool
DEREF = 5       #: args (): the target itself, as a value
RESET = 6       #: args (): forget every object and registered source (a manager closed);
                #: its epoch is the interpreter's new one
CALL_LENT = 7   #: args (method or None, args, positions, kwargs): CALL_VALUE whose args
                #: are scalars and tensors, each tensor (at positions) sent as its record
                #: (multipy._sharing.lend_flat); the fast path of a call with tensors
CALL_TENSOR = 8  #: body: CALL_VALUE of target with one CPU torch tensor alone, lent: its
                 #: record's token and address (LENT_TENSOR), no marshal; the C entry's

OP_NAMES = ("import", "call", "call", "getattr", "hasattr", "deref", "reset", "call", "call")

# -- statuses of a reply --
OK = 0       #: payload: the value (marshal or pickle), or empty when handle names a new object
ERROR = 1    #: payload: a RemoteError, by marshal
CLOSED = 2   #: the interpreter is stopped; nothing ran
BROKEN = 3   #: multipy's own code inside raised; payload: "Type: message", UTF-8
CANCELLED = 4  #: cancelled before it started: nothing ran
LENT = 5     #: payload: (values, positions, single) by marshal, the value (values[0] if
             #: single, else the tuple) with a tensor's record at each of positions
TENSOR = 6   #: payload: the value, one CPU torch tensor lent: the token and address of
             #: its record, two unsigned 64-bit numbers in this machine's order
             #: (LENT_TENSOR.unpack; the C fast path's reply for a tensor result)

#: How a TENSOR reply's payload, and a CALL_TENSOR's body, are laid out (_entry.h: struct
#: multipy_lent_tensor).
LENT_TENSOR = struct.Struct("=QQ")

# -- what a cancel raises in the call --
CANCEL_TIMEOUT = 0    #: the interpreter's _multipy_bootstrap.CallCancelled
CANCEL_INTERRUPT = 1  #: KeyboardInterrupt


class RemoteError(NamedTuple):
    """An exception raised inside, as the host receives it."""

    #: the exception pickled, when it is an Exception that pickles and unpickles inside
    pickled: bytes | None
    #: its type's qualified name, such as "builtins.ValueError"
    type_name: str
    message: str
    traceback: str
    #: None once the request was read whole; else the tokens of what the host lent that
    #: the interpreter aliased before reading failed (the host takes back the rest)
    aliased: tuple[int, ...] | None = None
