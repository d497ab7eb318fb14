"""stage-out and restore against a real S3-compatible server (moto on loopback) via s3fs.

S3 cannot rename, so this exercises the commit-marker path end to end through the console
scripts: upload to final keys, record last, readers trust only records.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from stager.errors import EXIT_CHECKPOINT

from .conftest import clean_env, run_cli
from .s3server import moto_server, s3_client, s3_env
from .test_stageout import same_tree, set_mtime, write_ckpt_dir, write_ckpt_file

pytestmark = pytest.mark.s3

BUCKET = "stager-stageout-test"


@pytest.fixture(scope="module")
def endpoint() -> str:

    with moto_server() as url:
        client = s3_client(url)
        client.create_bucket(Bucket=BUCKET)
        client.close()
        yield url


def test_s3_round_trip_keep_and_marker_visibility(endpoint: str, tmp_path: Path) -> None:

    env = clean_env(**s3_env(endpoint))
    dest = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    scratch = tmp_path / "scratch"
    for i in range(3):
        set_mtime(write_ckpt_dir(scratch / f"step-{i}", seed=i), 1_700_000_000 + i)
    set_mtime(write_ckpt_file(scratch / "last.pt", seed=9), 1_600_000_000)

    out = run_cli("stage-out", "--all", str(scratch), dest, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(" committed ") == 4
    again = run_cli("stage-out", "--all", "--keep", "2", str(scratch), dest, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already committed") == 2
    assert "pruned step-0" in again.stderr and "pruned last.pt" in again.stderr

    got = run_cli("stage-in", "--checkpoint", dest, "--dest", str(tmp_path / "local"), env=env)
    assert got.returncode == 0, got.stderr
    restored = Path(got.stdout.strip())
    assert restored.name == "step-2" and same_tree(scratch / "step-2", restored)

    # Without its marker a fully uploaded checkpoint is invisible: restore falls back.
    bucket, _, key = dest[len("s3://") :].partition("/")
    client = s3_client(endpoint)
    client.delete_object(Bucket=bucket, Key=f"{key}/.stager/commits/step-2.json")
    client.close()
    got = run_cli("stage-in", "--checkpoint", dest, "--dest", str(tmp_path / "local2"), env=env)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).name == "step-1"
    assert same_tree(scratch / "step-1", Path(got.stdout.strip()))


def test_an_unreachable_store_is_one_line_and_exit_5(tmp_path: Path) -> None:
    """botocore's EndpointConnectionError is no OSError: stage-out and restore ended in a
    traceback (exit 1), and a --watch died at its first pass with the store away."""
    from stager.errors import EXIT_DEST

    from .s3server import free_port

    env = clean_env(**s3_env(f"http://127.0.0.1:{free_port()}"))  # (nothing listens there)
    env["AWS_MAX_ATTEMPTS"] = "1"
    ckpt = write_ckpt_file(tmp_path / "scratch" / "last.pt", seed=1)
    dest = f"s3://nobody-{uuid.uuid4().hex[:6]}/exp"
    for argv in (
        ("stage-out", str(ckpt), dest),
        ("stage-in", "--checkpoint", dest, "--dest", str(tmp_path / "local")),
    ):
        done = run_cli(*argv, env=env, timeout=240)
        assert done.returncode == EXIT_DEST, (argv, done.stderr)
        assert "Traceback" not in done.stderr and "is not reachable" in done.stderr, done.stderr


def test_a_failed_restage_of_a_committed_name_keeps_the_commit(
    endpoint: str, tmp_path: Path
) -> None:
    """``last.pt`` committed, then staged out again: uploads went to the final keys, so the
    old commit was withdrawn before the upload, and an upload given up (here: past its
    deadline) left no checkpoint at all; restore then started from scratch (exit 9)."""
    env = clean_env(**s3_env(endpoint))
    dest = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/exp"
    scratch = tmp_path / "scratch"
    ckpt = write_ckpt_file(scratch / "last.pt", seed=1)
    first = ckpt.read_bytes()
    assert run_cli("stage-out", str(ckpt), dest, env=env).returncode == 0
    ckpt.write_bytes(os.urandom(12 << 20))  # the next save, larger
    slow = ("--bw-limit", "2", "--deadline-s", "2", "--assume-mbps", "10000")
    given_up = run_cli("stage-out", *slow, str(ckpt), dest, env=env)
    assert given_up.returncode == EXIT_CHECKPOINT, given_up.stderr
    local = tmp_path / "local"
    got = run_cli("stage-in", "--checkpoint", dest, "--dest", str(local), env=env)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).read_bytes() == first
    again = run_cli("stage-out", str(ckpt), dest, env=env)  # and the new one, once it can
    assert again.returncode == 0, again.stderr
    got = run_cli("stage-in", "--checkpoint", dest, "--dest", str(tmp_path / "l2"), env=env)
    assert Path(got.stdout.strip()).read_bytes() == ckpt.read_bytes()


def test_names_with_glob_characters_never_touch_other_checkpoints(
    endpoint: str, tmp_path: Path
) -> None:
    """fsspec's copy and rm expand * ? [ as a glob: a*b's commit copied nothing ("copied
    short"), and undoing it deleted the committed a1b's data under its record; --all then
    committed nothing. Every name is a name, here as on a path DEST."""
    env = clean_env(**s3_env(endpoint))
    dest = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/glob"
    scratch = tmp_path / "scratch"
    for i, name in enumerate(["a1b", "a*b", "ck[1]", "q?x", "rank[0]"]):
        set_mtime(write_ckpt_dir(scratch / name, seed=i), 1_700_000_000 + i)
    (scratch / "rank[0]" / "w?.pt").write_bytes(b"weights of an odd name")
    first = run_cli("stage-out", str(scratch / "a1b"), dest, env=env)
    assert first.returncode == 0, first.stderr
    every = run_cli("stage-out", "--all", str(scratch), dest, env=env)
    assert every.returncode == 0, every.stderr
    assert every.stderr.count("stage-out: committed ") == 4, every.stderr
    assert "a1b already committed" in every.stderr
    got = run_cli("stage-in", "--checkpoint", dest, "--dest", str(tmp_path / "r"), env=env)
    assert got.returncode == 0, got.stderr
    assert same_tree(scratch / "rank[0]", Path(got.stdout.strip()))  # (the newest)
    import s3fs

    fs = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": endpoint}, key="testing", secret="testing"
    )
    keys = set(fs.find(dest))
    for name in ("a1b", "a*b", "ck[1]", "q?x"):  # every file of every checkpoint is there
        for path in (scratch / name).rglob("*"):
            if path.is_file():
                assert f"{dest[5:]}/{path.relative_to(scratch)}" in keys, (name, path)


def test_giving_up_an_attempt_on_a_store_that_is_gone_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cleanup of a failed attempt raised botocore's connection error (no OSError), which
    replaced the one-line destination error that failed it: a one-shot stage-out ended in a
    traceback (exit 1), and --watch, which retries what its passes raise as stager's errors,
    ended for good when the store went away mid-upload. What is left, the next run cleans."""
    from stager.stageout.store import Attempt
    from stager.stageout.stores import open_store

    from .s3server import free_port

    for key, value in s3_env(f"http://127.0.0.1:{free_port()}").items():  # (nothing listens)
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    store = open_store(f"s3://gone-{uuid.uuid4().hex[:6]}/run")
    attempt = Attempt("step-1", "t", store.path(".stager/staging/t"))
    store.abandon(attempt)
    store._finish(attempt)


def test_a_restore_that_fails_names_the_side_that_failed(tmp_path: Path) -> None:
    """A store lost mid-restore raised botocore's own error: a traceback, exit 1. A store's
    OSError (throttling: EBUSY) was blamed on the local directory ("free space or pass
    --dest"). Both are one line, exit 5, naming the side that failed."""
    import errno

    from botocore.exceptions import EndpointConnectionError

    from stager.errors import EXIT_DEST
    from stager.stageout.restore import _restore_error

    root, url = tmp_path / "restore", "s3://bucket/run"
    lost = _restore_error(
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), "step-2", root, url
    )
    busy = _restore_error(
        OSError(errno.EBUSY, "Please reduce your request rate.", "bucket/run/step-2/m.pt"),
        "step-2",
        root,
        url,
    )
    full = _restore_error(
        OSError(errno.ENOSPC, "No space left on device", str(root / "x.partial")),
        "step-2",
        root,
        url,
    )
    for error in (lost, busy):
        assert error.exit_code == EXIT_DEST and "--dest" not in str(error)
        assert str(error).startswith(f"cannot read step-2 from {url}: ")
    assert full.exit_code == EXIT_DEST and "pass --dest" in str(full) and str(root) in str(full)


