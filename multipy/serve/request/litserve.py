"""LitServe's requests, as the host and each interpreter pass them: a ``POST`` to a
``litserve.LitAPI``'s path (``/predict`` unless its ``api_path`` says otherwise) crosses
as one inference request of the Open Inference Protocol, so that it takes the path every
other request takes (turns, batching, timeouts, metrics).  Its body is the BYTES input
REQUEST, one row; the model answers each row with the INT32 output STATUS (the HTTP
status) and the BYTES output BODY (the answer's JSON: the API's encoded response, or
``{"detail": ...}`` for an error), one row each (multipy._inside.served_litserve).
"""
from __future__ import annotations

from .messages import Tensor

#: The input that carries a LitServe request's body, and the outputs of its answer.
REQUEST, STATUS, BODY = "litserve_request", "litserve_status", "litserve_body"
#: The paths a LitAPI may not have: the server's own routes (LitServe's and multipy's).
_TAKEN = ("/health", "/info", "/metrics", "/v2")
#: The key of a model's metadata (multipy.serve.request.requests.ModelRequests.described)
#: that says it is a LitAPI, and the path it answers on.
API_PATH = "api_path"


def answer(outputs: list[Tensor]) -> tuple[int, bytes]:
    """(status, JSON body) of the one request that outputs answer; KeyError if they are
    not a LitAPI's answer."""
    given = {tensor.name: tensor.array for tensor in outputs}
    return int(given[STATUS][0]), bytes(given[BODY][0])


def clashes(apis: list[tuple[str, str]]) -> str | None:
    """What is wrong with the paths of apis, (model, its LitAPI's path) each: two on one
    path, or one on a path of the server's own (as LitServe refuses them); None if
    nothing is."""
    seen: dict[str, str] = {}
    for model, path in apis:
        if path in seen:
            return (f"{seen[path]} and {model} both answer on {path}: give one an api_path of "
                    f"its own (LitAPI.__init__(api_path=...))")
        if any(path == taken or path.startswith(taken + "/") for taken in _TAKEN):
            return f"{model} answers on {path}, a path of the server's own: give it another"
        seen[path] = model
    return None
