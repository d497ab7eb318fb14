"""Defects a hostile review of the loader found (2026-11-28), each as it was reported: a resume
that changed what shapes the order (the streaming path's workers and shuffle buffer, the
blocked shuffle's block) was accepted and repeated some samples and skipped others; extensions
were not lower-cased as webdataset groups them; ``world_size=0`` and ``to_tuple="__key__"``."""

from __future__ import annotations

import gc
import gzip
import os
import tarfile
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stager.errors import IntegrityError, ResumeMismatch, UsageError
from stager_loaders import LoaderOptions, ShardedLoader

from .trees import tar_bytes


def _write_tar(path: Path, members: list[tuple[str, bytes]], gz: bool = False) -> None:
    data = tar_bytes(members)
    path.write_bytes(gzip.compress(data) if gz else data)


def _dataset(root: Path, gz: bool = False, shards: int = 6, per_shard: int = 22) -> Path:
    root.mkdir(parents=True)
    for s in range(shards):
        members = [(f"s{s}-{i:03d}.cls", str(i % 10).encode()) for i in range(per_shard)]
        _write_tar(root / f"part-{s:03d}.{'tar.gz' if gz else 'tar'}", members, gz)
    return root


def _keys(loader: ShardedLoader) -> list[str]:
    return [key for (batch,) in loader for key in batch]


def _options(**kw) -> LoaderOptions:
    return LoaderOptions(rank=0, world_size=1, **kw)


def _state_after(loader: ShardedLoader, batches: int) -> dict:
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ({"num_workers": 2}, {"num_workers": 0}),
        ({"buffer_samples": 1000}, {"buffer_samples": 10}),
    ],
)
def test_a_streaming_resume_with_another_order_is_refused(
    tmp_path: Path, saved: dict, resumed: dict
) -> None:
    """On .tar.gz shards each worker streams its own range through its own shuffle buffer: a
    state saved with other workers or another buffer names another order."""
    data = _dataset(tmp_path / "gz", gz=True)

    def loader(num_workers: int = 0, buffer_samples: int = 1000) -> ShardedLoader:
        options = _options(buffer_samples=buffer_samples)
        return ShardedLoader(
            str(data), batch_size=5, num_workers=num_workers, to_tuple=("__key__",), options=options
        )

    before = loader(**saved)
    before.set_epoch(1)
    state = _state_after(before, 6)
    with pytest.raises(ResumeMismatch, match="order's settings"):
        loader(**resumed).load_state_dict(state)
    again = loader(**saved)  # the same settings still resume, exactly
    again.load_state_dict(state)
    whole = loader(**saved)
    whole.set_epoch(1)
    assert _keys(again) == _keys(whole)[6 * 5 :]


def test_a_refused_state_leaves_the_loader_as_it_was(tmp_path: Path) -> None:
    """A state with batches_consumed past the epoch was refused after the loader took its
    epoch and position: the epoch then yielded no batch. A negative epoch was accepted."""
    data = _dataset(tmp_path / "plain")

    def loader() -> ShardedLoader:
        return ShardedLoader(str(data), batch_size=5, to_tuple=("__key__",), options=_options())

    before = loader()
    before.set_epoch(1)
    state = _state_after(before, 3)
    fresh = loader()
    fresh.set_epoch(1)
    for bad in ({**state, "batches_consumed": 999}, {**state, "epoch": -5}):
        with pytest.raises(ResumeMismatch):
            fresh.load_state_dict(bad)
    whole = loader()
    whole.set_epoch(1)
    assert _keys(fresh) == _keys(whole) and len(fresh) == len(whole)


def test_a_blocked_shuffle_resume_with_another_block_is_refused(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "plain")

    def loader(block: int) -> ShardedLoader:
        options = _options(shuffle_mode="blocked", block_samples=block)
        return ShardedLoader(str(data), batch_size=5, to_tuple=("__key__",), options=options)

    before = loader(4096)
    before.set_epoch(1)
    state = _state_after(before, 6)
    with pytest.raises(ResumeMismatch, match="block_samples"):
        loader(8).load_state_dict(state)
    again = loader(4096)
    again.load_state_dict(state)
    whole = loader(4096)
    whole.set_epoch(1)
    assert _keys(again) == _keys(whole)[6 * 5 :]


