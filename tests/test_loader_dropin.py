"""ShardedLoader where a DataLoader was: what a training script written for DataLoader does to it.

A script that swaps the class name keeps DataLoader's defaults spelled out (``drop_last=False``,
``sampler=None``), tells the epoch through ``loader.sampler.set_epoch`` (the DDP idiom, and the
only way Lightning's Trainer tells any loader), and maps samples to namedtuples it reads by
field. Each of these failed (a refusal, an AttributeError, epoch 0's order every epoch without
a word, a plain tuple), checked here with real shards, a real gloo group and a real Trainer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds

from stager.errors import UsageError

from .test_loader_ddp import run_world

HAVE_LIGHTNING = any(
    importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning")
)
SIZES = (7, 5, 9, 1)
Pair = namedtuple("Pair", "values label")


def _write(root: Path) -> Path:
    """Shards written by webdataset: a float16 array of a length that varies, and a label."""
    root.mkdir(parents=True)
    g = 0
    for s, n in enumerate(SIZES):
        with wds.TarWriter(str(root / f"shard-{s:06d}.tar")) as writer:
            for _ in range(n):
                writer.write(
                    {
                        "__key__": f"s{g:04d}",
                        "npy": np.arange(g % 3 + 1, dtype=np.float16),
                        "cls": g,
                    }
                )
                g += 1
    return root


@pytest.fixture()
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "STAGER_", "RANK", "WORLD_SIZE", "LOCAL_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STAGER_SCRATCH_ROOT", str(tmp_path / "scratch"))
    return _write(tmp_path / "ds")


def to_pair(sample: dict[str, Any]) -> Pair:
    return Pair(sample["npy"], sample["cls"])


def to_ordered(sample: dict[str, Any]) -> OrderedDict:
    return OrderedDict(values=sample["npy"], label=sample["cls"])


def test_dataloader_defaults_spelled_out_are_taken(source: Path) -> None:
    from stager_loaders import ShardedLoader

    plain = ShardedLoader(source, batch_size=4, to_tuple=("__key__",))
    spelled = ShardedLoader(
        source,
        batch_size=4,
        to_tuple=("__key__",),
        drop_last=False,
        sampler=None,
        batch_sampler=None,
        generator=None,
        in_order=True,
    )
    assert [list(b) for (b,) in spelled] == [list(b) for (b,) in plain]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"drop_last": True}, "has no drop_last: pass even='drop'"),
        ({"num_workers": True}, "third argument is num_workers: pass shuffle= by keyword"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
        ({"seed": None}, "seed must be an integer, not None"),
        ({"seed": 1 << 64}, r"seed must fit in 64 bits .* got 18446744073709551616"),
        ({"seed": -(1 << 63) - 1}, "seed must fit in 64 bits"),
        ({"options": {"rank": 0}}, "options must be a LoaderOptions, not dict"),
        ({"map": "npy"}, "map must be callable"),
        ({"collate_fn": 3}, "collate_fn must be callable"),
        ({"timeout": 5.0}, r"timeout=5.0 .* needs num_workers >= 1"),
    ],
)
def test_misuse_is_refused_in_one_line_naming_the_argument(
    source: Path, arguments: dict, says: str
) -> None:
    from stager_loaders import ShardedLoader

    with pytest.raises(UsageError, match=says) as raised:
        ShardedLoader(source, batch_size=4, **arguments)
    assert "\n" not in str(raised.value)


def test_pin_memory_device_is_passed_on_as_dataloader_takes_it(source: Path) -> None:
    from stager_loaders import ShardedLoader

    loader = ShardedLoader(source, batch_size=4, pin_memory_device="cpu")
    assert loader.pin_memory_device == "cpu" and sum(1 for _ in loader) == len(loader)


def test_the_third_positional_argument_of_dataloader_is_not_taken_for_workers(
    source: Path,
) -> None:
    """DataLoader(dataset, 64, True) shuffles; ShardedLoader(source, 64, True) read one worker."""
    from stager_loaders import ShardedLoader

    with pytest.raises(UsageError, match="pass shuffle= by keyword"):
        ShardedLoader(source, 4, True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_namedtuple_or_ordereddict_sample_collates_to_its_own_type(
    source: Path, num_workers: int
) -> None:
    """As torch's default_collate keeps them; the arrays are ragged (they travel packed)."""
    from stager_loaders import ShardedLoader

    pairs = ShardedLoader(source, batch_size=4, num_workers=num_workers, decode="rgb8", map=to_pair)
    batch = next(iter(pairs))
    assert type(batch) is Pair
    assert isinstance(batch.values, list) and len(batch.values) == 4  # ragged: one per sample
    assert batch.label.shape == (4,)
    ordered = ShardedLoader(
        source, batch_size=4, num_workers=num_workers, decode="rgb8", map=to_ordered
    )
    batch = next(iter(ordered))
    assert type(batch) is OrderedDict and list(batch) == ["values", "label"]


# ------------------------------------------------------- loader.sampler.set_epoch, the DDP idiom
def rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank of a 2-rank gloo group: a DDP loop written for DataLoader + DistributedSampler."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{job['out']}/rendezvous", rank=rank, world_size=2
    )
    try:
        from stager_loaders import ShardedLoader

        loader = ShardedLoader(job["source"], batch_size=3, num_workers=1, to_tuple=("__key__",))
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            epochs.append([key for (batch,) in loader for key in batch])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"epochs": epochs}))


def test_sampler_set_epoch_gives_each_epoch_its_order_in_a_real_ddp_world(
    source: Path, tmp_path: Path
) -> None:
    ranks = run_world(
        {"source": str(source), "phase": "set_epoch", "out": str(tmp_path / "world")},
        module="tests.test_loader_dropin",
    )
    total = sum(SIZES)
    for epoch in range(2):
        shares = [set(r["epochs"][epoch]) for r in ranks]
        assert not shares[0] & shares[1]  # no overlap between the ranks
        assert len(shares[0] | shares[1]) == total
    assert all(r["epochs"][0] != r["epochs"][1] for r in ranks)  # epoch 1 is its own order


def test_sampler_set_epoch_is_the_loaders(source: Path) -> None:
    from stager_loaders import ShardedLoader

    loader = ShardedLoader(source, batch_size=3, to_tuple=("__key__",))
    reference = ShardedLoader(source, batch_size=3, to_tuple=("__key__",))
    reference.set_epoch(1)
    loader.sampler.set_epoch(1)
    assert loader.epoch == 1
    assert [list(b) for (b,) in loader] == [list(b) for (b,) in reference]


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="neither lightning nor pytorch_lightning installed")
def test_a_plain_loader_given_to_a_trainer_reads_each_epoch_in_its_own_order(
    source: Path,
) -> None:
    """Lightning tells a DataLoader the epoch through its sampler's set_epoch only: a
    ShardedLoader passed to fit read epoch 0's order in every epoch, without a word."""
    import torch

    from stager_loaders import ShardedLoader
    from stager_loaders.lightning import lightning_package

    pl = lightning_package()
    seen: list[tuple[int, list[str]]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            keys, labels = batch
            seen.append((self.current_epoch, list(keys)))
            return (self.weight * labels.float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    loader = ShardedLoader(source, batch_size=4, decode="rgb8", to_tuple=("__key__", "cls"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (workers, logging) on a toy run
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Model(), train_dataloaders=loader)
    epochs = [[k for e, keys in seen if e == epoch for k in keys] for epoch in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(epochs[0]) == sum(SIZES)
    assert epochs[0] != epochs[1]
