"""Ranks of a real gloo group settle what they see together (``stager_loaders.collective``).

Each rank lists and counts its source itself. Where the ranks' views differed (a remote source
changed between their listings, nodes with different staged copies), each planned its own
epoch: different batch counts (a DDP hang) and samples read twice; every rank now raises. A
shard counted by reading it whole (streamed, no manifest) is counted by one rank, not by all.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .test_loader_ddp import WORLD, run_world


def rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank: build a streaming loader of its source, read an epoch, write rank<N>.json."""
    import torch.distributed as dist

    import stager_loaders.readers as readers
    from stager_loaders import LoaderOptions, ShardedLoader

    counted: list[str] = []
    real = readers.count_remote_samples

    def counting(location: str) -> int:  # the real count, recorded
        counted.append(Path(location).name)
        return real(location)

    readers.count_remote_samples = counting
    dist.init_process_group(
        "gloo", init_method=f"file://{job['out']}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        options = LoaderOptions(
            dest=job["dest"], force_streaming=job.get("stream", True), on_error=job["on_error"]
        )
        if job.get("solo"):  # rank 0 alone reads the whole dataset (a validation pass there)
            options = LoaderOptions(**{**vars(options), "rank": 0, "world_size": 1})
        try:
            if job.get("probe"):  # the doctor's probe, on rank 0 alone
                if rank != 0:
                    raise LookupError("no probe on this rank")
                from stager_loaders.doctor import probe_loader

                probe = probe_loader(job["sources"][0], workers=[0], seconds=0.2, dest=job["dest"])
                raise LookupError(f"probed {probe.num_samples} samples")
            if job.get("solo") and rank != 0:
                raise LookupError("no loader on this rank")
            loader = ShardedLoader(
                job["sources"][rank], batch_size=3, to_tuple=("__key__",), options=options
            )
            loader.set_epoch(0)
            out: dict[str, Any] = {"len": len(loader), "keys": [k for (b,) in loader for k in b]}
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out = {"error": type(exc).__name__, "message": str(exc)}
        out["counted"] = counted
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(out))


def _world(job: dict[str, Any]) -> list[dict[str, Any]]:
    return run_world(job, timeout_s=120, module="tests.test_loader_agreement")


def _gzipped(root: Path, shards: int, seed: int) -> Path:
    """``shards`` .tar.gz shards of uneven sizes under ``root/ds`` (streamed: no random access)."""
    spec = SyntheticSpec(num_shards=shards, samples_per_shard=7, uneven=True, seed=seed)
    write_synthetic_dataset(root / "plain", spec)
    (root / "ds").mkdir(parents=True)
    for tar in sorted((root / "plain").glob("*.tar")):
        (root / "ds" / (tar.name + ".gz")).write_bytes(gzip.compress(tar.read_bytes()))
    return root / "ds"


def _job(tmp_path: Path, sources: list[Path], on_error: str = "raise") -> dict[str, Any]:
    return {
        "sources": [str(s) for s in sources],
        "dest": str(tmp_path / "scratch"),
        "out": str(tmp_path / "out"),
        "on_error": on_error,
    }


def test_each_shard_is_counted_by_one_rank_and_every_rank_plans_the_same_epoch(
    tmp_path: Path,
) -> None:
    source = _gzipped(tmp_path / "a", 5, seed=3)
    ranks = _world(_job(tmp_path, [source, source]))
    assert all("error" not in r for r in ranks), ranks
    assert ranks[0]["len"] == ranks[1]["len"] > 0
    first, second = (set(r["counted"]) for r in ranks)
    assert not first & second and len(first | second) == 5  # each counted once, not twice
    assert abs(len(first) - len(second)) <= 1
    keys = [k for r in ranks for k in r["keys"]]
    spec = SyntheticSpec(num_shards=5, samples_per_shard=7, uneven=True, seed=3)
    expected = sum(spec.shard_sizes())
    assert len(set(keys)) == expected  # every sample, on one rank (pad repeats a few)


def test_ranks_that_see_different_shards_all_raise(tmp_path: Path) -> None:
    """Rank 1's copy of the source has a shard more (it landed between the two listings)."""
    ranks = _world(_job(tmp_path, [_gzipped(tmp_path / "a", 4, 3), _gzipped(tmp_path / "b", 5, 3)]))
    for rank in ranks:
        assert rank.get("error") == "SourceError", ranks
        assert "ranks do not see the same shards and sample counts" in rank["message"]


