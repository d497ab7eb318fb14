"""The manifest a stage-in verifies its copies against: ``--manifest``, or the one beside the
source (``stager-manifest.*``, written by ``stager index``).

A manifest that is not there is no error: sizes are still verified. One that is there but
cannot be read is: staging without it would pass a shard it would have refused (a hash that
no longer matches), and a throttled object store (503 SlowDown) answered the manifest's read
while serving the shards, so the run went on unverified without a word. fsspec's ``isfile``
answers False for any failure, so the store is asked with ``info``, and only "not found" is
taken for absence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import SourceError, UsageError, one_line
from stager.layout import StagedDataset
from stager.shards.manifest import MANIFEST_NAMES, Manifest, find_manifest
from stager.storage.listing import display
from stager.storage.sources import SourceSet

if TYPE_CHECKING:
    from stager.stagein.options import StageInOptions

__all__ = ["load_source_manifest", "manifest_beside"]


def load_source_manifest(
    source: SourceSet, options: StageInOptions, staged: StagedDataset
) -> Manifest | None:
    """The manifest to verify against: ``--manifest``, else ``stager-manifest.*`` beside it."""
    if options.manifest:
        if "://" not in options.manifest:
            return Manifest.read(options.manifest)
        return _read_fetched(options.manifest, _fetch_url(options.manifest, staged))
    return manifest_beside(source, staged.source_manifest_dir)


def manifest_beside(source: SourceSet, scratch: Path | None) -> Manifest | None:
    """The manifest ``stager index`` wrote beside ``source``, or None; a remote one is fetched
    into ``scratch`` first (read by its suffix, JSON or Parquet). Raises :class:`SourceError`
    where one is there but cannot be read (stage-in and the loader both look here)."""
    if not source.shards:
        return None
    first = source.shards[0]
    root = first.path[: len(first.path) - len(first.relpath)]
    if source.is_local:
        found = find_manifest(root)
        return Manifest.read(found) if found else None
    assert scratch is not None, "a remote manifest is fetched to scratch"
    for candidate in MANIFEST_NAMES:  # a remote dataset: fetch the first manifest found beside it
        remote = root.rstrip("/") + "/" + candidate
        url = display(source.remote_fs, remote)
        try:
            if source.fs.info(remote).get("type") != "file":
                continue
            local = scratch / os.path.basename(remote)
            local.parent.mkdir(parents=True, exist_ok=True)
            source.fs.get_file(remote, str(local))
        except FileNotFoundError:
            continue  # no manifest is not an error: sizes are still verified
        except Exception as exc:  # noqa: BLE001 - any failure of the store, said in one line
            raise _unreadable(url, exc) from exc
        return _read_fetched(url, local)
    return None


def _fetch_url(url: str, staged: StagedDataset) -> Path:
    """A ``--manifest`` URL's bytes, in the dataset's scratch directory for manifests."""
    import fsspec

    local = staged.source_manifest_dir / os.path.basename(url)
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        with fsspec.open(url, "rb") as handle:
            local.write_bytes(handle.read())
    except FileNotFoundError as exc:
        raise UsageError(f"manifest not found: {url}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure of the store, said in one line
        raise _unreadable(url, exc) from exc
    return local


def _read_fetched(url: str, local: Path) -> Manifest:
    """The manifest fetched from ``url`` to ``local``; its errors name ``url``, not the copy."""
    try:
        return Manifest.read(local)
    except UsageError as exc:
        raise UsageError(str(exc).replace(str(local), url)) from exc


def _unreadable(url: str, exc: BaseException) -> SourceError:
    return SourceError(
        f"cannot read the manifest {url}: {one_line(exc)}; stage-in verifies against it, so it "
        "does not go on without it: retry, or pass another with --manifest"
    )
