"""Which shards ``stage-in --subset node`` copies to this node (torch-free, for prologues).

The partition is :func:`stager.plan.ranks.node_owner` over shard byte sizes: sample counts
are unknown before copying, and sizes are a good proxy for same-format shards. It depends on
neither seed nor epoch, so the subset serves every epoch; the loader then shuffles within the
node's shards and agrees on the epoch length across nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stager.errors import UsageError
from stager.plan.ranks import node_owner
from stager.storage.sources import SourceSet, SourceShard

__all__ = ["select_node_shards"]


def select_node_shards(
    source: SourceSet, *, num_nodes: int, node: int, weights: Sequence[int] | None = None
) -> Sequence[SourceShard]:
    """The shards node ``node`` of ``num_nodes`` stages, in source order.

    ``weights``: each listed shard's bytes, in listing order (stage-in takes them from the
    manifest where it describes the shard: :mod:`stager.stagein.subset`); default: the shards'
    listed sizes. Every node must pass the same, or two nodes may both take a shard, or none.
    """
    if not 0 <= node < num_nodes:
        raise UsageError(f"node {node} outside a job of {num_nodes} node(s); check SLURM_NODEID")
    if len(source.shards) < num_nodes:
        raise UsageError(
            f"--subset node needs at least one shard per node ({len(source.shards)} shards, "
            f"{num_nodes} nodes); use --subset all"
        )
    if weights is None:
        weights = [s.size or 0 for s in source.shards]
    elif len(weights) != len(source.shards):
        raise ValueError(f"{len(weights)} weights for {len(source.shards)} shards")
    owner = node_owner(weights, num_nodes)
    return [source.shards[i] for i in np.flatnonzero(owner == node).tolist()]
