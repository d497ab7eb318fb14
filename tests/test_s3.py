"""Object storage for real: stage-in and index against moto's S3 server on loopback, via s3fs.

The server runs in its own process (tests/s3server.py) and stage-in runs as its console
script, finding the server through ``AWS_ENDPOINT_URL``; boto3 is used only to upload and
tamper with objects, over HTTP too.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

from stager.errors import EXIT_DEST, EXIT_INTEGRITY, EXIT_SOURCE, EXIT_USAGE
from stager.layout import StagedDataset
from stager.shards.build import build_manifest
from stager.shards.manifest import Manifest
from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager.storage.hashing import hash_file
from stager.storage.sources import resolve_source

from .conftest import clean_env, run_cli
from .s3server import FlakyProxy, hooked_proxy, moto_server, refusing_proxy, s3_client, s3_env

pytestmark = pytest.mark.s3

BUCKET = "stager-test"
FAST = ["--jitter-max", "0", "--retry-delay", "0.05", "--quiet"]


@pytest.fixture(scope="module")
def endpoint() -> str:
    with moto_server() as url:
        client = s3_client(url)
        client.create_bucket(Bucket=BUCKET)
        client.close()
        yield url


@pytest.fixture(scope="module")
def local_ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("s3src") / "ds"
    write_synthetic_dataset(
        root, SyntheticSpec(num_shards=5, samples_per_shard=8, image_bytes=3000, uneven=True)
    )
    return root


@pytest.fixture()
def prefix(endpoint: str, local_ds: Path) -> str:
    """A fresh prefix holding the dataset's shards: ``<uuid>/ds``."""
    key_prefix = f"{uuid.uuid4().hex[:8]}/ds"
    client = s3_client(endpoint)
    for path in sorted(local_ds.glob("*.tar")):
        client.upload_file(str(path), BUCKET, f"{key_prefix}/{path.name}")
    client.close()
    return key_prefix


def _env(endpoint: str) -> dict[str, str]:
    return clean_env(**s3_env(endpoint))


def _assert_staged(local_ds: Path, staged: Path, names: list[str]) -> None:
    assert sorted(p.name for p in staged.glob("*.tar")) == sorted(names)
    for name in names:
        assert filecmp.cmp(local_ds / name, staged / name, shallow=False), name
    assert not list(staged.rglob("*.partial"))


