"""The node cache: shards kept on a node-local disk across jobs, served by identity.

:mod:`~stager.cache.keys` (what a cached shard is filed under), :mod:`~stager.cache.paths` (where
everything lives under the cache root), :mod:`~stager.cache.records` (what is known of each
object and dataset), :mod:`~stager.cache.evict` (the pure eviction policy),
:mod:`~stager.cache.place` (link, reflink or copy into scratch), :mod:`~stager.cache.locks`
(``flock`` locks), :mod:`~stager.cache.store` (all of it together) and
:mod:`~stager.cache.sweep` (``stager clean --cache``). stage-in uses it
through :mod:`stager.stagein.cache`; ``stager ls/du/clean`` read and sweep it.
"""
