"""Pure parts of stage-out: commit records, prune plans, Slurm end-time parsing (milliseconds)."""

from __future__ import annotations

import random
import subprocess
import time
from datetime import datetime

import pytest

from stager.errors import CheckpointError
from stager.shards.manifest import ManifestEntry
from stager.slurm import SlurmEnv
from stager.stageout.deadline import (
    parse_scontrol_end_time,
    parse_slurm_time,
    resolve_deadline,
    slurm_job_end_epoch,
)
from stager.stageout.record import CommitRecord, content_id, newest_first, plan_keep, plan_prune


def _record(name: str, mtime_ns: int, committed_at: float = 0.0, kind: str = "dir") -> CommitRecord:
    relpath = name if kind == "file" else f"{name}/model.pt"
    return CommitRecord(
        name, kind, (ManifestEntry(relpath, 3, "xxh3_64:00ff"),), mtime_ns, committed_at
    )


def test_record_json_round_trip() -> None:
    record = _record("step-1", 5, 7.5)
    assert CommitRecord.from_json(record.to_json(), where="x") == record
    assert (
        CommitRecord.from_json(_record("a.pt", 1, kind="file").to_json(), where="x").kind == "file"
    )


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.replace('"step-1/model.pt"', '"../etc/passwd"'),
        lambda p: p.replace('"step-1/model.pt"', '"other/model.pt"'),
        lambda p: p.replace('"name": "step-1"', '"name": "../x"'),
        lambda p: p.replace('"size": 3', '"size": -1'),
        lambda p: p.replace('"size": 3', '"size": 4'),  # content_id no longer matches
        lambda p: p.replace("stager-checkpoint", "something-else"),
        lambda p: p[:-5],
    ],
)
def test_bad_records_are_refused(mutate) -> None:
    with pytest.raises(CheckpointError, match="commit record x"):
        CommitRecord.from_json(mutate(_record("step-1", 5).to_json()), where="x")


def test_content_id_depends_on_every_field_but_not_order() -> None:
    a, b = ManifestEntry("c/x", 1, "xxh3_64:1"), ManifestEntry("c/y", 2, "xxh3_64:2")
    assert content_id([a, b]) == content_id([b, a])
    assert content_id([a, b]) != content_id([a, ManifestEntry("c/y", 2, "xxh3_64:3")])
    assert content_id([a, b]) != content_id([a, ManifestEntry("c/y", 3, "xxh3_64:2")])
    assert content_id([a, b]) != content_id([a, ManifestEntry("c/z", 2, "xxh3_64:2")])


def test_prune_plans_over_many_random_histories_keep_the_newest() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 12)
        history = [_record(f"c{i}", rng.randint(0, 5), rng.random()) for i in range(n)]
        keep = rng.randint(1, 14)
        pruned = plan_prune(history, keep)
        ordered = newest_first(history)
        assert len(pruned) == max(0, n - keep)
        assert set(pruned) == {r.name for r in ordered[keep:]}
        if history:
            assert ordered[0].name not in pruned
            survivors = [r for r in history if r.name not in pruned]
            assert max(r.sort_key() for r in survivors) == max(r.sort_key() for r in history)
    with pytest.raises(ValueError):
        plan_prune([_record("a", 1)], 0)


def test_keep_plans_stage_only_what_the_prune_would_retain() -> None:
    committed = [_record("c3", 30), _record("c4", 40)]
    source = [("c0", 0), ("c1", 10), ("c3", 30), ("c4", 40), ("c5", 50)]
    assert plan_keep(source, committed, 2) == ["c5", "c4"]
    assert plan_keep(source, [], 10) == ["c5", "c4", "c3", "c1", "c0"]
    assert plan_keep([("old", 1)], committed, 2) == []  # two newer committed: it would be pruned
    assert plan_keep([("old", 1)], committed, 3) == ["old"]
    assert plan_keep([("c4", 45)], committed, 1) == [
        "c4"
    ]  # re-staging a committed name counts once
    rng = random.Random(1)
    for _ in range(300):  # whatever is planned survives the prune that follows
        recs = [_record(f"r{i}", rng.randint(0, 50), 0.0) for i in range(rng.randint(0, 6))]
        cands = [(f"s{i}", rng.randint(0, 50)) for i in range(rng.randint(0, 6))]
        keep = rng.randint(1, 4)
        planned = plan_keep(cands, recs, keep)
        after = recs + [_record(n, m, 1e9) for n, m in cands if n in planned]
        assert not set(planned) & set(plan_prune(after, keep))


