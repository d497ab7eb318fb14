"""The local walk reads a slow tree's directories on threads; the names it finds must not depend
on that, whatever the tree holds (nested directories, directories named like shards, symlinks,
FIFOs, unreadable directories)."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import SourceError
from stager.leftout import no_shards_message
from stager.storage import listing
from stager.storage.sources import resolve_source

from .conftest import run_cli
from .trees import build_tree

_PATHS = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["a", "b", "c.tar", "d"]), min_size=0, max_size=3),
        st.sampled_from(["s.tar", "t.tgz", "u.tar.gz", "notes.txt", "x.tar"]),
        st.sampled_from(["file", "dir", "fifo", "loop"]),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=_PATHS)
def test_threaded_walk_finds_what_the_serial_walk_finds(
    tmp_path_factory: pytest.TempPathFactory, entries: list
) -> None:
    root = tmp_path_factory.mktemp("tree")
    build_tree(root, entries)
    serial = listing.walk_local(str(root), 1)
    old, old_batch = listing.SLOW_DIRECTORY_S, listing.FOUND_BATCH
    listing.SLOW_DIRECTORY_S = -1.0  # every read counts as slow: threads from the first level
    listing.FOUND_BATCH = 2  # a directory's shards are handed over in several batches
    told: list[list[str]] = []
    try:
        threaded = listing.walk_local(str(root), 8)
        streamed = listing.walk_local(str(root), 8, on_found=told.append)
    finally:
        listing.SLOW_DIRECTORY_S, listing.FOUND_BATCH = old, old_batch
    assert threaded == serial == sorted(serial) == streamed
    # what the walk hands over as it goes is exactly what it returns, each path once
    assert sorted(path for batch in told for path in batch) == serial
    assert all(batch for batch in told)


def test_an_unreadable_directory_fails_the_threaded_walk_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for d in ("a", "b", "c"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "s.tar").write_bytes(b"x")
    monkeypatch.setattr(listing, "SLOW_DIRECTORY_S", -1.0)
    real = listing._list_dir

    def failing(directory: str):  # noqa: ANN202 - the test's stand-in
        if directory.endswith("/b"):
            raise PermissionError(13, "Permission denied", directory)
        return real(directory)

    monkeypatch.setattr(listing, "_list_dir", failing)
    with pytest.raises(PermissionError):
        listing.walk_local(str(tmp_path), 8)


def test_tars_compressed_as_nothing_reads_are_named_not_dropped(tmp_path: Path) -> None:
    """``b.tar.zst`` beside ``a.tar``: staged without a word that half the dataset was left
    out (exit 0); alone, "no shards ... check the directory". Both now name it and say why, on
    a local walk and an fsspec walk, as for suffixes in upper case."""
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    src = tmp_path / "src"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=3))
    (src / "train-000001.tar").rename(src / "train-000001.tar.zst")
    done = run_cli("stage-in", str(src), "--dest", str(tmp_path / "dst"), "--jitter-max", "0")
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and "train-000001.tar.zst" in warned[0], done.stderr
    assert "recompress them as .tar.gz" in warned[0]
    (src / "train-000000.tar").rename(src / "train-000000.tar.xz")
    for spec in (str(src), f"file://{src}"):
        with pytest.raises(SourceError, match="tar.(xz|zst) and its like are tars compressed"):
            resolve_source(spec)
    memory = fsspec.filesystem("memory")
    memory.pipe(f"/{tmp_path.name}/z/c.tar.bz2", b"\0" * 1024)
    with pytest.raises(SourceError, match="c.tar.bz2 and its like are tars compressed"):
        resolve_source(f"memory://{tmp_path.name}/z")


def test_a_source_of_upper_case_suffixes_is_refused_naming_one(tmp_path: Path) -> None:
    """``SHARD-0.TAR``: no shard (suffixes are matched as written), and the one line says so
    instead of "check the directory", on the streamed first run, a walk, and an fsspec walk."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "SHARD-0.TAR").write_bytes(b"\0" * 1024)
    (src / "notes.txt").write_text("x")
    done = run_cli("stage-in", str(src), "--dest", str(tmp_path / "dst"), "--quiet")
    assert done.returncode == 3, done.stderr
    assert "SHARD-0.TAR and its like have suffixes not in lower case" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    for spec in (str(src), f"file://{src}"):
        with pytest.raises(SourceError, match="SHARD-0.TAR and its like have suffixes not in"):
            resolve_source(spec)
    memory = fsspec.filesystem("memory")  # an fsspec walk (the remote branch)
    memory.pipe(f"/{tmp_path.name}/d/SHARD-1.Tar", b"\0" * 1024)
    with pytest.raises(SourceError, match="SHARD-1.Tar and its like have suffixes not in"):
        resolve_source(f"memory://{tmp_path.name}")
    (src / "sub" / "SHARD-0.TAR").unlink()
    with pytest.raises(SourceError, match="no shards .* check the directory$"):
        resolve_source(str(src))
    # A lower-case name that is no shard (a symlink to nothing) is not called upper case.
    (src / "shard-0.tar").symlink_to(src / "gone.tar")
    assert "check the directory" in no_shards_message(str(src), listing.some_file_names(str(src)))


