"""One call per item, each on a thread of its own, all at once: how multipy warms up,
loads and tells every interpreter (or its front end) something."""
from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def on_each(items: Sequence[T], work: Callable[[T], None], name: str) -> None:
    """work(item) for each of items, each on a daemon thread of its own (``name-k``), at
    once; returns once every one has ended, and raises then the exception that work
    raised for the first item (in their order) that it failed for, if any."""
    errors: list[BaseException | None] = [None] * len(items)

    def run(position: int) -> None:
        try:
            work(items[position])
        except BaseException as error:  # raised in the caller's thread below
            errors[position] = error

    threads = [threading.Thread(target=run, args=(position,), daemon=True,
                                name=f"{name}-{position}") for position in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
