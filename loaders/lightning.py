"""``ShardedDataModule``: a Lightning ``LightningDataModule`` over :class:`ShardedLoader`.

Lightning is optional: neither ``lightning`` nor ``pytorch_lightning`` is a dependency.
``from stager_loaders.lightning import ShardedDataModule`` builds the class on first use on the
Lightning already imported by your script (``lightning.pytorch`` or ``pytorch_lightning``: a
Trainer accepts only its own package's DataModule), else on whichever is installed, and says in
one line what to install when neither is.

Exact resume. Lightning saves a loader's ``state_dict()`` in its checkpoints and restores it,
but three things need the loader built here:

* Lightning never tells the loader the epoch (it calls ``set_epoch`` on samplers only), so
  every epoch would replay epoch 0's order: this loader follows ``trainer.current_epoch`` each
  time an epoch's iteration starts;
* restored from a checkpoint taken after an epoch's last batch, Lightning iterates the loader
  before it moves its epoch counter on, and "epoch e, every batch consumed" gave an empty
  iterator that it then kept for epoch e + 1: the state says "epoch e + 1, nothing consumed"
  instead, and a restored position keeps its epoch for that first iteration;
* the position counts the batches the trainer finished
  (``fit_loop.epoch_loop.batch_progress.current.processed``), where Lightning itself resumes,
  not the batches taken from the loader: the same with Lightning's default fetcher (it does
  not read ahead of a loader with a length), not with one that runs ahead
  (``dataloader_iter`` steps).

The same state also goes through the DataModule's own ``state_dict``/``load_state_dict``
hooks (a checkpoint taken at an epoch's end carries no loader state in Lightning's loop).
"""

from __future__ import annotations

import importlib
import os
import sys
import weakref
from typing import Any

from stager.errors import UsageError

from .loader import ShardedLoader

# ShardedDataModule is made by the module __getattr__ below, on first use.
__all__ = ["ShardedDataModule", "ShardedDataLogic", "lightning_package", "INSTALL_HINT"]  # noqa: F822

#: Where to look for Lightning, in order of preference when neither is imported yet.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
INSTALL_HINT = "pip install lightning (or pytorch-lightning, or slurm-stager[lightning])"


def lightning_package() -> Any:
    """The Lightning package the DataModule subclasses: an imported one first, else installed."""
    for name in _PACKAGES:
        if sys.modules.get(name) is not None:
            return sys.modules[name]
    for name in _PACKAGES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ModuleNotFoundError(
        f"ShardedDataModule needs PyTorch Lightning, which is not installed here: {INSTALL_HINT}",
        name="lightning",
    )


def _batches_finished(trainer: Any) -> int | None:
    """Batches of the current epoch whose training step finished, when the trainer is fitting."""
    try:
        if not trainer.training:
            return None
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
    except AttributeError:  # another Lightning layout: fall back to the loader's own count
        return None


class _TrainerLoader(ShardedLoader):
    """A ShardedLoader that follows the trainer's epoch and counts the trainer's batches."""

    _trainer_ref: weakref.ReferenceType | None = None
    _restored = False  # a loaded position waits for the next iter(): keep its epoch

    def _trainer(self) -> Any:
        return self._trainer_ref() if self._trainer_ref is not None else None

    def __iter__(self):
        trainer = self._trainer()
        # After a restore Lightning calls iter() before it moves its own epoch counter on (a
        # checkpoint taken after an epoch's last batch), so the restored epoch wins once.
        if trainer is not None and not self._restored:
            self.set_epoch(int(trainer.current_epoch))
        self._restored = False
        return super().__iter__()

    def load_state_dict(self, state: dict[str, Any], *, elastic: bool = False) -> None:
        super().load_state_dict(state, elastic=elastic)
        self._restored = True

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        trainer = self._trainer()
        finished = _batches_finished(trainer) if trainer is not None else None
        if finished is None or state["epoch"] != int(trainer.current_epoch):
            return state
        if finished >= len(self):  # the epoch is done: resume at the start of the next one
            state.update(epoch=state["epoch"] + 1, batches_consumed=0, elastic_from=None)
        else:
            state["batches_consumed"] = finished
        return state


class ShardedDataLogic:
    """Everything of :class:`ShardedDataModule` but the Lightning base class (testable alone).

    ``source``: the stage-in source (or the staged directory); ``val_source``: optional
    validation data (read in file order, no shuffle). Other keyword arguments go to every
    :class:`ShardedLoader` (``decode``, ``to_tuple``, ``seed``, ``even``, ``options``, ...).
    ``num_workers`` defaults to ``SLURM_CPUS_PER_TASK - 1`` (one core for the training loop).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        batch_size: int = 64,
        num_workers: int | None = None,
        val_source: str | os.PathLike[str] | None = None,
        **loader_kwargs: Any,
    ):
        super().__init__()
        if num_workers is None:
            cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
            num_workers = max(0, int(cpus) - 1) if cpus.isdigit() else 0
        self.source = source
        self.val_source = val_source
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.loader_kwargs = dict(loader_kwargs)
        self._train: _TrainerLoader | None = None
        self._val: ShardedLoader | None = None
        self._pending: dict[str, Any] | None = None

    # -- Lightning hooks ------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        trainer = getattr(self, "trainer", None)
        connector = getattr(trainer, "_accelerator_connector", None)
        if (
            trainer is not None
            and int(getattr(trainer, "world_size", 1)) > 1
            and getattr(connector, "use_distributed_sampler", False)
        ):
            raise UsageError(
                "ShardedDataModule splits the data per rank itself: create the Trainer with "
                "use_distributed_sampler=False"
            )

    def train_dataloader(self) -> ShardedLoader:
        if self._train is None:
            self._train = _TrainerLoader(
                self.source,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                **self.loader_kwargs,
            )
        trainer = getattr(self, "trainer", None)
        self._train._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        if self._pending is not None:
            self._train.load_state_dict(self._pending)
            self._pending = None
        return self._train

    def val_dataloader(self) -> ShardedLoader:
        if self.val_source is None:
            raise UsageError(
                "the LightningModule has a validation_step but ShardedDataModule got no "
                "val_source; pass val_source= (or limit_val_batches=0 to the Trainer)"
            )
        if self._val is None:
            kwargs = {**self.loader_kwargs, "shuffle": False}
            self._val = ShardedLoader(
                self.val_source,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                **kwargs,
            )
        return self._val

    @property
    def train_loader(self) -> ShardedLoader | None:
        """The training loader once Lightning asked for it (``.metrics`` for data-wait logging)."""
        return self._train

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position, in batches the trainer finished (see the module doc)."""
        if self._train is not None:
            return {"train_loader": self._train.state_dict()}
        if self._pending is not None:  # restored, not yet applied: keep it for the next save
            return {"train_loader": dict(self._pending)}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position when the training loader is (re)built."""
        train = state_dict.get("train_loader")
        if train is None:
            return
        if self._train is not None:
            self._train.load_state_dict(train)
        else:
            self._pending = dict(train)


_CLASS: type | None = None


def _datamodule_class() -> type:
    global _CLASS
    if _CLASS is None:
        pl = lightning_package()

        # Built with type(): the base is only known at run time (whichever Lightning is here).
        _CLASS = type(
            "ShardedDataModule",
            (ShardedDataLogic, pl.LightningDataModule),
            {"__doc__": ShardedDataLogic.__doc__, "__module__": __name__},
        )
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "ShardedDataModule":
        return _datamodule_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