def test_a_killed_multipart_upload_is_aborted_by_the_next_run(
    endpoint: str, tmp_path: Path
) -> None:
    """kill -9 during the upload of a file past s3fs's part size left a multipart upload that
    the next run's cleanup did not abort: its parts stay stored (and billed), unlisted."""
    import signal
    import subprocess
    import time

    from .conftest import BIN

    env = clean_env(**s3_env(endpoint))
    run = uuid.uuid4().hex[:8]
    dest = f"s3://{BUCKET}/{run}/mpu"
    big = tmp_path / "scratch" / "big.pt"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(72 << 20))  # (two parts of 50 MiB)
    proc = subprocess.Popen(
        [str(BIN / "stage-out"), "--bw-limit", "30", str(big), dest],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    client = s3_client(endpoint)

    def uploads() -> list:
        listed = client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{run}/")
        return listed.get("Uploads", [])

    deadline = time.monotonic() + 60
    while not uploads():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert uploads()  # (left by the kill)
    again = run_cli("stage-out", str(big), dest, env=env)
    assert again.returncode == 0, again.stderr
    assert "cleaned an interrupted stage-out of big.pt" in again.stderr
    assert not uploads()
    client.close()


def test_a_bucket_that_does_not_exist_is_refused_not_created(endpoint: str, tmp_path: Path) -> None:
    """A typo in DEST's bucket: s3fs's makedirs created the bucket and the checkpoints were
    committed there, where the requeued job's restore never looks, and a restore from it said
    "no committed checkpoint yet" (exit 9, a first start). Both are one line, exit 5, and no
    bucket is made."""
    from stager.errors import EXIT_DEST

    env = clean_env(**s3_env(endpoint))
    write_ckpt_file(tmp_path / "scratch" / "last.pt", seed=1)
    missing = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    last = str(tmp_path / "scratch" / "last.pt")
    out = run_cli("stage-out", last, f"s3://{missing}/run", env=env)
    assert out.returncode == EXIT_DEST, out.stderr
    assert "Traceback" not in out.stderr and f"bucket '{missing}' does not exist" in out.stderr
    restore = run_cli(
        "stage-in", "--checkpoint", f"s3://{missing}/run", "--dest", str(tmp_path / "r"), env=env
    )  # (a first start would be exit 9: the job trained from step 0)
    assert restore.returncode == EXIT_DEST, restore.stderr
    assert f"bucket '{missing}' does not exist" in restore.stderr
    client = s3_client(endpoint)
    try:
        assert missing not in {b["Name"] for b in client.list_buckets()["Buckets"]}
    finally:
        client.close()
