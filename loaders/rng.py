"""Capture and restore the python, numpy and torch random generators beside a checkpoint.

The loader's own order never depends on global RNGs (it is a function of seed and epoch), but
augmentations and dropout do; restoring these makes a resumed run continue exactly.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """A picklable snapshot (``torch.save`` it with the model) of every global generator."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back as :func:`capture_rng_state` found them.

    The generator states are taken back to the CPU first: torch accepts only CPU byte tensors
    there, and a checkpoint loaded with ``torch.load(..., map_location="cuda")`` (the usual way
    to put a model on its GPU) brings them onto the GPU, where the resume failed.
    """
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
