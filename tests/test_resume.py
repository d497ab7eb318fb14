"""Exact mid-epoch resume across processes: 2 ranks x 2 workers, stop after k, resume, compare.

Phase "stop" runs in one pair of processes and saves ``state_dict()`` after k batches; phase
"resume" runs in a new pair, each with a fresh loader that loads the saved state. The batches
before plus after must equal the uninterrupted epoch of ``staged_world`` on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .test_loader_ddp import MODES, STOP_AFTER, WORLD, run_world, staged_world  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def resumed(staged_world: dict[str, Any]) -> dict[str, Any]:  # noqa: F811 - the imported fixture
    root = Path(staged_world["root"])
    job = {k: staged_world[k] for k in ("source", "dest")}
    stopped = run_world({**job, "phase": "stop", "out": str(root / "stop")})
    tails = run_world(
        {**job, "phase": "resume", "out": str(root / "resume"), "stopped": str(root / "stop")}
    )
    return {"stopped": stopped, "tails": tails}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", STOP_AFTER)
def test_resume_continues_exactly_per_rank(
    staged_world: dict[str, Any],  # noqa: F811 - the imported fixture
    resumed: dict[str, Any],
    mode: str,
    k: int,
) -> None:
    for rank in range(WORLD):
        expected = staged_world["full"][rank][f"{mode}/pad"]["batches"]
        before = resumed["stopped"][rank][f"{mode}/{k}"]
        after = resumed["tails"][rank][f"{mode}/{k}"]["tail"]
        assert before["state"]["batches_consumed"] == k
        assert len(before["head"]) == k and after, "the resumed epoch must not be empty"
        assert before["head"] + after == expected, f"rank {rank}: resume after {k} batches diverged"
        json.dumps(before["state"])  # the state is JSON-able as saved
