"""The copier's work list: every item known up front (a plan), or items arriving while the
source is still being listed (a first run of a walked directory, :mod:`stager.stagein.streamed`).

Copy threads iterate it; an open feed blocks them until more items arrive or it is closed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["ItemFeed"]

T = TypeVar("T")


class ItemFeed(Generic[T]):
    """Items in arrival order; one iterator over it may be shared by many threads."""

    def __init__(
        self,
        items: Iterable[T] = (),
        *,
        closed: bool = True,
        on_wait: Callable[[], object] | None = None,
    ) -> None:
        """``on_wait()`` runs on the iterating thread before it waits for more items (a copy
        thread gives back the stream slot it kept, which another thread may need meanwhile)."""
        self._items: list[T] = list(items)
        self._handed = 0  # items handed out by the shared iterator
        self._closed = closed
        self._on_wait = on_wait
        self._cond = threading.Condition()

    def add(self, items: Iterable[T]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("items added to a closed feed")
            self._items.extend(items)
            self._cond.notify_all()

    def close(self) -> None:
        """No more items: iteration ends once those added are handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def starved(self) -> bool:
        """Open, with every item so far handed out: the next take waits for more."""
        with self._cond:
            return not self._closed and self._handed >= len(self._items)

    def __iter__(self) -> Iterator[T]:
        for run in self.runs(lambda: 1):
            yield run[0]

    def runs(self, size: Callable[[], int]) -> Iterator[list[T]]:
        """Iterate in runs: each take hands out the next item (waiting for it as iteration
        does) and up to ``size() - 1`` more of those already added, never waiting for them."""
        position = 0
        while True:
            with self._cond:
                starved = position >= len(self._items) and not self._closed
            if starved and self._on_wait is not None:
                self._on_wait()  # outside the lock: it may take others
            with self._cond:
                while position >= len(self._items) and not self._closed:
                    self._cond.wait()
                if position >= len(self._items):
                    return
                end = min(len(self._items), position + max(1, size()))
                run = self._items[position:end]
                self._handed = max(self._handed, end)
            yield run
            position = end