def test_newest_is_by_checkpoint_time_then_commit_time_then_name() -> None:
    records = [
        _record("b", 1, 9.0),
        _record("a", 2, 1.0),
        _record("c", 2, 1.0),
        _record("d", 2, 0.5),
    ]
    assert [r.name for r in newest_first(records)] == ["c", "a", "d", "b"]


def test_parse_slurm_times() -> None:
    assert parse_slurm_time("2026-11-22T02:00:00\n") == datetime(2026, 11, 22, 2, 0, 0).timestamp()
    for text in ("Unknown", "N/A", "NONE", "", "garbage", "2026-13-40T99:00:00"):
        assert parse_slurm_time(text) is None
    scontrol = (
        "JobId=42 JobName=train\n   RunTime=00:01:02 TimeLimit=01:00:00 TimeMin=N/A\n"
        "   SubmitTime=2026-11-22T00:59:00 EligibleTime=2026-11-22T00:59:00\n"
        "   StartTime=2026-11-22T01:00:00 EndTime=2026-11-22T02:00:00 Deadline=N/A\n"
    )
    assert parse_scontrol_end_time(scontrol) == datetime(2026, 11, 22, 2, 0, 0).timestamp()
    assert parse_scontrol_end_time("JobId=42 EndTime=Unknown") is None
    assert parse_scontrol_end_time("no such field") is None


def test_job_end_falls_back_from_squeue_to_scontrol_and_tolerates_absence() -> None:
    calls = []

    def runner(outputs):
        def run(argv):
            calls.append(argv[0])
            result = outputs[argv[0]]
            if isinstance(result, BaseException):
                raise result
            return result

        return run

    end = "2026-11-22T02:00:00"
    assert (
        slurm_job_end_epoch("1", run=runner({"squeue": f"{end}\n"}))
        == datetime(2026, 11, 22, 2).timestamp()
    )
    assert (
        slurm_job_end_epoch(
            "1", run=runner({"squeue": FileNotFoundError("squeue"), "scontrol": f"EndTime={end}"})
        )
        is not None
    )
    assert (
        slurm_job_end_epoch("1", run=runner({"squeue": "", "scontrol": "EndTime=Unknown"})) is None
    )
    missing = FileNotFoundError("x")
    assert slurm_job_end_epoch("1", run=runner({"squeue": missing, "scontrol": missing})) is None
    hung = subprocess.TimeoutExpired("squeue", 10)
    assert slurm_job_end_epoch("1", run=runner({"squeue": hung, "scontrol": missing})) is None
    assert "scontrol" in calls


def test_resolve_deadline() -> None:
    outside = SlurmEnv.from_environ({})
    inside = SlurmEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})
    assert resolve_deadline(None, outside) is None
    assert resolve_deadline(30, outside).left_s() == pytest.approx(30, abs=1)
    assert resolve_deadline(None, inside, end_epoch=lambda _j: None) is None
    soon = resolve_deadline(None, inside, margin_s=10, end_epoch=lambda _j: time.time() + 100)
    assert (
        soon is not None
        and soon.left_s() == pytest.approx(90, abs=1)
        and soon.source == "slurm end time"
    )
    assert (
        resolve_deadline(5, inside, end_epoch=lambda _j: time.time() + 1000).source
        == "--deadline-s"
    )
