"""``multipy serve --processes``: the link between the supervisor and a server process
(``link``), a process's side of it (``supervised``), and the supervisor (``supervisor``),
which runs no interpreter; ``tasks`` keeps what both start on their event loops.
"""
