"""``multipy serve``: torch.package models over HTTP with the Open Inference Protocol.

Modules, each importing only those before it. First the request path that the host and
every interpreter's front end (``multipy._inside.front_end``) share: ``uvicorn_server``
(uvicorn's server without its command line), ``messages`` (the protocol's requests and
errors, without numpy), ``protocol`` (the wire format, numpy only), ``batching``
(dynamic batching), ``metrics`` (Prometheus, over a board every interpreter writes a row
of), ``poison`` (inputs refused for having crashed server processes), ``requests`` (one
model's requests, from decoded request to outputs), ``app`` (the Starlette application).
Then the host's: ``archive`` (where an archive's storages lie, read without torch or
numpy), ``models`` (one model on every interpreter), ``progress`` (the start-up bar),
``service`` (a server's options, models and start-up), ``on_ray`` (``--ray``: the same
application in each replica of a Ray Serve deployment, and its driver; imported only
then), ``link``, ``supervised`` and ``supervisor`` (``--processes``: each process's side
and the supervisor), ``main`` (the command line, uvicorn, and the hand-over of
connections to the interpreters' front ends). The host never imports torch, nor numpy
until it decodes an inference request itself (in Ray Serve's replicas, or while every
interpreter is stuck); the code inside the interpreters is ``multipy._inside.serving``
and ``multipy._inside.front_end``. Needs the ``serve`` extra: ``pip install
'multipy[serve]'`` (``--ray``: the ``ray`` extra).
docs/serving.md is the guide.
"""
from __future__ import annotations

from .messages import InvalidInput

__all__ = ["InvalidInput"]
