"""The sample counts a loader reading the source gets from the manifest beside it.

Without them a streamed shard is counted by reading it whole, remote ones too; with them
(``stager index``) planning reads nothing of the shards. One that cannot be read costs that
counting, not correctness.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

from stager.errors import SourceError, StagerError
from stager.stagein.sourcemanifest import manifest_beside
from stager.storage.sources import SourceSet

__all__ = ["source_samples"]

log = logging.getLogger("stager_loaders")


def source_samples(source: SourceSet) -> dict[str, int | None]:
    """The sample counts of the manifest beside the source (``stager index``), if any: without
    them a streamed shard is counted by reading it whole, remote ones too. One that cannot be
    read costs that counting, not correctness."""
    try:
        with contextlib.ExitStack() as stack:
            scratch = None
            if not source.is_local:  # (fetched, then read by its suffix)
                made = tempfile.TemporaryDirectory(prefix="stager-manifest-")
                scratch = Path(stack.enter_context(made))
            manifest = manifest_beside(source, scratch)
    except SourceError as exc:  # (the store failed: counted instead)
        log.warning("the manifest beside %s could not be read (%s)", source.root_url, exc)
        return {}
    except StagerError:
        return {}
    return {} if manifest is None else {e.relpath: e.samples for e in manifest.entries}
