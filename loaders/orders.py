"""Which order each epoch reads in while background staging may still be running.

An epoch that starts while ``stage-in --background`` is incomplete on some node reads in the
staging order (:mod:`stager.plan.staging`: shards in copy order, so it needs only what landed);
the first epoch that starts once every node has finished reads in the full shuffle, and so do
the ones after it. Every rank must use the same order in an epoch, or the ranks' shares stop
being a partition, so the decision is one ``all_reduce`` at the start of an epoch (only while
some node may still be copying; none once an epoch started with staging complete everywhere,
and none at all for data staged without ``--background``). The decision is part of the
loader's state: a resume mid-epoch replays the order the epoch started with, wherever staging
stands by then.
"""

from __future__ import annotations

from collections.abc import Callable

from stager.errors import UsageError
from stager.plan.ranks import WorldLayout
from stager.plan.staging import StagingSpec
from stager.stagein.status import PlanFacts

from .collective import layout_group

__all__ = ["EpochOrders", "agree_incomplete"]


def agree_incomplete(incomplete: bool, layout: WorldLayout) -> bool:
    """True on every rank when staging is incomplete on any rank's node (one all_reduce)."""
    found = layout_group(layout)
    if layout.world_size == 1 and found is None:  # (a loader of one process: nothing to ask)
        return incomplete
    import torch

    if found is None:  # (none initialised, or one that is not this loader's world)
        raise UsageError(
            "this dataset is staged with stage-in --background, so ranks must agree on each "
            "epoch's order while staging runs: initialise torch.distributed (a group of "
            f"{layout.world_size} ranks, this one rank {layout.rank}) before iterating the "
            "loader (or pass rank=0, world_size=1 for a loader of one process)"
        )
    dist, device = found
    value = torch.tensor([int(incomplete)], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class EpochOrders:
    """The staging order of each epoch, or None for the full shuffle (see the module doc).

    ``facts``: the plan of this node's background stage-in, or None when the data was staged
    without ``--background`` (then only a resumed state can name a staging epoch).
    """

    def __init__(self, facts: PlanFacts | None, layout: WorldLayout, shuffled: bool):
        self.facts = facts
        self.layout = layout
        self.shuffled = shuffled
        self._decided: dict[int, StagingSpec | None] = {}
        # True once an epoch started with staging complete on every node: full shuffle after.
        # Unshuffled epochs read in file order anyway (and every rank has the same mode).
        self._settled = facts is None or not shuffled

    def restore(self, epoch: int, spec: dict[str, int] | None, consumed: int) -> None:
        """A loaded state: its epoch keeps the order it started with, if it had started."""
        self._decided = {}
        if spec is not None:
            self._decided[epoch] = StagingSpec.from_dict(spec)
        elif consumed > 0:
            self._decided[epoch] = None

    def begin(self, epoch: int, incomplete: Callable[[], bool]) -> StagingSpec | None:
        """The order of ``epoch`` as it starts (``incomplete()``: this node's staging is)."""
        if epoch in self._decided:
            return self._decided[epoch]
        spec: StagingSpec | None = None
        if not self._settled:
            if agree_incomplete(incomplete(), self.layout):
                assert self.facts is not None
                spec = StagingSpec(copy_seed=self.facts.copy_seed)
            else:
                self._settled = True
        self._decided = {epoch: spec}
        return spec

    def recorded(self, epoch: int) -> dict[str, int] | None:
        """For the state: the staging order ``epoch`` reads in, if it does."""
        spec = self._decided.get(epoch)
        return spec.to_dict() if spec is not None else None
