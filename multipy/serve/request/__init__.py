"""The request path that the host and every interpreter's front end share: a request
decoded (``messages``, the protocol's records and errors without numpy; ``protocol``, the
wire format; ``tensors``, a tensor's data in it), checked and run (``requests``: one model's requests, batched by
``batching``, refused if it crashed server processes, ``poison``), answered
(``inference``: the one path every transport takes), counted (``metrics``, over a board
every interpreter writes a row of), the model repository's requests checked
(``repository``), the restricted APIs' headers checked (``restricted``), and the seams
typed (``contract``).  Nothing here imports the host's
API: each module runs inside interpreters as well as in the host.
"""
