"""``multipy serve``: models over HTTP and gRPC with the Open Inference Protocol.

Its sub-packages, each importing only those before it (tests/test_layers.py):

- ``request``: the request path that the host and every interpreter's front end
  (``multipy._inside.front_end``) share: a request decoded, checked, run, answered and
  counted, whatever carried it.  This is where a request is parsed into tensors and where
  a model's call is made (``request.requests``).
- ``http``: uvicorn's server without its command line, one connection under limits, the
  Starlette application, and the pipe that hands connections to a front end.
- ``rpc``: gRPC, on the same request path.
- ``host``: the host's side: archives and classes, one model on every interpreter, a
  server's options, start-up and repository, the front ends as the host runs them.
- ``processes``: ``--processes``, the supervisor and each process's side of it.

Then ``on_ray`` (``--ray``: the same application in each replica of a Ray Serve
deployment, and its driver; imported only then), ``command`` (the command line) and
``main`` (the server's life).  The host never imports torch, nor numpy until it decodes
an inference request itself (in Ray Serve's replicas, or while every interpreter is
stuck); the code inside the interpreters is ``multipy._inside.serving`` and
``multipy._inside.front_end``.  Needs the ``serve`` extra: ``pip install
'multipy-interpreters[serve]'`` (``--ray``: the ``ray`` extra).  docs/serve/ and docs/operate/ are the guides.
"""
from __future__ import annotations

from .request.messages import InvalidInput

__all__ = ["InvalidInput"]
