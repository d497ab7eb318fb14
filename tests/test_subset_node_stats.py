"""``stage-in --subset node`` with a manifest beside the source: a node stats its own share of
the shards (and those the manifest does not describe), not every shard of the source; and the
partition every node computes alone is the one a stat of every shard gives, stale manifest or
not (:mod:`stager.stagein.subset`).

Why: statting every shard on every node was ~1M stats per node at a million shards, ~2.6e8
GETATTRs on the NFS server over 256 nodes, where each node copies 1/256 of the shards.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import stager.stagein.sizing
from stager.errors import EXIT_INTEGRITY
from stager.layout import StagedDataset
from stager.plan.nodes import select_node_shards
from stager.shards.manifest import Manifest, ManifestEntry
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.sources import resolve_source

from .inproc import clean_process_env, run_main

FAST = ["--jitter-max", "0", "--quiet", "--retry-delay", "0.01"]
NODES = 4


def _dataset(tmp_path: Path, capsys, *, hashes: bool = True) -> Path:  # noqa: ANN001
    """32 shards of uneven sizes in two directories and their ``stager-manifest.json``: as
    ``stager index`` writes it, or with sizes only (then stage-in sizes a node's shards)."""
    src = tmp_path / "ds"
    spec = SyntheticSpec(num_shards=16, samples_per_shard=6, image_bytes=256, uneven=True)
    write_synthetic_dataset(src / "a", spec)
    write_synthetic_dataset(src / "b", dataclasses.replace(spec, seed=1))
    if hashes:
        assert run_main(capsys, "stager", "index", str(src), "--jobs", "2").returncode == 0
    else:
        entries = [ManifestEntry(s.relpath, s.size or 0) for s in resolve_source(str(src)).shards]
        Manifest(entries, {}).write(src / "stager-manifest.json")
    return src


def _as_node(monkeypatch: pytest.MonkeyPatch, node: int) -> None:
    clean_process_env(monkeypatch)
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(NODES),
        "SLURM_JOB_NUM_NODES": str(NODES),
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_NTASKS": str(NODES),
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)


def _staged(dest: Path) -> set[str]:
    return {str(p.relative_to(dest / "ds")) for p in (dest / "ds").rglob("*.tar")}


def _count_source_stats(monkeypatch: pytest.MonkeyPatch, src: Path) -> list[str]:
    """Every stat of a shard under ``src``: by ``os.stat`` (the listing's sizes, fill_sizes)
    and by the copier's size probe (its documented hook, compiled runs included)."""
    seen: list[str] = []
    prefix = str(src) + "/"
    real_stat = os.stat
    real_run: Callable = stager.stagein.sizing._stat_run

    def counted_stat(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        name = os.fspath(path) if not isinstance(path, int) else ""
        if isinstance(name, str) and name.startswith(prefix) and name.endswith(".tar"):
            seen.append(name[len(prefix) :])
        return real_stat(path, *args, **kwargs)

    def counted_run(paths, budget_s):  # noqa: ANN001, ANN202
        seen.extend(p[len(prefix) :] for p in paths if p.startswith(prefix))
        return real_run(paths, budget_s)

    monkeypatch.setattr(os, "stat", counted_stat)
    monkeypatch.setattr(stager.stagein.sizing, "_stat_run", counted_run)
    return seen


@pytest.mark.parametrize("hashes", [True, False], ids=["hashed", "sizes-only"])
def test_a_node_stats_only_its_share_and_what_the_manifest_does_not_describe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, hashes: bool
) -> None:
    src = _dataset(tmp_path, capsys, hashes=hashes)
    shutil.copy(src / "a" / "train-000003.tar", src / "b" / "added-000000.tar")  # undescribed
    _as_node(monkeypatch, 2)
    seen = _count_source_stats(monkeypatch, src)
    dest = tmp_path / "s"
    result = run_main(capsys, "stage-in", str(src), "--dest", str(dest), "--subset", "node", *FAST)
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr
    share = _staged(dest)
    assert 0 < len(share) < 33
    # at most once each: its own shards (sizes-only: sized before the copy) and the added one
    # (every node stats it: the partition needs its size)
    assert set(seen) <= share | {"b/added-000000.tar"}, sorted(set(seen) - share)
    assert len(seen) <= len(share) + 1, seen
    if hashes:  # a hash stands for a described shard: the copy verifies it, no stat first
        assert set(seen) == {"b/added-000000.tar"}


def _stage_every_node(
    src: Path, dest: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> tuple[list[set[str]], list[str]]:
    shares, errors = [], []
    for node in range(NODES):
        _as_node(monkeypatch, node)
        result = run_main(
            capsys, "stage-in", str(src), "--dest", str(dest / str(node)), "--subset", "node", *FAST
        )
        shares.append(_staged(dest / str(node)))
        errors.append("" if result.returncode == 0 else f"{result.returncode}: {result.stderr}")
    return shares, errors


def test_the_partition_is_the_same_with_and_without_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    src = _dataset(tmp_path, capsys)
    with_manifest, errors = _stage_every_node(src, tmp_path / "m", monkeypatch, capsys)
    assert errors == [""] * NODES
    (src / "stager-manifest.json").rename(tmp_path / "away.json")
    stat_first, errors = _stage_every_node(src, tmp_path / "n", monkeypatch, capsys)
    assert errors == [""] * NODES
    assert with_manifest == stat_first
    assert sum(map(len, with_manifest)) == 32 and len(set().union(*with_manifest)) == 32
    assert len({len(share) for share in with_manifest}) <= 2  # (balanced by bytes, not count)


def test_a_stale_manifest_still_partitions_alike_on_every_node_and_fails_the_changed_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A shard grown since ``stager index``, one added, one gone: every node weighs a described
    shard by the manifest (none stats it first), so they agree on the partition; the node that
    copies the grown shard fails it as an integrity error, as ``--subset all`` does."""
    src = _dataset(tmp_path, capsys)
    manifest = Manifest.read(src / "stager-manifest.json")
    grown = src / "a" / "train-000005.tar"
    with grown.open("ab") as handle:
        handle.write(b"\0" * 5 * 1024 * 1024)  # now the heaviest shard by far
    shutil.copy(src / "b" / "train-000001.tar", src / "b" / "added-000000.tar")
    (src / "b" / "train-000009.tar").unlink()
    listing = resolve_source(str(src))
    sizes = {e.relpath: e.size for e in manifest.entries}
    weights = [sizes.get(s.relpath, s.size or 0) for s in listing.shards]
    expected = [
        {s.relpath for s in select_node_shards(listing, num_nodes=NODES, node=n, weights=weights)}
        for n in range(NODES)
    ]
    shares, errors = _stage_every_node(src, tmp_path / "s", monkeypatch, capsys)
    owner = next(n for n in range(NODES) if "a/train-000005.tar" in expected[n])
    for node in range(NODES):
        if node == owner:
            assert errors[node].startswith(f"{EXIT_INTEGRITY}:"), errors[node]
            assert "train-000005.tar" in errors[node]
            assert shares[node] == expected[node] - {"a/train-000005.tar"}
        else:
            assert errors[node] == "", errors[node]
            assert shares[node] == expected[node]
    assert sum(map(len, expected)) == 32 and len(set().union(*expected)) == 32
    assert "b/added-000000.tar" in set().union(*shares)
    for node in range(NODES):  # the loader side reads each node's own staged manifest
        staged = Manifest.read(StagedDataset.of(tmp_path / "s" / str(node) / "ds").manifest_path)
        assert {e.relpath for e in staged.entries} == shares[node]
