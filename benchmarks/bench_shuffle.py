"""Shuffle quality: the epoch orders against what a uniform random permutation would give.

Run: ``.venv/bin/python -m benchmarks.bench_shuffle [--epochs K] [--json PATH]``

Compared, on the same datasets and seeds: numpy's ``Generator.permutation`` (the planner before
issue 20, :mod:`benchmarks.legacy_plan`; a uniform permutation for all practical purposes), the
keyed Feistel bijection now used for ``shuffle="global"`` (at its default rounds and, to show
why that default, at fewer), and both versions of ``shuffle="blocked"``. Statistics, with what a
uniform permutation gives (the "uniform" column):

* **position uniformity**: N = 1,000 samples (not a power of two, so cycle walking is
  exercised), K epochs; the count of each (sample, position decile) cell against K/10, as the
  chi-square's z-score ``(chi2 - dof) / sqrt(2 dof)``: |z| < 3 is indistinguishable from
  uniform;
* **first-position uniformity**: which sample lands at position 0 over K epochs, chi-square z;
* **neighbour correlation**: Pearson correlation of ``order[p]`` with ``order[p + 1]``, averaged
  over K epochs, as a z-score against the spread a uniform permutation has
  (``1 / sqrt(N K)``);
* **max lag correlation**: the same at every power-of-two lag, for ``order`` and for its
  inverse (positions of samples ``g`` and ``g + lag``), the largest |z|: a Feistel network with
  too few rounds shows here (inputs that share one half keep a relation); for a uniform
  permutation, the largest of these 18 |z| is typically 1.5-3 ("2.5" in the uniform row);
* **mean step**: mean ``|order[p + 1] - order[p]| / N``, 1/3 for a uniform permutation;
* **distinct shards per batch**: 1,000 shards x 100 samples, batch 256, the mean number of
  shards a batch touches, against the hypergeometric expectation;
* **epoch overlap**: 8 ranks; the fraction of a rank's samples in epoch e that it reads again
  in epoch e + 1 (uniform: 1/8);
* **cross-epoch rank correlation**: Spearman correlation of positions in consecutive epochs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

import stager.plan.permute as permute_module
from stager.plan.ranks import PlanOptions, epoch_order

from . import legacy_plan
from .common import report

OrderFn = Callable[[np.ndarray, int], np.ndarray]  # (counts, epoch) -> whole order


def _orders() -> dict[str, tuple[str, OrderFn]]:
    """Column name -> (mode, whole-order function)."""

    def new(mode: str, block: int = 256) -> OrderFn:
        def order(counts: np.ndarray, epoch: int) -> np.ndarray:
            options = PlanOptions(batch_size=1, seed=1, shuffle=mode, block_samples=block)
            return epoch_order(counts, epoch=epoch, options=options)

        return order

    def old(mode: str, block: int = 256) -> OrderFn:
        def order(counts: np.ndarray, epoch: int) -> np.ndarray:
            options = PlanOptions(batch_size=1, seed=1, shuffle=mode, block_samples=block)
            return legacy_plan.epoch_order(counts, epoch=epoch, options=options)

        return order

    return {
        "numpy permutation (old global)": ("global", old("global")),
        "Feistel (new global)": ("global", new("global")),
        "old blocked (256)": ("blocked", old("blocked")),
        "new blocked (256)": ("blocked", new("blocked")),
    }


def _chi2_z(observed: np.ndarray, expected: float, dof: int) -> float:
    chi2 = float(((observed - expected) ** 2).sum() / expected)
    return (chi2 - dof) / math.sqrt(2 * dof)


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1])


def _lags(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length() - 1)]


def small_domain_stats(order: OrderFn, epochs: int, n: int = 1000) -> dict[str, float]:
    counts = np.asarray([n])
    cells = np.zeros((n, 10))
    first = np.zeros(n)
    lags = _lags(n)
    corr_p = np.zeros(len(lags))  # order[p] against order[p + lag]
    corr_g = np.zeros(len(lags))  # position[g] against position[g + lag]
    steps = []
    decile = (np.arange(n) * 10) // n
    for epoch in range(epochs):
        o = order(counts, epoch)
        position = np.empty(n, dtype=np.int64)
        position[o] = np.arange(n)
        np.add.at(cells, (o, decile), 1)
        first[o[0]] += 1
        for i, lag in enumerate(lags):
            corr_p[i] += _corr(o[:-lag], o[lag:])
            corr_g[i] += _corr(position[:-lag], position[lag:])
        steps.append(float(np.abs(np.diff(o)).mean() / n))
    # a uniform permutation's lag correlation: mean -(n - lag) / (n (n - 1)) (sampling without
    # replacement; measured over 20k numpy permutations), spread 1 / sqrt(n - lag) per epoch
    bias = np.asarray([-(n - lag) / (n * (n - 1)) for lag in lags])
    spread = np.asarray([1 / math.sqrt((n - lag) * epochs) for lag in lags])
    z_p, z_g = (corr_p / epochs - bias) / spread, (corr_g / epochs - bias) / spread
    return {
        # each epoch fixes every row sum (1 per sample) and column sum (n/10 per decile)
        "position_z": _chi2_z(cells, epochs / 10, (n - 1) * 9),
        "first_position_z": _chi2_z(first, epochs / n, n - 1),
        "neighbour_corr_z": float(z_p[0]),
        "max_lag_corr_z": float(max(np.abs(z_p).max(), np.abs(z_g).max())),
        "mean_step": float(np.mean(steps)),
    }


def _expected_distinct(shards: int, per_shard: int, batch: int) -> float:
    total = shards * per_shard
    # P(a shard is untouched) = C(total - m, B) / C(total, B), via log-gamma
    log_p = (
        math.lgamma(total - per_shard + 1)
        - math.lgamma(total - per_shard - batch + 1)
        - math.lgamma(total + 1)
        + math.lgamma(total - batch + 1)
    )
    return shards * (1 - math.exp(log_p))


def dataset_stats(
    order: OrderFn,
    epochs: int,
    shards: int = 1000,
    per_shard: int = 100,
    batch: int = 256,
    world: int = 8,
) -> dict[str, float]:
    counts = np.full(shards, per_shard)
    total = shards * per_shard
    distinct, overlap, spearman = [], [], []
    previous: np.ndarray | None = None
    share = total // world
    for epoch in range(epochs):
        o = order(counts, epoch)
        usable = (total // batch) * batch
        shard_of = o[:usable] // per_shard
        per_batch = np.sort(shard_of.reshape(-1, batch), axis=1)
        distinct.append(float((np.diff(per_batch, axis=1) != 0).sum(axis=1).mean() + 1))
        if previous is not None:
            for rank in range(world):
                mine = o[rank * share : (rank + 1) * share]
                before = previous[rank * share : (rank + 1) * share]
                overlap.append(len(np.intersect1d(mine, before)) / share)
            pos_now = np.empty(total)
            pos_now[o] = np.arange(total)
            pos_before = np.empty(total)
            pos_before[previous] = np.arange(total)
            spearman.append(_corr(pos_now, pos_before))
        previous = o
    return {
        "distinct_shards_per_batch": float(np.mean(distinct)),
        "epoch_overlap": float(np.mean(overlap)),
        "cross_epoch_spearman": float(np.mean(spearman)),
    }


def uniform_expectations(shards: int = 1000, per_shard: int = 100, batch: int = 256) -> dict:
    return {
        "position_z": 0.0,
        "first_position_z": 0.0,
        "neighbour_corr_z": 0.0,
        "max_lag_corr_z": 2.5,
        "mean_step": (1000 + 1) / (3 * 1000),
        "distinct_shards_per_batch": _expected_distinct(shards, per_shard, batch),
        "epoch_overlap": 1 / 8,
        "cross_epoch_spearman": 0.0,
    }


def bench(
    epochs: int = 4000, dataset_epochs: int = 10, rounds: tuple[int, ...] = (2, 3, 4, 5, 8)
) -> list[dict]:
    rows = [{"order": "uniform (expected)", **uniform_expectations()}]
    for name, (_, fn) in _orders().items():
        rows.append(
            {"order": name, **small_domain_stats(fn, epochs), **dataset_stats(fn, dataset_epochs)}
        )
    default = permute_module.ROUNDS
    for count in rounds:  # why the default: what fewer (and more) rounds look like
        permute_module.ROUNDS = count
        try:
            fn = _orders()["Feistel (new global)"][1]
            rows.append(
                {
                    "order": f"Feistel, {count} rounds",
                    **small_domain_stats(fn, epochs),
                    **dataset_stats(fn, dataset_epochs),
                }
            )
        finally:
            permute_module.ROUNDS = default
    for row in rows:
        row.update(bench="shuffle", epochs=epochs, feistel_rounds_default=default)
    return rows


COLUMNS = (
    ("position_z", "position z", "{:+.1f}"),
    ("first_position_z", "first position z", "{:+.1f}"),
    ("neighbour_corr_z", "neighbour corr z", "{:+.1f}"),
    ("max_lag_corr_z", "max lag corr z", "{:.1f}"),
    ("mean_step", "mean step / N", "{:.4f}"),
    ("distinct_shards_per_batch", "shards per batch", "{:.1f}"),
    ("epoch_overlap", "epoch overlap", "{:.4f}"),
    ("cross_epoch_spearman", "cross-epoch Spearman", "{:+.4f}"),
)


def to_markdown(rows: list[dict]) -> str:
    head = "| order | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 1) + "|"]
    for row in rows:
        cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        lines.append(f"| {row['order']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4000, help="epochs for the N=1,000 stats")
    parser.add_argument("--dataset-epochs", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = bench(args.epochs, args.dataset_epochs)
    print(
        f"N=1,000 over {args.epochs} epochs; 1,000 shards x 100 samples, batch 256, 8 ranks, "
        f"over {args.dataset_epochs} epochs; seed 1"
    )
    report(rows, to_markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
