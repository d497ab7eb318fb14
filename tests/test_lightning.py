"""stager_loaders.lightning: the DataModule's resume logic alone, and with a real Lightning Trainer.

The logic tests need no Lightning (a stand-in trainer object). The Trainer tests run when
``lightning`` or ``pytorch_lightning`` is installed (the test extra installs the latter): a run
checkpointed at every step and resumed from a mid-epoch checkpoint must see the same batches,
in the same order, as the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from stager.errors import UsageError
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager_loaders import LoaderOptions
from stager_loaders.lightning import ShardedDataLogic

from .conftest import clean_env

HAVE_LIGHTNING = any(
    importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning")
)
KW = dict(batch_size=4, decode="rgb8", to_tuple=("npy", "cls", "__key__"), rank=0, world_size=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning") / "ds"
    write_synthetic_dataset(out, SyntheticSpec(num_shards=4, samples_per_shard=10, seed=4))
    return out


def _module(data: Path, tmp_path: Path, **kw) -> ShardedDataLogic:
    return ShardedDataLogic(
        data, num_workers=0, options=LoaderOptions(dest=str(tmp_path / "scratch")), **{**KW, **kw}
    )


class FakeTrainer(SimpleNamespace):
    """The few Trainer attributes the DataModule reads (a subclass: it can be weakly referenced)."""


def _trainer(epoch: int, processed: int) -> FakeTrainer:
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return FakeTrainer(
        training=True,
        current_epoch=epoch,
        world_size=1,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def _keys(batch) -> list[str]:
    return list(batch[2])


def test_state_counts_the_batches_the_trainer_finished_not_those_fetched(
    data: Path, tmp_path: Path
) -> None:
    dm = _module(data, tmp_path)
    trainer = _trainer(epoch=0, processed=0)
    dm.trainer = trainer
    loader = dm.train_dataloader()
    it = iter(loader)
    seen = [_keys(next(it)) for _ in range(4)]  # a fetcher that ran ahead took 4 batches...
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 3  # ...the trainer did 3
    state = dm.state_dict()
    assert state["train_loader"]["batches_consumed"] == 3 and state["train_loader"]["epoch"] == 0

    resumed = _module(data, tmp_path)
    resumed.trainer = _trainer(epoch=0, processed=3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # restored, not yet applied: saved as it came
    rest = [_keys(b) for b in resumed.train_dataloader()]
    assert rest[0] == seen[3] and len(rest) == len(loader) - 3


def test_the_loader_follows_the_trainer_epoch(data: Path, tmp_path: Path) -> None:
    dm = _module(data, tmp_path)
    trainer = _trainer(epoch=0, processed=0)
    dm.trainer = trainer
    loader = dm.train_dataloader()
    first = [_keys(b) for b in loader]
    trainer.current_epoch = 1
    second = [_keys(b) for b in loader]
    assert loader.epoch == 1 and first != second
    assert sorted(k for b in first for k in b) == sorted(k for b in second for k in b)


def test_outside_fit_the_state_is_the_loaders_own(data: Path, tmp_path: Path) -> None:
    dm = _module(data, tmp_path)
    dm.trainer = FakeTrainer(training=False, current_epoch=0, world_size=1)
    it = iter(dm.train_dataloader())
    next(it), next(it)
    assert dm.state_dict()["train_loader"]["batches_consumed"] == 2


def test_distributed_sampler_injection_is_refused(data: Path, tmp_path: Path) -> None:
    dm = _module(data, tmp_path)
    dm.trainer = FakeTrainer(
        world_size=2, _accelerator_connector=SimpleNamespace(use_distributed_sampler=True)
    )
    with pytest.raises(UsageError, match="use_distributed_sampler=False"):
        dm.setup("fit")


def test_validation_without_a_val_source_says_what_to_pass(data: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="val_source="):
        _module(data, tmp_path).val_dataloader()


def test_without_lightning_the_import_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None\n"
        "from stager_loaders.lightning import ShardedDataModule\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ShardedDataModule needs PyTorch Lightning")
    assert "pip install lightning" in last


# --------------------------------------------------------------- with a real Lightning Trainer
def _run(data: Path, tmp_path: Path, ckpt_dir: Path, resume: Path | None = None) -> list:
    from stager_loaders.lightning import ShardedDataModule, lightning_package

    pl = lightning_package()
    import torch

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 10)
            self.seen: list[list[str]] = []

        def training_step(self, batch, batch_idx):
            images, labels, keys = batch
            self.seen.append(list(keys))
            colours = images.float().mean(dim=(1, 2)) / 255
            return torch.nn.functional.cross_entropy(self.layer(colours), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    dm = ShardedDataModule(
        data, num_workers=0, options=LoaderOptions(dest=str(tmp_path / "scratch")), **KW
    )
    every_step = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    every_epoch = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, filename="end-{epoch}", save_top_k=-1, save_on_train_epoch_end=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (srun, workers, logging) on a toy run
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[every_step, every_epoch],
            use_distributed_sampler=False,
        )
        trainer.fit(model, datamodule=dm, ckpt_path=str(resume) if resume else None)
    return model.seen


@pytest.mark.skipif(not HAVE_LIGHTNING, reason="neither lightning nor pytorch_lightning installed")
@pytest.mark.parametrize(
    ("checkpoint", "done"),
    [("step=3", 3), ("step=10", 10), ("step=13", 13), ("end-epoch=0", 10)],
)
def test_trainer_resumes_with_the_next_batch(
    data: Path, tmp_path: Path, checkpoint: str, done: int
) -> None:
    """Steps 3 and 13 are mid-epoch (10 batches per epoch); step 10 is saved after the last
    batch of epoch 0, end-epoch=0 at that epoch's end."""
    full = _run(data, tmp_path, tmp_path / "full")
    assert len(full) == 20 and full[:10] != full[10:]  # epoch 1 has its own order
    resumed = _run(
        data, tmp_path, tmp_path / "resumed", resume=tmp_path / "full" / f"{checkpoint}.ckpt"
    )
    assert resumed == full[done:]
