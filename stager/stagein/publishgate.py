"""Hold finished copies back from their final names until the free-space verdict.

Apart from :mod:`stager.stagein.sizing`, whose probe gives the verdict: the gate is the part
that renames or deletes, and its rule (nothing staged after a refusal) is read on its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from stager.storage.copyrun import publish_run
from stager.storage.paths import discard

__all__ = ["PublishGate"]


class PublishGate:
    """Renames finished copies into place only once the free-space check has passed.

    Before the verdict, :meth:`publish` keeps each ``.partial`` aside; :meth:`pass_` renames
    those kept, :meth:`refuse` deletes them. After the verdict, publishing renames at once
    (passed) or deletes (refused).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verdict: bool | None = None
        self._held: list[tuple[str, str]] = []

    @property
    def refused(self) -> bool:
        return self._verdict is False

    @property
    def passed(self) -> bool:
        return self._verdict is True

    def publish(self, partial: str, final: str) -> bool:
        """Rename now (True), or hold or delete the copy (False: not under its final name yet)."""
        if self._verdict is True:  # one-way: once passed, no lock is needed
            os.replace(partial, final)
            return True
        with self._lock:
            if self._verdict is None:
                self._held.append((partial, final))
                return False
        if self._verdict:
            os.replace(partial, final)
            return True
        discard(partial)
        return False

    def publish_run(self, pairs: Sequence[tuple[str, str]]) -> tuple[bool, list[OSError | None]]:
        """:meth:`publish` for a run of copies (:mod:`stager.storage.copyrun`): (True, each
        rename's error or None) where renamed now, (False, no errors) where held or deleted."""
        if self._verdict is not True:
            with self._lock:
                if self._verdict is None:
                    self._held.extend(pairs)
                    return False, [None] * len(pairs)
            if not self._verdict:
                for partial, _ in pairs:
                    discard(partial)
                return False, [None] * len(pairs)
        return True, publish_run(pairs)

    def pass_(self) -> list[tuple[str, OSError]]:
        """Rename the copies held so far; returns the finals that could not be renamed."""
        with self._lock:
            if self._verdict is not None:
                return []
            errors = publish_run(self._held)  # (one call for all of them: a run's renames)
            held = zip(self._held, errors, strict=True)
            failed = [(final, exc) for (_, final), exc in held if exc is not None]
            self._held = []
            self._verdict = True
        return failed

    def refuse(self) -> None:
        with self._lock:
            if self._verdict is not None:
                return
            held, self._held = self._held, []
            self._verdict = False
        for partial, _ in held:
            discard(partial)