def test_a_state_without_the_order_settings_still_resumes(tmp_path: Path) -> None:
    """A state saved before the order's settings were kept names none: it is not refused."""
    data = _dataset(tmp_path / "plain")
    loader = ShardedLoader(str(data), batch_size=5, to_tuple=("__key__",), options=_options())
    state = _state_after(loader, 3)
    state.pop("order")
    fresh = ShardedLoader(str(data), batch_size=5, to_tuple=("__key__",), options=_options())
    fresh.load_state_dict(state)
    assert len(_keys(fresh)) == len(_keys(loader)) - 3 * 5


@pytest.mark.parametrize("layout", ["plain", "gz", "staged"])
def test_upper_case_extensions_group_as_webdataset_groups_them(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "src"
    root.mkdir()
    members = []
    for i in range(4):
        members += [(f"{i:03d}.BIN", b"x" * (i + 1)), (f"{i:03d}.Cls", str(i).encode())]
    _write_tar(root / f"up-000.{'tar.gz' if layout == 'gz' else 'tar'}", members, layout == "gz")
    # what webdataset makes of it: group_by_keys(lcase=True) lower-cases each extension
    expected = [(b"x" * (i + 1), i) for i in range(4)]
    options = _options()
    if layout == "staged":
        from stager.cli.main import main

        assert main(["stage-in", str(root), "--dest", str(tmp_path / "s"), "--quiet"]) == 0
        options = _options(dest=str(tmp_path / "s"))
    for to_tuple in (("bin", "cls"), ("BIN", "CLS"), "bin cls"):
        loader = ShardedLoader(
            str(root),
            batch_size=4,
            shuffle=False,
            decode="rgb8",
            to_tuple=to_tuple,
            options=options,
        )
        ((payloads, labels),) = list(loader)
        assert list(zip(payloads, labels.tolist(), strict=True)) == expected


def test_one_extension_in_two_cases_is_one_member_twice(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    _write_tar(root / "twice.tar", [("k0.jpg", b"a"), ("k0.JPG", b"b"), ("k1.jpg", b"c")])
    with pytest.raises(IntegrityError, match="twice"):
        list(ShardedLoader(str(root), batch_size=2, to_tuple=("__key__",), options=_options()))


def test_a_world_of_no_ranks_is_a_usage_error(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "plain", shards=1)
    with pytest.raises(UsageError, match="world_size"):
        ShardedLoader(str(data), batch_size=4, options=LoaderOptions(rank=0, world_size=0))


def test_to_tuple_as_one_string_names_members_not_characters(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "plain", shards=1, per_shard=4)
    loader = ShardedLoader(
        str(data),
        batch_size=4,
        shuffle=False,
        decode="rgb8",
        to_tuple="__key__ cls",
        options=_options(),
    )
    ((keys, labels),) = list(loader)
    assert list(keys) == [f"s0-{i:03d}" for i in range(4)] and labels.tolist() == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="to_tuple"):
        ShardedLoader(str(data), batch_size=4, to_tuple="", options=_options())


def test_a_staged_shard_rewritten_in_place_is_indexed_again(tmp_path: Path, capsys) -> None:
    """Same size, mtime put back: the saved index no longer describes the bytes. Before, each
    sample came with another sample's key (the review's ('a000', 'b000'), ...)."""
    from stager.cli.main import main

    src = tmp_path / "data"
    src.mkdir()
    _write_tar(src / "s-000.tar", [(f"a{i:03d}.cls", f"a{i:03d}".encode()) for i in range(5)])
    dest = tmp_path / "scratch"
    assert main(["stage-in", str(src), "--dest", str(dest), "--quiet"]) == 0
    options = _options(dest=str(dest))
    first = ShardedLoader(str(src), batch_size=5, shuffle=False, options=options)
    assert list(next(iter(first))["__key__"]) == [f"a{i:03d}" for i in range(5)]  # indexed
    staged = dest / "data" / "s-000.tar"
    st = staged.stat()
    _write_tar(staged, [(f"b{i:03d}.cls", f"b{i:03d}".encode()) for i in range(5)])
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    batch = next(iter(ShardedLoader(str(src), batch_size=5, shuffle=False, options=options)))
    pairs = [
        (k, bytes(t.numpy()).decode()) for k, t in zip(batch["__key__"], batch["cls"], strict=True)
    ]
    assert all(key == payload for key, payload in pairs), pairs


def test_to_tuple_names_a_key_that_map_made_as_given(tmp_path: Path) -> None:
    """Only a name missing as given is looked up lower-cased: a key ``map`` made with capitals
    stays reachable (the first fix lower-cased every name and lost it)."""
    data = _dataset(tmp_path / "plain", shards=1, per_shard=4)
    loader = ShardedLoader(
        str(data),
        batch_size=4,
        shuffle=False,
        decode="rgb8",
        map=lambda s: {"Label": s["cls"], "key": s["__key__"]},
        to_tuple=("Label", "key"),
        options=_options(),
    )
    ((labels, keys),) = list(loader)
    assert labels.tolist() == [0, 1, 2, 3] and list(keys) == [f"s0-{i:03d}" for i in range(4)]


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("layout", ["plain", "gz", "staged"])
def test_member_names_that_are_not_utf8_read_as_webdataset_reads_them(
    tmp_path: Path, layout: str, tar_format: int
) -> None:
    """A GNU tar made where names are Latin-1 holds bytes that are not UTF-8 (b"caf\\xe9.jpg").
    tarfile and webdataset decode them with surrogate escapes; stage-in died writing the loader
    index (UnicodeEncodeError, exit 1) and the loader did the same on any path. Now both take
    the key as webdataset yields it."""
    import webdataset as wds

    root = tmp_path / "src"
    root.mkdir()
    members = [("caf\udce9.jpg", b"coffee"), ("caf\udce9.cls", b"1"), ("tea.jpg", b"tea")]
    members += [("tea.cls", b"2"), ("\udcff\udcfe.cls", b"3")]
    data = tar_bytes(members, tar_format)
    name = f"s-000.{'tar.gz' if layout == 'gz' else 'tar'}"
    (root / name).write_bytes(gzip.compress(data) if layout == "gz" else data)
    with warnings.catch_warnings():  # (webdataset leaves its file to the collector)
        warnings.simplefilter("ignore", ResourceWarning)
        samples = wds.WebDataset(str(root / name), shardshuffle=False)
        expected = sorted((s["__key__"], bytes(s["cls"])) for s in samples)
        del samples
        gc.collect()
    assert expected == [("caf\udce9", b"1"), ("tea", b"2"), ("\udcff\udcfe", b"3")]
    options = _options()
    if layout == "staged":
        from stager.cli.main import main

        dest = tmp_path / "s"
        assert main(["stage-in", str(root), "--dest", str(dest), "--quiet"]) == 0
        options = _options(dest=str(dest))
    loader = ShardedLoader(
        str(root), batch_size=3, shuffle=False, to_tuple=("__key__", "cls"), options=options
    )
    ((keys, labels),) = list(loader)
    # (raw members: uint8 tensors, or bytes from a compressed shard, as docs/loader.md says)
    raw = [label if isinstance(label, bytes) else bytes(label.numpy()) for label in labels]
    got = sorted(zip(keys, raw, strict=True))
    assert got == expected


def test_a_staged_copy_is_used_before_anything_is_asked_of_the_source(tmp_path: Path) -> None:
    """A source that is itself a copied staged directory (it holds .stager/manifest.json):
    the loader used to take the source for the staged copy and read it from the shared
    filesystem, although the node-local copy of it was staged; and it stat'ed the source and
    looked for a staged layout inside it for every source, on every rank. The staged copy of
    this very source is now looked up first."""
    import shutil

    from stager.cli.main import main

    data = _dataset(tmp_path / "first", shards=2, per_shard=3)
    assert main(["stage-in", str(data), "--dest", str(tmp_path / "s1"), "--quiet"]) == 0
    source = tmp_path / "nfs" / "copied"
    shutil.copytree(tmp_path / "s1" / "first", source)  # (.stager/ and all)
    assert (source / ".stager" / "manifest.json").is_file()
    dest = tmp_path / "s2"
    assert main(["stage-in", str(source), "--dest", str(dest), "--quiet"]) == 0
    loader = ShardedLoader(
        str(source), batch_size=3, to_tuple=("__key__",), options=_options(dest=str(dest))
    )
    assert loader.shards.staged_dir == dest / "copied" and loader.shards.from_source == 0
    assert sorted(_keys(loader)) == [f"s{s}-{i:03d}" for s in range(2) for i in range(3)]
    # given the staged directory itself, it is read as before
    itself = ShardedLoader(str(dest / "copied"), batch_size=3, options=_options())
    assert itself.shards.staged_dir == dest / "copied"


@given(
    per_rank=st.integers(0, 5000),
    workers=st.integers(1, 8),
    batch_size=st.integers(1, 300),
)
def test_a_streaming_rank_is_cut_for_its_workers_in_whole_batches(
    per_rank: int, workers: int, batch_size: int
) -> None:
    """Each worker batches its own range: a range that is no multiple of the batch size left
    a short batch per worker (pad) or dropped its tail (drop), up to a whole epoch."""
    from stager.plan.streaming import worker_samples

    parts = worker_samples(per_rank, workers, batch_size)
    assert len(parts) == workers and sum(parts) == per_rank
    assert sum(1 for part in parts if part % batch_size) <= 1  # one short batch at most
    assert max(parts) - min(parts) < 2 * batch_size  # spread as evenly as whole batches go
    dropped = per_rank - sum(part // batch_size * batch_size for part in parts)
    assert dropped == per_rank % batch_size  # under drop, less than one batch a rank


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # (3 > cores)
@pytest.mark.parametrize("even", ["drop", "pad"])
def test_a_streaming_epoch_with_workers_keeps_its_whole_batches(tmp_path: Path, even: str) -> None:
    """The review's case: 9 .tar.gz shards of 13 samples, batches of 21, 3 workers, 2 ranks.
    Each rank's 58 samples were split 20/19/19 over the workers, none of which made a full
    batch: with drop, len() was 0 on every rank, an epoch of no steps."""
    root = tmp_path / "gz"
    root.mkdir()
    for s in range(9):
        members = [(f"s{s}-{i:03d}.cls", str(i % 10).encode()) for i in range(13)]
        _write_tar(root / f"part-{s:03d}.tar.gz", members, gz=True)
    seen: list[str] = []
    for rank in range(2):
        options = LoaderOptions(rank=rank, world_size=2, dest=str(tmp_path / "none"))
        loader = ShardedLoader(
            str(root),
            batch_size=21,
            num_workers=3,
            even=even,
            to_tuple=("__key__",),
            options=options,
        )
        batches = [batch for (batch,) in loader]
        assert len(batches) == len(loader) == (2 if even == "drop" else 3)
        assert [len(b) for b in batches[:2]] == [21, 21]
        seen += [key for batch in batches for key in batch]
    if even == "drop":
        assert len(seen) == len(set(seen)) == 84  # 117 less under a batch per rank
    else:
        assert set(seen) == {f"s{s}-{i:03d}" for s in range(9) for i in range(13)}


def test_an_epoch_of_no_batches_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """8 samples, 3 ranks, batches of 3, drop: no rank has a full batch, so the epoch has no
    steps on any rank (as DataLoader(drop_last=True) makes it); it is said once, not left to
    a training loop that silently does nothing."""
    data = _dataset(tmp_path / "plain", shards=1, per_shard=8)
    options = LoaderOptions(rank=1, world_size=3, dest=str(tmp_path / "none"))
    loader = ShardedLoader(str(data), batch_size=3, even="drop", options=options)
    with caplog.at_level("WARNING", logger="stager_loaders"):
        assert len(loader) == 0 and list(loader) == []
    assert any("has no batch on any rank" in r.getMessage() for r in caplog.records)
    caplog.clear()
    padded = ShardedLoader(str(data), batch_size=3, even="pad", options=options)
    with caplog.at_level("WARNING", logger="stager_loaders"):
        assert len(list(padded)) == len(padded) == 1
    assert not any("has no batch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("now", [10, 30])
def test_a_streamed_shard_that_changed_since_it_was_counted_is_refused(
    tmp_path: Path, now: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan holds each shard's count; a streamed shard rewritten since (an object store's
    key) gave the rank fewer samples, or dropped those past the count, without a word, where a
    staged shard raised IntegrityError."""
    root = _dataset(tmp_path / "ds", gz=True, shards=3, per_shard=22)
    loaders = [
        ShardedLoader(
            str(root), batch_size=4, to_tuple=("__key__",), options=_options(on_error=on_error)
        )
        for on_error in ("raise", "skip")
    ]
    members = [(f"s1-{i:03d}.cls", b"1") for i in range(now)]
    _write_tar(root / "part-001.tar.gz", members, gz=True)
    with pytest.raises(IntegrityError, match=r"part-001.tar.gz: holds .* but the plan counted 22"):
        _keys(loaders[0])
    keys = _keys(loaders[1])  # (the rest of it left out, with a warning)
    assert "corrupt shard" in caplog.text and "part-001.tar.gz" in caplog.text
    assert len(keys) == 66 - 22 + min(now, 22)


_TRUNCATE_BETWEEN_EPOCHS = """
import os, sys
from stager.errors import IntegrityError
from stager_loaders import LoaderOptions, ShardedLoader
root, workers = sys.argv[1], int(sys.argv[2])
options = LoaderOptions(rank=0, world_size=1, persistent_workers=workers > 0)
loader = ShardedLoader(root, batch_size=8, num_workers=workers, to_tuple=("__key__",),
                       options=options)
loader.set_epoch(0)
assert sum(len(keys) for (keys,) in loader) == 66
shard = os.path.join(root, "part-001.tar")
os.truncate(shard, os.path.getsize(shard) // 3)  # cut inside its members
loader.set_epoch(1)
try:
    list(loader)
except IntegrityError as exc:
    print("IntegrityError:", str(exc).splitlines()[-1])
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_truncated_between_epochs_is_an_integrity_error(
    tmp_path: Path, workers: int
) -> None:
    """With ``num_workers=0`` (or persistent workers) a shard stays mapped from the first epoch
    at the length it had: reading it after it was truncated touched pages past its new end,
    and SIGBUS killed the training process (a worker's death was reported as "insufficient
    shared memory") instead of the IntegrityError naming the shard."""
    import subprocess
    import sys

    from .conftest import REPO, clean_env

    root = _dataset(tmp_path / "ds", shards=3, per_shard=22)
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_BETWEEN_EPOCHS, str(root), str(workers)],
        cwd=REPO,
        env=clean_env(TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "IntegrityError:" in done.stdout and "part-001.tar" in done.stdout
    assert "is truncated" in done.stdout, done.stdout


def test_a_cut_staged_copy_with_the_source_gone_is_one_source_error(tmp_path: Path) -> None:
    """A staged copy cut short is passed by for the source; where the source cannot be read
    either, the loader raised a bare FileNotFoundError from a stat, naming only the source
    path, after a warning calling the staged copy missing."""
    from stager.cli.main import main
    from stager.errors import SourceError

    src = _dataset(tmp_path / "data", shards=3, per_shard=5)
    dest = tmp_path / "scratch"
    assert main(["stage-in", str(src), "--dest", str(dest), "--quiet"]) == 0
    staged = dest / "data" / "part-001.tar"
    os.truncate(staged, staged.stat().st_size // 3)
    src.rename(tmp_path / "gone")  # the shared filesystem unreachable since the copy
    with pytest.raises(SourceError, match=r"part-001.tar: its staged copy .* not whole"):
        ShardedLoader(str(src), batch_size=4, options=_options(dest=str(dest)))
