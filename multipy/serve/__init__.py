"""``multipy serve``: torch.package models over HTTP with the Open Inference Protocol.

Modules, each importing only those before it: ``protocol`` (the wire format, numpy
only), ``batching`` (dynamic batching), ``metrics`` (Prometheus), ``archive`` (an
archive's storages, mapped without torch), ``models`` (one model on every interpreter),
``progress`` (the start-up bar), ``service`` (a server's options, models, start-up,
timeouts), ``app`` (the Starlette application), ``on_ray`` (``--ray``: the same
application in each replica of a Ray Serve deployment, and its driver; imported only
then), ``main`` (the command line and uvicorn).  The host never imports torch; the code
inside the interpreters is ``multipy._inside.serving``.  Needs the ``serve`` extra:
``pip install 'multipy[serve]'`` (``--ray``: the ``ray`` extra).  docs/serving.md is the
guide.
"""
