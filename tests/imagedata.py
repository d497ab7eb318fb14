"""Image WebDatasets as users have them: JPEG/PNG + ``.cls`` shards written by webdataset's
``ShardWriter``, with images of several sizes and shards of uneven sample counts."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np


def write_image_dataset(
    out_dir: Path,
    *,
    num_samples: int = 120,
    num_classes: int = 37,
    ext: str = "jpg",
    max_shard_bytes: int = 20_000,
    seed: int = 0,
) -> list[Path]:
    """Write ``num_samples`` samples (``__key__``, ``<ext>``, ``cls``) and return the shards;
    ``ext`` "png;jpg" alternates the formats sample by sample (a dataset of both).

    Shards are cut by size (``maxsize``) while image sizes vary, so they hold different sample
    counts. Labels cycle through ``0..num_classes-1`` (every class present when
    ``num_samples >= num_classes``), shuffled by ``seed``.
    """
    import webdataset as wds
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    formats = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
    exts = ext.split(";")
    pattern = str(out_dir / "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxsize=max_shard_bytes, verbose=0) as sink:
        for index in range(num_samples):
            height, width = (int(v) for v in rng.integers(12, 29, size=2))
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            buf = io.BytesIO()
            member = exts[index % len(exts)]
            Image.fromarray(pixels).save(buf, format=formats[member])
            sink.write(
                {
                    "__key__": f"img{index:06d}",
                    member: buf.getvalue(),
                    "cls": str(int(labels[index])).encode(),
                }
            )
    return sorted(out_dir.glob("shard-*.tar"))
