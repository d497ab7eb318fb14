"""The node cache: shards kept on a node-local disk across jobs, served by identity.

:mod:`~stager.cache.keys` (what a cached shard is filed under), :mod:`~stager.cache.paths` (where
everything lives under the cache root), :mod:`~stager.cache.records` (what is known of each
object and dataset), :mod:`~stager.cache.evict` (the pure eviction policy),
:mod:`~stager.cache.place` (link, reflink or copy into scratch), :mod:`~stager.cache.locks`
(``flock`` locks) and :mod:`~stager.cache.store` (all of it together). stage-in uses it
through :mod:`stager.stagein.cache`; ``stager ls/du/clean`` read and sweep it.
"""

from stager.cache.keys import dataset_key, shard_key
from stager.cache.paths import CacheLayout, resolve_cache_dir, resolve_cache_limit
from stager.cache.store import ShardCache

__all__ = [
    "CacheLayout",
    "ShardCache",
    "dataset_key",
    "shard_key",
    "resolve_cache_dir",
    "resolve_cache_limit",
]
