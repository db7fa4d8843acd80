"""HTTP: uvicorn's server without its command line (``uvicorn_server``) and the protocol
each connection is served with (``uvicorn_protocol``), the two modules that reach into
uvicorn's package; one connection under the limits a server on the
open network needs (``connection``), the Starlette application of the protocol's routes
(``app``), and the pipe through which the host hands accepted connections to an
interpreter's front end (``inbox``).  Runs in the host and inside every interpreter.
"""
