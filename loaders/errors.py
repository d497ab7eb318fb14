"""The loader's own exceptions, grafted onto stager's tree (:mod:`stager.errors`).

::

    StagerError
    ├── UsageError(ValueError)
    │   └── ResumeMismatch          a saved loader state does not fit this loader
    ├── SourceError(OSError)        (raised while resolving shards)
    └── IntegrityError              a corrupt or truncated shard, naming shard and member

Corrupt shards reuse :class:`stager.errors.IntegrityError`, so ``except IntegrityError``
catches them whether stage-in or the loader found them.
"""

from __future__ import annotations

from stager.errors import IntegrityError, SourceError, StagerError, UsageError

__all__ = ["ResumeMismatch", "IntegrityError", "SourceError", "StagerError", "UsageError"]


class ResumeMismatch(UsageError):
    """``load_state_dict`` got a state saved for another dataset, world or batch size."""

    def __init__(self, differences: list[str]):
        self.differences = list(differences)
        super().__init__(
            "cannot resume the loader: "
            + "; ".join(self.differences)
            + ". Resume with the same dataset, world size and batch size, or start the epoch afresh"
        )
