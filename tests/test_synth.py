"""The synthetic dataset of the demo, tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset


def test_parts_written_apart_make_the_same_files_as_one_writer(tmp_path: Path) -> None:
    """The benchmarks write a row's shards from several processes, one part each; the files
    must be those one call writes (a shard's bytes depend on its index, not on the others)."""
    spec = SyntheticSpec(num_shards=5, samples_per_shard=3, uneven=True, seed=4)
    whole = write_synthetic_dataset(tmp_path / "whole", spec)
    parts = [
        *write_synthetic_dataset(tmp_path / "parts", spec, shards=[3, 1]),
        *write_synthetic_dataset(tmp_path / "parts", spec, shards=range(0, 5, 2)),
    ]
    assert sorted(p.name for p in parts) == [p.name for p in whole]
    for path in whole:
        assert (tmp_path / "parts" / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [p.name for p in whole]
