"""The names cached bytes are filed under: a shard's identity, and a dataset's.

A cached shard is served only to a run whose source shard has the same identity as the one
it was copied from (the rule of :mod:`stager.storage.identity`): its canonical URL, its size,
its version token (``inode:mtime_ns:ctime_ns`` locally, an ETag or version on object stores)
and, when a manifest gives one, its hash. Any difference gives another key, so a changed
shard is a miss and is copied again; it can never be answered with the old bytes.

A shard whose source reports no version and that no manifest hash describes has no key: the
cache could not tell its bytes changed, so it is never cached.
"""

from __future__ import annotations

import hashlib
import json

from stager.layout import canonical_spec

__all__ = ["shard_key", "dataset_key"]


def shard_key(url: str, size: int | None, version: str | None, digest: str | None) -> str | None:
    """The cache key of a source shard, or None when its identity cannot tell a change.

    ``url`` as listed (a local path is made an absolute ``file://`` URL first, so every
    spelling of one file agrees); ``digest``: the manifest's ``"<algorithm>:<hex>"``, if any.
    """
    if size is None or (version is None and digest is None):
        return None
    text = json.dumps(["shard/1", canonical_spec(url), size, version, digest])
    return hashlib.sha256(text.encode()).hexdigest()


def dataset_key(spec: str) -> str:
    """The key of a cached dataset, from its spec (:func:`stager.layout.canonical_spec`).

    Runs of one spec share one record whatever name they stage it under; two specs that list
    the same shards share those shards' cached bytes, and each keeps them in the cache.
    """
    return hashlib.sha256(json.dumps(["dataset/1", spec]).encode()).hexdigest()[:32]