def test_what_a_walk_leaves_out_is_named_in_a_warning(tmp_path: Path) -> None:
    """``a.tar`` beside ``B.TAR``, and a subdirectory that is a symlink (not followed): only
    ``a.tar`` is a shard, and every way of walking the source says what was left out (a subset
    staged without a word looked whole)."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    tar = _one_shard(tmp_path)
    for name in ("a.tar", "sub/B.TAR", "C.Tar.Gz"):
        (src / name).write_bytes(tar)
    (src / "notes.txt").write_text("x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "d.tar").write_bytes(tar)
    (src / "sub" / "linked").symlink_to(tmp_path / "elsewhere")
    (src / "gone").symlink_to(tmp_path / "nowhere")  # a link to nothing is no data either way
    for spec in (str(src), f"file://{src}"):
        source = resolve_source(spec)
        assert [s.relpath for s in source.shards] == ["a.tar"]
        assert [u.split("/src/")[1] for u in source.left_out] == [
            "C.Tar.Gz",
            "sub/B.TAR",
            "sub/linked/",
        ]
    memory = fsspec.filesystem("memory")  # an fsspec walk (the remote branch)
    memory.pipe(f"/{tmp_path.name}/m/a.tar", tar)
    memory.pipe(f"/{tmp_path.name}/m/B.TAR", tar)
    assert [u.rsplit("/", 1)[-1] for u in resolve_source(f"memory://{tmp_path.name}").left_out] == [
        "B.TAR"
    ]
    dest = tmp_path / "dst"
    runs = {
        "streamed first run": ("stage-in", str(src), "--dest", str(dest)),
        "listed again": ("stage-in", str(src), "--dest", str(dest)),
        "index": ("stager", "index", str(src), "--out", str(tmp_path / "m.json")),
    }
    for how, argv in runs.items():
        done = run_cli(*argv)
        assert done.returncode == 0, (how, done.stderr)
        warnings = [line for line in done.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 2, (how, done.stderr)
        assert "C.Tar.Gz' and 1 more" in warnings[0] and "lower case" in warnings[0], how
        assert "sub/linked/'," in warnings[1] and "symlinks to directories" in warnings[1], how
    assert sorted(p.name for p in (dest / "src").iterdir()) == [".stager", "a.tar"]


def _one_shard(tmp_path: Path) -> bytes:
    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    write_synthetic_dataset(tmp_path / "one", SyntheticSpec(num_shards=1, samples_per_shard=2))
    return next((tmp_path / "one").glob("*.tar")).read_bytes()


def test_an_unreadable_subdirectory_is_named_not_the_root(tmp_path: Path, monkeypatch) -> None:
    """``ds/a/b`` without read permission was reported as "source not readable: ds", whose
    mode was fine (root reads any directory, so the refusal is made by hand here)."""
    (tmp_path / "ds" / "a" / "b").mkdir(parents=True)
    (tmp_path / "ds" / "x.tar").write_bytes(b"\0" * 1024)
    scandir = os.scandir
    refused = str(tmp_path / "ds" / "a" / "b")

    def guarded(path):
        if os.fspath(path) == refused:
            raise PermissionError(13, "Permission denied", refused)
        return scandir(path)

    monkeypatch.setattr(listing.os, "scandir", guarded)
    with pytest.raises(SourceError) as caught:
        resolve_source(str(tmp_path / "ds"))
    message = str(caught.value)
    assert message.startswith(f"source not readable: {refused} (under the source ")
    assert "permission denied" in message
    assert "source not found: s3://b/p;" in str(
        listing.translate(FileNotFoundError(2, "x", "b/p"), "s3://b/p")
    )


def test_a_glob_fails_on_a_subdirectory_it_cannot_read(tmp_path: Path, monkeypatch) -> None:
    """``ds/*/x-*.tar`` with ``ds/b`` unreadable: fsspec's walk leaves ``b`` out as if empty
    (and passes ``on_error`` to the top level only), and stage-in staged ``a``'s shards alone
    with exit 0. It is refused, naming ``b``; a directory gone meanwhile matches nothing."""
    for part in ("a", "b"):
        (tmp_path / "ds" / part).mkdir(parents=True)
        (tmp_path / "ds" / part / "x-1.tar").write_bytes(b"\0" * 1024)
    pattern = str(tmp_path / "ds" / "*" / "x-*.tar")
    assert len(resolve_source(pattern).shards) == 2
    scandir = os.scandir
    refused = {str(tmp_path / "ds" / "b"): PermissionError(13, "Permission denied")}

    def guarded(path):
        error = refused.get(os.fspath(path).rstrip("/"))
        if error is not None:
            raise type(error)(error.errno, error.strerror, os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", guarded)  # (root reads any directory: refused by hand)
    with pytest.raises(SourceError) as caught:
        resolve_source(pattern)
    assert str(caught.value).startswith(
        f"source not readable: {tmp_path / 'ds' / 'b'} (under the source {pattern})"
    )
    refused = {str(tmp_path / "ds" / "b"): FileNotFoundError(2, "No such file or directory")}
    assert [s.relpath for s in resolve_source(pattern).shards] == ["a/x-1.tar"]


def test_a_glob_reads_only_the_directories_its_pattern_can_reach(
    tmp_path: Path, monkeypatch
) -> None:
    """``ds/shard-*/x.tar`` beside an unreadable ``ds/private``: fsspec walks every directory
    under ``ds``, but ``private`` can never match, so it neither fails the glob nor is listed;
    a fixed prefix through a regular file still matches nothing, with that message."""
    for part in ("shard-a", "shard-b", "private"):
        (tmp_path / "ds" / part).mkdir(parents=True)
        (tmp_path / "ds" / part / "x.tar").write_bytes(b"\0" * 1024)
    scandir = os.scandir
    private = str(tmp_path / "ds" / "private")

    def guarded(path):
        if os.fspath(path).rstrip("/") == private:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", guarded)
    shards = resolve_source(str(tmp_path / "ds" / "shard-*" / "x.tar")).shards
    assert sorted(s.relpath for s in shards) == ["shard-a/x.tar", "shard-b/x.tar"]
    for pattern in ("*/x.tar", "**/x.tar", "[ps]*/x.tar"):  # these can reach it: refused
        with pytest.raises(SourceError, match="source not readable: .*private"):
            resolve_source(str(tmp_path / "ds" / pattern))
    through_a_file = str(tmp_path / "ds" / "shard-a" / "x.tar" / "sub" / "*.tar")
    with pytest.raises(SourceError, match="no file matches"):
        resolve_source(through_a_file)


_HIDDEN_TREE = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["a", ".h", "._a", "b"]), min_size=0, max_size=3),
        st.sampled_from(["s.tar", ".s.tar", "._s.tar", "u.tar.gz", ".notes", "n.txt"]),
        st.sampled_from(["file", "file", "dir"]),  # (no directory named like a shard: the
        # streamed walk takes one for a shard, unasked, and the stats drop it; noted, left)
    ),
    max_size=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=_HIDDEN_TREE)
def test_every_listing_leaves_hidden_names_out_and_names_them(
    tmp_path_factory: pytest.TempPathFactory, entries: list
) -> None:
    """Hidden names (``.h/``, ``._s.tar``, the AppleDouble files a Mac leaves on a share, which
    are no tars) are left out as the shell leaves them out, the same way by every listing: the
    streamed walk, a directory source, a remote (fsspec) walk and a glob; and each hidden shard
    is named, itself or through its hidden directory, in what the warning names."""
    from stager.layout import is_hidden_name, is_shard_name

    root = tmp_path_factory.mktemp("tree")
    build_tree(root, entries)
    files = [
        os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names
    ]
    shown = sorted(f for f in files if not any(map(is_hidden_name, f.split("/"))))
    shards = [f for f in shown if is_shard_name(f)]
    hidden_shards = [f for f in files if is_shard_name(f) and f not in shown]

    left_out: list[str] = []
    walked = listing.walk_local(str(root), 1, left_out=left_out)
    # (a directory named like a shard is taken here, and dropped by the stats that follow)
    assert [os.path.relpath(p, root) for p in walked if os.path.isfile(p)] == shards
    memory = fsspec.filesystem("memory")
    remote = f"/{root.name}-m"
    for f in files:
        memory.pipe(f"{remote}/{f}", b"x")
    ways = {"walk": left_out}
    for how, spec in (("directory", str(root)), ("remote", f"memory://{remote}")):
        if how == "remote" and not files:
            continue  # (no file: no such directory in a store of objects)
        if not shards:
            with pytest.raises(SourceError, match="no shards"):
                resolve_source(spec)
            continue
        source = resolve_source(spec)
        assert [s.relpath for s in source.shards] == shards, how
        ways[how] = list(source.left_out)
    if shown and not shards:  # (a glob takes the shards a wildcard reaches, as a walk does)
        with pytest.raises(SourceError, match="no shards"):
            resolve_source(f"{root}/**")
    elif shown:
        globbed = resolve_source(f"{root}/**")
        assert sorted(s.relpath for s in globbed.shards) == shards
        assert set(shown) - set(shards) <= {
            n.split(root.name, 1)[1].lstrip("/") for n in globbed.left_out
        }  # (the other files it matched: named in the warning)
        ways["glob"] = list(globbed.left_out)
    for how, named in ways.items():
        tails = [n.split(root.name, 1)[1].lstrip("m-/").lstrip("/") for n in named]
        for f in hidden_shards:
            assert any(f == t or (t.endswith("/") and f.startswith(t)) for t in tails), (how, f)


def test_a_directory_copied_from_a_mac_stages_without_its_appledouble_files(
    tmp_path: Path,
) -> None:
    """``._shard-0.tar`` beside each shard (what a Mac leaves when it copies to a share; no
    tar) failed stage-in with exit 4, and ``.git/`` was walked and its tars staged. Hidden
    names are left out with one warning, by a directory and a glob, the loader reading the
    source sees the same shards, and naming them (a pattern, a list) still stages them."""
    from stager_loaders import ShardedLoader

    src = tmp_path / "ds"
    (src / "sub").mkdir(parents=True)
    (src / ".git").mkdir()
    tar = _one_shard(tmp_path)
    for name in ("a.tar", "sub/d.tar", ".b.tar", ".git/c.tar"):
        (src / name).write_bytes(tar)
    for name in ("._a.tar", "sub/._d.tar"):
        (src / name).write_bytes(b"\x00\x05\x16\x07" + b"\0" * 4000)  # AppleDouble's magic
    for spec, staged in ((str(src), ["a.tar", "sub/d.tar"]), (f"{src}/*.tar", ["a.tar"])):
        dest = tmp_path / f"dst{len(staged)}"
        done = run_cli("stage-in", spec, "--dest", str(dest), "--quiet")
        assert done.returncode == 0, done.stderr
        warnings = [line for line in done.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "hidden (a name starting with '.'" in warnings[0], done.stderr
        assert "._a.tar' and " in warnings[0]
        found = sorted(str(p.relative_to(dest / "ds")) for p in (dest / "ds").rglob("*.tar"))
        assert found == staged
    loader = ShardedLoader(str(src), batch_size=1, shuffle=False)
    assert len(list(loader)) == 2 * 2  # a.tar and sub/d.tar, two samples each

    # A dotted pattern part names hidden names at its own depth only, as the shell does
    (src / ".git" / "._c.tar").write_bytes(b"\x00\x05\x16\x07" + b"\0" * 4000)
    dotted = resolve_source(f"{src}/.*/*.tar")
    assert [s.relpath for s in dotted.shards] == [".git/c.tar"]
    # A dotted pattern part names hidden names at its own depth only, as the shell does
    (src / ".git" / "._c.tar").write_bytes(b"\x00\x05\x16\x07" + b"\0" * 4000)
    dotted = resolve_source(f"{src}/.*/*.tar")
    assert [s.relpath for s in dotted.shards] == [".git/c.tar"]
    named = tmp_path / "named"
    done = run_cli("stage-in", f"{src}/.b.tar", "--dest", str(named), "--quiet")
    assert done.returncode == 0, done.stderr
    listed = tmp_path / "list.txt"
    listed.write_text(f"{src}/a.tar\n{src}/.git/c.tar\n")
    done = run_cli("stage-in", "--from-list", str(listed), "--name", "l", "--dest", str(named))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (named / "l").rglob("*.tar")) == ["a.tar", "c.tar"]

    # A manifest written before walks left hidden names out lists .b.tar: not "missing"
    from stager.shards.build import build_manifest, write_manifest

    named_all = resolve_source(
        [str(src / "a.tar"), str(src / "sub" / "d.tar"), str(src / ".b.tar")]
    )
    write_manifest(build_manifest(named_all), str(src / "stager-manifest.json"))
    done = run_cli("stage-in", str(src), "--dest", str(tmp_path / "m"), "--quiet")
    assert done.returncode == 0, done.stderr
    assert (
        "'.b.tar' and 0 more" not in done.stderr
        and "listed in the manifest but hidden" in done.stderr
    )
    (src / "stager-manifest.json").unlink()

    only = tmp_path / "only"
    (only / ".cache").mkdir(parents=True)
    (only / ".cache" / "x.tar").write_bytes(tar)
    for spec, expected in (
        (str(only), "but hidden ones ('.cache/x.tar'"),
        (f"{only}/*/*.tar", "only hidden names match it"),
    ):
        done = run_cli("stage-in", spec, "--dest", str(tmp_path / "o"), "--quiet")
        assert done.returncode == 3, done.stderr
        assert expected in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_directory_named_like_a_shard_is_named_in_a_warning(tmp_path: Path) -> None:
    """``train.tar/`` holding shards: a walk takes the name for a shard without asking (a stat
    per shard is a round trip on NFS), and the stats find a directory. It was dropped without
    a word, its shards with it; every way of walking now names it, and a source with nothing
    else fails (exit 3) saying what it may be."""
    src = tmp_path / "ds"
    (src / "train.tar").mkdir(parents=True)
    tar = _one_shard(tmp_path)
    (src / "a.tar").write_bytes(tar)
    (src / "train.tar" / "s.tar").write_bytes(tar)
    source = resolve_source(str(src))
    assert [s.relpath for s in source.shards] == ["a.tar"]
    assert source.left_out == (f"{src}/train.tar/",)
    dest = tmp_path / "dst"
    for how in ("streamed first run", "listed again"):
        done = run_cli("stage-in", str(src), "--dest", str(dest), "--quiet")
        assert done.returncode == 0, (how, done.stderr)
        assert "train.tar/', directories named like shards" in done.stderr, (how, done.stderr)
    assert sorted(p.name for p in (dest / "ds").rglob("*.tar")) == ["a.tar"]
    (src / "a.tar").unlink()
    done = run_cli("stage-in", str(src), "--dest", str(tmp_path / "d2"), "--quiet")
    assert done.returncode == 3, done.stderr
    assert "or a directory named like a shard?)" in done.stderr.splitlines()[-1]
