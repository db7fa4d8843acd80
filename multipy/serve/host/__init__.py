"""The host's side of a server: where an archive's storages lie (``archive``), a model
written as a class (``model_class``), one model on every interpreter (``models``), the
start-up bar (``progress``), a server's options, models, start-up and repository
(``service``), the model repository's requests that the front ends pass to the host
(``control``), and the front ends as the host runs them and hands them connections
(``front_ends``).  Runs in the host only; never imports torch.
"""