def test_stage_in_a_prefix_directory(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    report = tmp_path / "r.json"
    result = run_cli(
        "stage-in",
        f"s3://{BUCKET}/{prefix}/",
        "--dest",
        str(tmp_path),
        "--report",
        str(report),
        *FAST,
        env=_env(endpoint),
    )
    assert result.returncode == 0, result.stderr
    names = [p.name for p in sorted(local_ds.glob("*.tar"))]
    _assert_staged(local_ds, tmp_path / "ds", names)
    staged = Manifest.read(StagedDataset.of(tmp_path / "ds").manifest_path)
    assert [e.hash for e in staged.entries] == [hash_file(local_ds / n) for n in names]
    assert json.loads(report.read_text())["bytes_read_source"] == sum(
        (local_ds / n).stat().st_size for n in names
    )


def test_hidden_keys_under_a_prefix_are_left_out_as_a_local_walk_leaves_them(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    """``._x.tar`` (AppleDouble, no tar) and ``.cache/`` under a prefix: left out with one
    warning, as from a local directory, where they failed the run (exit 4)."""
    client = s3_client(endpoint)
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/._train-000000.tar", Body=b"\0\5\26\7" * 9)
    first = sorted(local_ds.glob("*.tar"))[0]
    client.upload_file(str(first), BUCKET, f"{prefix}/.cache/old.tar")
    client.close()
    for spec in (f"s3://{BUCKET}/{prefix}/", f"s3://{BUCKET}/{prefix}/*.tar"):
        dest = tmp_path / spec[-4:].strip("/*.")
        result = run_cli("stage-in", spec, "--dest", str(dest), *FAST, env=_env(endpoint))
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "hidden (a name starting with '.'" in warnings[0]
        names = [p.name for p in sorted(local_ds.glob("*.tar"))]
        _assert_staged(local_ds, dest / "ds", names)
        assert not (dest / "ds" / ".cache").exists()


def test_stage_in_a_brace_pattern(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    pattern = f"s3://{BUCKET}/{prefix}/train-{{000001..000003}}.tar"
    result = run_cli("stage-in", pattern, "--dest", str(tmp_path), *FAST, env=_env(endpoint))
    assert result.returncode == 0, result.stderr
    _assert_staged(local_ds, tmp_path / "ds", [f"train-{i:06d}.tar" for i in (1, 2, 3)])


def test_index_on_s3_then_stage_in_verifies_against_it(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    env = _env(endpoint)
    result = run_cli("stager", "index", f"s3://{BUCKET}/{prefix}/", env=env)
    assert result.returncode == 0, result.stderr
    body = (
        s3_client(endpoint)
        .get_object(Bucket=BUCKET, Key=f"{prefix}/stager-manifest.json")["Body"]
        .read()
    )
    remote = tmp_path / "remote.json"
    remote.write_bytes(body)
    indexed = Manifest.read(remote)
    assert (
        indexed.entries == build_manifest(resolve_source(str(local_ds))).entries
    )  # same as a local scan

    # The manifest beside the prefix is found; --no-count: sample counts come from it.
    dest = tmp_path / "a"
    result = run_cli(
        "stage-in", f"s3://{BUCKET}/{prefix}/", "--dest", str(dest), "--no-count", *FAST, env=env
    )
    assert result.returncode == 0, result.stderr
    staged = Manifest.read(StagedDataset.of(dest / "ds").manifest_path).entries
    assert all(e.version and "ETag" in e.version for e in staged)  # the object's, as listed
    assert [dataclasses.replace(e, version=None) for e in staged] == list(indexed.entries)

    # Same bytes count, different content: only the manifest's hash can catch it.
    tampered = bytearray((local_ds / "train-000004.tar").read_bytes())
    tampered[2000] ^= 0x55
    s3_client(endpoint).put_object(
        Bucket=BUCKET, Key=f"{prefix}/train-000004.tar", Body=bytes(tampered)
    )
    dest = tmp_path / "b"
    pattern = f"s3://{BUCKET}/{prefix}/train-{{000000..000004}}.tar"
    manifest_url = f"s3://{BUCKET}/{prefix}/stager-manifest.json"
    result = run_cli(
        "stage-in", pattern, "--dest", str(dest), "--manifest", manifest_url, *FAST, env=env
    )
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and f"s3://{BUCKET}/{prefix}/train-000004.tar" in failed[0]
    assert "does not match the manifest" in failed[0]
    _assert_staged(local_ds, dest / "ds", [f"train-{i:06d}.tar" for i in range(4)])


def test_missing_prefix_is_a_source_error(endpoint: str, tmp_path: Path) -> None:
    result = run_cli(
        "stage-in",
        f"s3://{BUCKET}/no-such-prefix/",
        "--dest",
        str(tmp_path),
        *FAST,
        env=_env(endpoint),
    )
    assert result.returncode == EXIT_SOURCE
    assert "no-such-prefix" in result.stderr and "Traceback" not in result.stderr
    assert "check the URL (the bucket and prefix)" in result.stderr  # (not "is it mounted?")


def test_a_server_that_drops_connections_mid_response_is_retried(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    port = int(endpoint.rsplit(":", 1)[1])
    with FlakyProxy(port, every=3, cut_bytes=1500) as proxy:
        report = tmp_path / "r.json"
        result = run_cli(
            "stage-in",
            f"s3://{BUCKET}/{prefix}/",
            "--dest",
            str(tmp_path),
            "--report",
            str(report),
            "--jobs",
            "2",
            *FAST,
            env=_env(proxy.url),
        )
        assert proxy.cuts >= 2, "the proxy should have cut some responses"
    assert result.returncode == 0, result.stderr
    _assert_staged(local_ds, tmp_path / "ds", [p.name for p in sorted(local_ds.glob("*.tar"))])


def test_a_manifest_beside_the_source_that_cannot_be_read_stops_the_run(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    """A store that throttles the manifest's read (503 SlowDown) while serving the shards: the
    run went on without it, unverified, exit 0 and no word, staging a shard the manifest's hash
    refuses. Only a manifest that is not there lets a run go on without one; a ``--manifest``
    URL that is not there is one line (exit 2), as a local path's is, not a traceback."""
    env = _env(endpoint)
    indexed = run_cli("stager", "index", f"s3://{BUCKET}/{prefix}/", env=env)
    assert indexed.returncode == 0, indexed.stderr
    tampered = bytearray((local_ds / "train-000001.tar").read_bytes())
    tampered[2000] ^= 0x55  # same size, other bytes: only the manifest's hash tells
    s3_client(endpoint).put_object(
        Bucket=BUCKET, Key=f"{prefix}/train-000001.tar", Body=bytes(tampered)
    )
    source = f"s3://{BUCKET}/{prefix}/"
    with refusing_proxy(endpoint, "stager-manifest.json") as proxy:
        result = run_cli("stage-in", source, "--dest", str(tmp_path / "a"), *FAST, env=_env(proxy))
    assert result.returncode == EXIT_SOURCE, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"stage-in: error: cannot read the manifest {source}stager-manifest.json: [Errno 16] "
        "Please reduce your request rate.; stage-in verifies against it, so it does not go on "
        "without it: retry, or pass another with --manifest"
    ]
    assert not list((tmp_path / "a").rglob("*.tar*"))
    result = run_cli("stage-in", source, "--dest", str(tmp_path / "b"), *FAST, env=env)
    assert result.returncode == EXIT_INTEGRITY, result.stderr  # read: the shard is refused
    missing = f"s3://{BUCKET}/{prefix}/nope.json"
    result = run_cli(
        "stage-in", source, "--dest", str(tmp_path / "c"), "--manifest", missing, *FAST, env=env
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert result.stderr.strip() == f"stage-in: error: manifest not found: {missing}"


def test_keys_that_would_land_on_one_path_are_refused_naming_both(
    endpoint: str, local_ds: Path, tmp_path: Path
) -> None:
    """``x//y.tar`` and ``x/y.tar`` are two objects: both were copied into one ``.partial``,
    one failed with a rename error on every run, and the staged manifest listed ``x/y.tar``
    twice with the other's hash. Refused before any byte moves: the key with an empty part by
    its name (alone, it was staged as ``x/y.tar``, and the loader's fallback read the other)."""
    key_prefix = f"{uuid.uuid4().hex[:8]}/kc"
    client = s3_client(endpoint)
    for key in ("x//y.tar", "x/y.tar"):
        client.upload_file(str(sorted(local_ds.glob("*.tar"))[0]), BUCKET, f"{key_prefix}/{key}")
    client.close()
    spec = f"s3://{BUCKET}/{key_prefix}"
    result = run_cli("stage-in", spec, "--dest", str(tmp_path), *FAST, env=_env(endpoint))
    # (x//y.tar alone was staged as x/y.tar, where the loader's fallback read the other key:
    # a key with an empty part is refused by name, as one with a '.' part)
    assert result.returncode == EXIT_DEST, result.stderr
    assert "x//y.tar' has an empty, '.' or '..' part" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.rglob("*.tar*"))
    # a key naming a file that another key needs as a directory: retried as "changing" before
    client = s3_client(endpoint)
    shard = str(sorted(local_ds.glob("*.tar"))[0])
    for key in ("sub.tar", "sub.tar/in.tar"):
        client.upload_file(shard, BUCKET, f"{key_prefix}-kd/{key}")
    client.close()
    spec = f"s3://{BUCKET}/{key_prefix}-kd"
    result = run_cli("stage-in", spec, "--dest", str(tmp_path), *FAST, env=_env(endpoint))
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "'sub.tar' would be a file and a directory" in result.stderr, result.stderr
    # a key with a '.' or '..' part, named in a list (a walk leaves it out as hidden): staged as
    # a/b.tar or b.tar before, where the loader's source fallback read another key (or none)
    client = s3_client(endpoint)
    for key in ("a/../b.tar", "a/./d.tar", "a//e.tar", "c.tar"):
        client.upload_file(shard, BUCKET, f"{key_prefix}-kp/{key}")
    client.close()
    spec = f"s3://{BUCKET}/{key_prefix}-kp"
    for odd in ("a/../b.tar", "a/./d.tar", "a//e.tar"):
        listed = tmp_path / "list.txt"
        listed.write_text(f"{spec}/{odd}\n{spec}/c.tar\n")
        argv = ["--from-list", str(listed), "--dest", str(tmp_path / "p"), *FAST]
        result = run_cli("stage-in", *argv, env=_env(endpoint))
        assert result.returncode == EXIT_DEST, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"stage-in: error: key '{spec}/{odd}' has an empty, '.' or '..' part and cannot be "
            "staged under its own name; rename it, or stage it as a separate dataset"
        ]
        assert not list((tmp_path / "p").rglob("*.tar*"))


def test_the_loader_finds_a_prefix_staged_with_its_slash_by_either_spelling(
    endpoint: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged as ``s3://b/ds/`` (the directory form the docs give), the loader refused
    ``s3://b/ds/`` as "a staged copy of another dataset" and took only ``s3://b/ds``."""
    from stager_loaders import LoaderOptions, ShardedLoader

    source = f"s3://{BUCKET}/{prefix}/"
    result = run_cli("stage-in", source, "--dest", str(tmp_path), *FAST, env=_env(endpoint))
    assert result.returncode == 0, result.stderr
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    for spec in (source, source.rstrip("/")):
        loader = ShardedLoader(spec, batch_size=4, options=LoaderOptions(dest=str(tmp_path)))
        assert loader.shards.from_source == 0 and len(loader) > 0, spec


def test_the_loader_takes_a_remote_sources_counts_from_its_manifest(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed from the store (nothing staged), each shard's samples were counted by reading
    it whole, on every rank, although ``stager index`` had written their counts beside it."""
    from stager_loaders import LoaderOptions, ShardedLoader

    source = f"s3://{BUCKET}/{prefix}"
    indexed = run_cli("stager", "index", source, env=_env(endpoint))
    assert indexed.returncode == 0, indexed.stderr
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    loader = ShardedLoader(source, batch_size=4, options=LoaderOptions(dest=str(tmp_path)))
    counts = {e.relpath: e.samples for e in build_manifest(resolve_source(str(local_ds))).entries}
    assert dict(zip(loader.shards.relpaths, loader.shards.samples, strict=True)) == counts
    assert loader.shards.from_source == len(counts)


def test_an_object_rewritten_after_its_listing_is_read_as_it_is_now(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec keeps one filesystem per process with its listings, and s3fs reads an object on
    the ETag listed: once rewritten, the object could not be read again in that process. A
    second loader called the shard corrupt (or, skipping, trained without it), and a retry of
    stage-in's copy expected the old size and read on the old ETag, so none could succeed."""
    from stager.stagein.oneshard import relisted
    from stager.stagein.plan import CopyItem
    from stager_loaders import LoaderOptions, ShardedLoader

    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    source = f"s3://{BUCKET}/{prefix}"
    options = LoaderOptions(dest=str(tmp_path), on_error="skip")
    first = ShardedLoader(source, batch_size=4, to_tuple=("__key__",), options=options)
    shards = sorted(local_ds.glob("*.tar"))
    # the first shard's object now holds the second's bytes: another size, another ETag
    s3_client(endpoint).upload_file(str(shards[1]), BUCKET, f"{prefix}/{shards[0].name}")
    second = ShardedLoader(source, batch_size=4, to_tuple=("__key__",), options=options)
    assert second.skipped_shards == [] and len(second) > 0
    keys = [k for (batch,) in second for k in batch]
    assert len(keys) >= len(first.shards.relpaths)  # read, not left out as corrupt

    listed = resolve_source(f"{source}/{shards[2].name}").shards[0]
    item = CopyItem(listed, str(tmp_path / "x.tar"), listed.size, None, False)
    other = next(s for s in shards if s.stat().st_size != item.size)
    s3_client(endpoint).upload_file(str(other), BUCKET, f"{prefix}/{shards[2].name}")
    now = relisted(resolve_source(source), item)
    assert now.size == other.stat().st_size != item.size
    assert now.shard.version != item.shard.version and now.shard.path == item.shard.path


def test_named_shards_on_an_unreachable_store_are_one_line_and_exit_3(tmp_path: Path) -> None:
    """A prefix, a glob and a key said so; a brace pattern and a list of URLs, whose shards are
    stat'ed one by one, ended in botocore's traceback (exit 1)."""
    from .s3server import free_port

    env = clean_env(**s3_env(f"http://127.0.0.1:{free_port()}"))  # (nothing listens there)
    env["AWS_MAX_ATTEMPTS"] = "1"
    listed = tmp_path / "shards.txt"
    listed.write_text("s3://away/ds/s0.tar\ns3://away/ds/s1.tar\n")
    for argv in (("s3://away/ds/s{0..1}.tar",), ("--from-list", str(listed))):
        done = run_cli("stage-in", *argv, "--dest", str(tmp_path / "d"), env=env, timeout=240)
        assert done.returncode == EXIT_SOURCE, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_list_over_two_buckets_is_loaded_from_its_staged_copy(
    endpoint: str, local_ds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staged, its manifest recorded the root s3:/// where the loader named it s3://, and
    refused its own copy as another dataset's (LoaderOptions(name=...) did not help)."""
    from stager_loaders import LoaderOptions, ShardedLoader

    other = f"stager-second-{uuid.uuid4().hex[:6]}"
    client = s3_client(endpoint)
    client.create_bucket(Bucket=other)
    shards = sorted(local_ds.glob("*.tar"))[:2]
    client.upload_file(str(shards[0]), BUCKET, f"two/{shards[0].name}")
    client.upload_file(str(shards[1]), other, f"two/{shards[1].name}")
    client.close()
    urls = [f"s3://{BUCKET}/two/{shards[0].name}", f"s3://{other}/two/{shards[1].name}"]
    listed = tmp_path / "shards.txt"
    listed.write_text("\n".join(urls) + "\n")
    dest = tmp_path / "scratch"
    argv = ("--from-list", str(listed), "--dest", str(dest), "--name", "two", *FAST)
    result = run_cli("stage-in", *argv, env=_env(endpoint))
    assert result.returncode == 0, result.stderr
    for key, value in s3_env(endpoint).items():
        monkeypatch.setenv(key, value)
    options = LoaderOptions(dest=str(dest), name="two", world_size=1)
    loader = ShardedLoader(urls, batch_size=4, options=options)
    assert loader.shards.from_source == 0 and len(loader.shards) == 2


def test_a_key_that_is_also_a_prefix_stages_the_prefix(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    """An object ``ds`` beside the keys under ``ds/`` (a marker some tools write): ``s3://b/ds``
    and even ``s3://b/ds/`` staged that object alone, "as it is" (11 bytes, no tar), exit 0,
    leaving the dataset out without a word, and the loader refused the copy."""
    s3_client(endpoint).put_object(Bucket=BUCKET, Key=prefix, Body=b"not a shard")
    names = [p.name for p in sorted(local_ds.glob("*.tar"))]
    for spec in (f"s3://{BUCKET}/{prefix}", f"s3://{BUCKET}/{prefix}/"):
        dest = tmp_path / ("slash" if spec.endswith("/") else "plain")
        result = run_cli("stage-in", spec, "--dest", str(dest), *FAST, env=_env(endpoint))
        assert result.returncode == 0, result.stderr
        _assert_staged(local_ds, dest / "ds", names)
        assert sorted(p.name for p in (dest / "ds").iterdir() if p.is_file()) == names
    env = _env(endpoint)
    code = (
        "import sys\n"
        "from stager_loaders import LoaderOptions, ShardedLoader\n"
        "options = LoaderOptions(dest=sys.argv[2], world_size=1)\n"
        "loader = ShardedLoader(sys.argv[1], batch_size=4, options=options)\n"
        "print(loader.shards.from_source, len(loader.shards))\n"
    )
    spec = f"s3://{BUCKET}/{prefix}"
    done = subprocess.run(
        [sys.executable, "-c", code, spec, str(tmp_path / "plain")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", str(len(names))]  # (it refused the copy before)


def test_an_object_rewritten_after_its_listing_is_copied_with_a_cache_too(
    endpoint: str, prefix: str, local_ds: Path, tmp_path: Path
) -> None:
    """With ``--cache`` a retry kept the claim made for the version listed, and s3fs read the
    object on that ETag, which the store refuses once the object is rewritten: every retry
    failed the same way, exit 3, where without a cache the retry reads it as it is now."""
    shard = sorted(local_ds.glob("*.tar"))[2]
    key = f"{prefix}/{shard.name}"
    with tarfile.open(shard) as tar:
        member = max(tar.getmembers(), key=lambda m: m.size)
    tampered = bytearray(shard.read_bytes())
    tampered[member.offset_data + member.size // 2] ^= 0x55  # (a valid tar, other bytes)
    client = s3_client(endpoint)
    rewritten: list[str] = []

    def rewrite_on_first_read(method: str, path: str) -> None:
        if method == "GET" and path.endswith(key) and not rewritten:
            rewritten.append(path)  # (after the listing, before the copy's first read)
            client.put_object(Bucket=BUCKET, Key=key, Body=bytes(tampered))
        return None

    with hooked_proxy(endpoint, rewrite_on_first_read) as url:
        argv = ["--dest", str(tmp_path / "d"), "--cache", str(tmp_path / "cache"), *FAST]
        result = run_cli("stage-in", f"s3://{BUCKET}/{prefix}", *argv, env=_env(url))
    assert rewritten, "the copy never read the object"
    assert result.returncode == 0, result.stderr
    staged = tmp_path / "d" / "ds"
    assert (staged / shard.name).read_bytes() == bytes(tampered)  # the store's bytes now
    # Copied past the cache: filled under the key its listing made (of the old version), the
    # cache held the new bytes where that key says the old ones.
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not [p for p in cached if p.read_bytes() == bytes(tampered)], cached
    others = [p.name for p in sorted(local_ds.glob("*.tar")) if p.name != shard.name]
    for name in others:
        assert filecmp.cmp(local_ds / name, staged / name, shallow=False), name
    assert not list(tmp_path.rglob("*.partial"))


def test_a_shard_the_store_refuses_is_the_sources_failure_for_the_loader(
    endpoint: str, prefix: str, tmp_path: Path
) -> None:
    """A store refusing one object's reads (403 AccessDenied; 503 SlowDown the same) while it
    lists and HEADs it: the loader called the shard corrupt ("re-create this shard"), and with
    ``on_error='skip'`` left it out and trained without it, where a shard the process may not
    read raises SourceError, with "skip" too (docs/loader.md)."""
    victim = f"{prefix}/train-000001.tar"

    def refuse(method: str, path: str) -> tuple[int, str, str] | None:
        if method == "GET" and path.endswith(victim):
            return 403, "AccessDenied", "Access Denied"
        return None

    code = (
        "import sys\n"
        "from stager.errors import IntegrityError, SourceError\n"
        "from stager_loaders import LoaderOptions, ShardedLoader\n"
        "options = LoaderOptions(dest=sys.argv[2], world_size=1, on_error=sys.argv[3])\n"
        "try:\n"
        "    loader = ShardedLoader(sys.argv[1], batch_size=4, options=options)\n"
        "    print('read', sum(1 for _ in loader), loader.skipped_shards)\n"
        "except (SourceError, IntegrityError) as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    with hooked_proxy(endpoint, refuse) as url:
        env = clean_env(**s3_env(url))
        env["AWS_MAX_ATTEMPTS"] = "1"
        for on_error in ("raise", "skip"):
            done = subprocess.run(
                [sys.executable, "-c", code, f"s3://{BUCKET}/{prefix}", str(tmp_path), on_error],
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert done.returncode == 0, done.stderr
            out = done.stdout.strip()
            assert out.startswith("SourceError cannot read shard"), (on_error, out)
            assert victim in out and "Access Denied" in out and "\n" not in out
