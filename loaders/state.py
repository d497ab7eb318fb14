"""The loader's resumable position: small, JSON-able, and checked before it is trusted.

All ranks of a DDP job consume the same number of batches in lockstep, so the state saved by
rank 0 resumes every rank: the position is "batch k of epoch e", and each rank recomputes its
own batches from the plan (:mod:`stager.plan.ranks`).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from stager.errors import ResumeMismatch

__all__ = ["LoaderState", "STATE_VERSION", "STAGING_STATE_VERSION"]

#: 2: the epoch order became a keyed bijection (issue 20). A version-1 state names a position
#: in the old order; resuming it here would repeat and skip samples, so it is refused.
#: 3: a state whose epoch reads in the staging order of stage-in --background (issue 23) says
#: so; it is written only then, so that a loader that knows no staging order refuses it.
#: Both are read.
STATE_VERSION = 2
STAGING_STATE_VERSION = 3
_READ_VERSIONS = (STATE_VERSION, STAGING_STATE_VERSION)

# Fields that must match for the saved position to mean the same samples.
_MUST_MATCH = (
    "fingerprint",
    "num_samples",
    "world_size",
    "batch_size",
    "seed",
    "shuffle",
    "even",
    "subset",
)


@dataclass(frozen=True)
class LoaderState:
    """Epoch, batches consumed in it, and what fixes the order (see ``_MUST_MATCH``)."""

    epoch: int
    batches_consumed: int
    batches_per_epoch: int
    seed: int
    batch_size: int
    world_size: int
    num_nodes: int
    ranks_per_node: int
    shuffle: str
    even: str
    subset: str
    fingerprint: str
    num_samples: int
    version: int = STATE_VERSION
    # Set in an epoch resumed elastically: the world it came from and where that world stopped.
    elastic_from: dict[str, int] | None = None
    # Set when the epoch reads in the staging order (stager.plan.staging.StagingSpec.to_dict)
    staging_order: dict[str, int] | None = None
    # What else fixes the order in this mode (the streaming path's workers and shuffle buffer,
    # the blocked shuffle's block): must match too. None in a state saved before it was kept.
    order: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        if self.staging_order is not None:
            payload["version"] = STAGING_STATE_VERSION
        else:
            del payload["staging_order"]  # a plain state stays readable by older loaders
        return payload

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> LoaderState:
        if not isinstance(payload, dict) or payload.get("version") not in _READ_VERSIONS:
            found = payload.get("version") if isinstance(payload, dict) else payload
            raise ResumeMismatch(
                [
                    f"state format {found!r} is not version {STATE_VERSION} or "
                    f"{STAGING_STATE_VERSION} (a state saved by another version of the loader "
                    "names a position in a different epoch order)"
                ]
            )
        payload = {**payload, "version": STATE_VERSION}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = required - set(payload)
        if missing:
            raise ResumeMismatch([f"state lacks {sorted(missing)}"])
        return cls(**{f.name: payload[f.name] for f in fields(cls) if f.name in payload})

    def check_resumable_by(self, current: LoaderState, *, elastic: bool = False) -> None:
        """Raise :class:`ResumeMismatch` listing every field that differs from ``current``.

        ``elastic`` tolerates a different world size (the loader redistributes the rest).
        """
        names = [n for n in _MUST_MATCH if not (elastic and n == "world_size")]
        if self.subset == current.subset == "node":
            names.remove("num_samples")  # (each node's own; the job's fingerprint covers them)
        differences = [
            f"{name} was {getattr(self, name)!r}, is now {getattr(current, name)!r}"
            for name in names
            if getattr(self, name) != getattr(current, name)
        ]
        if "world_size" in names and self.world_size != current.world_size:
            differences.append(  # (the one difference the loader can take, when asked)
                "to spread the rest of the epoch over the new world, pass "
                "load_state_dict(state, elastic=True)"
            )
        if self.order is not None and self.order != current.order:
            differences.append(
                f"the order's settings were {self.order!r}, are now {current.order!r} (the "
                "same samples would come in another order: some twice, some never)"
            )
        if differences:
            raise ResumeMismatch(differences)