def test_a_rank_that_fails_opening_its_shards_alone_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1's node holds a shard with a header overwritten: it raised IntegrityError while
    indexing, before the all-reduce comparing the ranks' shards, and rank 0 waited in that
    all-reduce for it (a hang) instead of failing too."""
    import tarfile

    sources = [tmp_path / name / "ds" for name in ("a", "b")]
    for source in sources:
        write_synthetic_dataset(source, SyntheticSpec(num_shards=3, samples_per_shard=6, seed=3))
    shard = sorted(sources[1].glob("*.tar"))[1]
    with tarfile.open(shard) as tar:
        at = tar.getmembers()[5].offset  # a member header in the middle of the shard
    data = bytearray(shard.read_bytes())
    data[at : at + 512] = b"\xff" * 512
    shard.write_bytes(bytes(data))
    ranks = _world({**_job(tmp_path, sources), "stream": False})
    assert ranks[1].get("error") == "IntegrityError", ranks
    assert ranks[0].get("error") == "SourceError", ranks
    assert "another of the 2 ranks could not open" in ranks[0]["message"]


def test_a_corrupt_shard_counted_by_one_rank_fails_or_is_left_out_on_every_rank(
    tmp_path: Path,
) -> None:
    """Found by the rank that counted it: the other raises too (it would have waited in the
    reduce), or, with ``on_error="skip"``, leaves it out as well."""
    source = _gzipped(tmp_path / "a", 4, seed=3)
    corrupt = sorted(source.iterdir())[1]  # (counted by rank 1)
    corrupt.write_bytes(gzip.compress(b"no tar in here" * 100))
    ranks = _world(_job(tmp_path, [source, source]))
    for rank in ranks:
        assert rank.get("error") == "IntegrityError", ranks
    assert corrupt.name in ranks[0]["message"] and "counted by rank 1" in ranks[0]["message"]
    ranks = _world({**_job(tmp_path, [source, source], "skip"), "out": str(tmp_path / "o2")})
    assert ranks[0]["len"] == ranks[1]["len"] > 0, ranks
    assert not any(k.startswith(corrupt.name) for r in ranks for k in r["keys"])


def test_a_loader_built_on_one_rank_for_itself_alone_runs_no_collective(tmp_path: Path) -> None:
    """A validation loader on rank 0 only (``rank=0, world_size=1``) in a group of two: a
    collective there would wait forever for a rank that builds no loader."""
    source = _gzipped(tmp_path / "a", 3, seed=3)
    ranks = _world({**_job(tmp_path, [source, source]), "solo": True})
    assert ranks[1]["error"] == "LookupError" and "error" not in ranks[0], ranks
    assert len(ranks[0]["counted"]) == 3 and len(set(ranks[0]["keys"])) == len(ranks[0]["keys"])


def test_counts_one_rank_lacks_are_counted_in_shares_and_every_rank_trains(
    tmp_path: Path,
) -> None:
    """Rank 0 reads the counts from the manifest beside its source; rank 1 cannot (a store's
    503, a manifest not yet visible on that node): the shards to count are decided together,
    where the ranks' lists of shards to count differed and both raised."""
    import shutil

    from stager.shards.build import build_manifest, write_manifest
    from stager.storage.sources import resolve_source

    with_manifest = _gzipped(tmp_path / "a", 4, seed=3)
    write_manifest(
        build_manifest(resolve_source(str(with_manifest))),
        str(with_manifest / "stager-manifest.json"),
    )
    without = tmp_path / "b" / "ds"
    shutil.copytree(with_manifest, without, ignore=shutil.ignore_patterns("stager-manifest.*"))
    ranks = _world(_job(tmp_path, [with_manifest, without]))
    assert all("error" not in r for r in ranks), ranks
    assert ranks[0]["len"] == ranks[1]["len"] > 0
    assert sorted(ranks[0]["counted"] + ranks[1]["counted"]) == sorted(
        p.name for p in without.iterdir()
    )


def test_the_doctors_probe_on_one_rank_of_a_group_waits_for_no_other(tmp_path: Path) -> None:
    """``probe_loader`` run in a training job on rank 0 only built a loader of the group's
    world, whose collectives waited for ranks that build none."""
    source = _gzipped(tmp_path / "a", 3, seed=3)
    ranks = _world({**_job(tmp_path, [source, source]), "probe": True})
    assert ranks[0]["error"] == "LookupError" and "probed" in ranks[0]["message"], ranks


def test_staging_agreement_refuses_a_group_that_is_not_the_loaders_world(tmp_path: Path) -> None:
    """Whether staging is incomplete anywhere is all-reduced over the loader's world: under a
    group of another world (one rank here, the loader's of two) it raises, where it reduced
    over that group and each rank kept its own answer (epochs of other orders, a DDP hang)."""
    import pytest
    import torch.distributed as dist

    from stager.errors import UsageError
    from stager.plan.ranks import WorldLayout
    from stager_loaders.orders import agree_incomplete

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        assert agree_incomplete(True, WorldLayout(rank=0)) is True  # the group's own world
        with pytest.raises(UsageError, match="a group of 2 ranks"):
            agree_incomplete(False, WorldLayout(num_nodes=2, rank=0))
    finally:
        dist.destroy_process_group()
