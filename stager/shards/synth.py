"""A deterministic synthetic WebDataset for the demo, the tests and the benchmarks.

Each sample has an image-like member (``.npy``: a uint8 HxWx3 array, decoded by webdataset
without Pillow) and a label member (``.cls``: ASCII integer). The content of every sample is a
function of (seed, shard index, sample index) only, so tests can recompute what they expect.
Imports webdataset (and so torch) lazily: ``import stager`` stays torch-free.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SyntheticSpec", "write_synthetic_dataset", "sample_label", "sample_key"]

_FIXED_MTIME = 1_700_000_000  # an integer mtime keeps tar members free of PAX headers


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the synthetic dataset: ``num_shards`` x ``samples_per_shard`` samples."""

    num_shards: int = 8
    samples_per_shard: int = 100
    image_bytes: int = 1024
    seed: int = 0
    uneven: bool = False  # vary shard sizes (between 1/2 and 3/2 of samples_per_shard)
    prefix: str = "train"
    compress: bool = False

    def shard_sizes(self) -> list[int]:
        if not self.uneven:
            return [self.samples_per_shard] * self.num_shards
        rng = np.random.default_rng(self.seed + 7919)
        lo = max(1, self.samples_per_shard // 2)
        hi = max(lo + 1, self.samples_per_shard * 3 // 2 + 1)
        return [int(n) for n in rng.integers(lo, hi, size=self.num_shards)]


def sample_key(shard: int, index: int) -> str:
    """The ``__key__`` of sample ``index`` of shard ``shard``."""
    return f"s{shard:05d}-{index:06d}"


def sample_label(seed: int, shard: int, index: int) -> int:
    """The label stored in the sample's ``.cls`` member."""
    return (seed * 31 + shard * 1009 + index) % 10


def _image(rng: np.random.Generator, image_bytes: int) -> bytes:
    side = max(1, int(math.sqrt(max(3, image_bytes) / 3)))
    array = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def write_synthetic_dataset(
    out_dir: str | Path, spec: SyntheticSpec = SyntheticSpec(), shards: Iterable[int] | None = None
) -> list[Path]:
    """Write ``spec.num_shards`` tar shards into ``out_dir`` and return their paths.

    ``shards``: only these shard indices. A shard's bytes depend on (seed, shard) alone, so
    parts of one dataset can be written by several processes at once (the benchmarks do, on a
    machine of many cores) and give the same files as one call."""
    import webdataset as wds

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ".tar.gz" if spec.compress else ".tar"
    sizes = spec.shard_sizes()
    paths = []
    for shard in range(spec.num_shards) if shards is None else shards:
        count = sizes[shard]
        path = out / f"{spec.prefix}-{shard:06d}{suffix}"
        tmp = path.with_name(path.name + ".partial")
        rng = np.random.default_rng([spec.seed, shard])
        # made in memory, then written: a write that fails (a full disk) leaves no tar stream
        # behind to write to the closed file again when collected (a second traceback)
        shard_bytes = io.BytesIO()
        writer = wds.TarWriter(
            shard_bytes, compress=spec.compress, mtime=_FIXED_MTIME, encoder=False
        )
        for index in range(count):
            writer.write(
                {
                    "__key__": sample_key(shard, index),
                    "npy": _image(rng, spec.image_bytes),
                    "cls": str(sample_label(spec.seed, shard, index)).encode(),
                }
            )
        writer.close()
        try:
            with open(tmp, "wb") as stream:
                stream.write(shard_bytes.getbuffer())
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # (a full disk, a Ctrl-C: no .partial left)
            raise
        paths.append(path)
    return paths
