"""``--subset node``: the sizes a node's partition needs, taken from the manifest where it can.

Why: the partition (:func:`stager.plan.nodes.select_node_shards`) deals the shards by byte
size, and a walked listing has no sizes. Statting every listed shard on every node, as this
mode once did, cost ~1M stats per node at a million shards (18 s and 1.3 GB before the first
copy) and, over 256 nodes, ~2.6e8 GETATTRs on the NFS server at once, where each node copies
1/256 of the shards. A manifest beside the source (``stager index``) gives the size of each
shard it describes: only the others are stat'ed before the partition, the rule ``--subset
all`` follows; the node's own shards are then sized or verified as a ``--subset all`` run's
are (:func:`stager.stagein.run.prepare`, the copier).

The nodes never talk about the partition: each computes it from what it read, so it must be a
function of inputs that every node reads alike. A described shard weighs its manifest size on
every node, never a stat's or a listing's, even where the listing has one: a stale manifest
(a size the file no longer has) may move a shard to another node than its true size would,
but every node moves it alike, and the node that copies it still finds the difference at copy
time (an integrity error, as with ``--subset all``). A shard the manifest does not describe is
stat'ed by every node, as before. With a correct manifest the weights are the true sizes, so
the partition is the one a stat of every shard gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from operator import attrgetter

from stager.errors import SourceError
from stager.leftout import no_shards_message
from stager.shards.manifest import Manifest
from stager.storage.sources import SourceSet, SourceShard, fill_sizes

__all__ = ["NodeSelect", "node_share"]

#: Picks this node's shards from the listing, given every listed shard's weight (bytes) in
#: listing order: ``--subset node``'s :func:`stager.plan.nodes.select_node_shards`.
NodeSelect = Callable[[SourceSet, Sequence[int]], Sequence[SourceShard]]


def node_share(
    source: SourceSet, manifest: Manifest | None, select: NodeSelect | None, jobs: int
) -> tuple[SourceSet, list[SourceShard]]:
    """``(source, shards)``: the shards ``select`` gives this node (all, where it is None),
    and ``source`` with the shards the manifest does not describe sized.

    Those stats drop what a walk takes by name but is no shard (a directory named like one, a
    FIFO, a file gone since the listing), before the partition, on every node alike; they are
    named in ``source.skipped`` and ``source.left_out`` for the run's warnings. Raises
    :class:`SourceError` where none of the listed shards is left.
    """
    if select is None:
        return source, list(source.shards)
    entries = manifest.entries if manifest is not None else ()
    if list(map(attrgetter("relpath"), entries)) == [s.relpath for s in source.shards]:
        # the manifest names the listing one for one (as `stager index` writes it): no stat,
        # and no dict of a million entries
        return source, list(select(source, [e.size for e in entries]))
    described = {e.relpath: e.size for e in entries}
    skipped: list[str] = []
    directories: list[str] = []
    shards = fill_sizes(
        source, source.shards, jobs, known=described, skipped=skipped, directories=directories
    )
    if not shards:
        urls = skipped + [d.rstrip("/") for d in directories]
        raise SourceError(no_shards_message(source.root_url, (), urls))
    source = replace(
        source,
        shards=tuple(shards),
        skipped=(*source.skipped, *skipped),
        left_out=tuple(sorted([*source.left_out, *directories])),
    )
    weights = [described.get(s.relpath, s.size or 0) for s in shards]
    return source, list(select(source, weights))
