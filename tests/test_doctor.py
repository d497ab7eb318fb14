"""``stager doctor``: the user's real per-sample cost (decode, map), advice that follows from it,
each warning once, and one statement about staging, never two that contradict."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stager.storage.probe import ScratchProbe, SourceProbe
from stager_loaders.doctor import Diagnosis, LoaderProbe, _verdict
from stager_loaders.doctor_cli import default_workers

from .conftest import BIN, REPO, clean_env
from .imagedata import write_image_dataset


def tag_map(sample: dict[str, Any]) -> dict[str, Any]:
    """A user's map: adds a member, as a training script's augmentation would."""
    sample["tagged"] = 1
    return sample


@pytest.fixture(scope="module")
def jpg_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("doctor") / "jpgs"
    write_image_dataset(root, num_samples=200, max_shard_bytes=40_000)
    return root


def _doctor(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "stager"), "doctor", *argv],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def test_doctor_measures_the_decode_and_map_the_training_script_uses(
    jpg_dataset: Path, tmp_path: Path
) -> None:
    out = tmp_path / "d.json"
    result = _doctor(
        str(jpg_dataset),
        "--dest", str(tmp_path / "scratch"),
        "--decode", "rgb8",
        "--map", "tests.test_doctor:tag_map",
        "--to-tuple", "jpg,cls",
        "--workers", "0,1",
        "--loader-seconds", "0.3",
        "--max-source", "1M",
        "--scratch-bytes", "1M",
        "--target", "5000",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = result.stdout
    loader_line = next(line for line in text.splitlines() if line.strip().startswith("loader"))
    assert "decode rgb8 + map tag_map" in loader_line
    assert "0 workers" in loader_line and "1 worker " in loader_line
    assert " ranks" not in text and "1 workers" not in text
    verdict = text.split("verdict:", 1)[1]
    assert "num_workers=" in verdict and "--cpus-per-task=" in verdict
    assert "to feed 5,000 samples/s per rank" in verdict
    staging = [line for line in verdict.splitlines() if "staging" in line]
    assert len(staging) == 1, verdict  # one statement about staging, never two that disagree
    # Not staged yet: the loader reads the source, and says so once, not once per worker count.
    assert result.stderr.count("no staged copy") == 1, result.stderr
    report = json.loads(out.read_text())
    assert report["loader"]["ms_per_sample"] > 0 and report["loader"]["best_workers"] in (0, 1)
    assert report["loader"]["num_samples"] == 200


def test_a_map_that_cannot_be_imported_is_one_usage_line(jpg_dataset: Path) -> None:
    result = _doctor(str(jpg_dataset), "--map", "nowhere:nothing", "--no-loader")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--map" in result.stderr


def test_samples_that_do_not_fit_decode_or_to_tuple_are_one_usage_line(tmp_path: Path) -> None:
    """A member named in --to-tuple that no sample has, or a .jpg that is no image under
    --decode rgb8 (a user's data as it often is): a traceback and exit 1, "a bug", where a
    corrupt tar already got one line. Now one line naming the options, exit 2."""
    import io
    import tarfile

    ds = tmp_path / "ds"
    ds.mkdir()
    with tarfile.open(ds / "a.tar", "w") as tar:
        for name, data in (("0.jpg", b"not an image"), ("0.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    for flags, says in (
        (["--to-tuple", "png,cls"], "has none of 'png'"),
        (["--decode", "rgb8"], "cannot decode member 'jpg'"),
    ):
        result = _doctor(str(ds), *flags, "--workers", "0", "--loader-seconds", "1")
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and says in errors[0], result.stderr
        assert "Traceback" not in result.stderr


def _diagnosis(source_mbps: float, loader_rate: float, dataset_bytes: int = 10**9) -> Diagnosis:
    return Diagnosis(
        node="n1",
        dataset_bytes=dataset_bytes,
        source=SourceProbe(
            files=4, bytes_read=int(source_mbps * 1e6), seconds=1.0, streams=8, first_byte_ms=1.0
        ),
        scratch=ScratchProbe(
            path="/scratch", bytes_written=2 * 10**9, seconds=1.0, free_bytes=10**12
        ),
        loader=LoaderProbe(
            {0: loader_rate / 2, 1: loader_rate}, 150_000.0, "rgb8", num_samples=10**5
        ),
        cpus=8,
    )


def test_the_staging_verdict_follows_from_the_rates() -> None:
    # 10 KB per stored sample; a loader at 20k samples/s pulls 200 MB/s; the source gives 50.
    slow_source = _verdict(_diagnosis(50.0, 20_000.0), epochs=10, nodes=1, target=None)
    (line,) = [v for v in slow_source if "staging" in v]
    assert "pays off after" in line and "20.0 s" in line  # 1 GB at 50 MB/s, staged once
    fast_source = _verdict(_diagnosis(5_000.0, 20_000.0), epochs=10, nodes=1, target=None)
    (line,) = [v for v in fast_source if "staging" in v]
    assert "keeps up" in line and "pays off" not in line


def test_worker_advice_follows_from_the_measured_rates() -> None:
    verdict = _verdict(_diagnosis(50.0, 1_000.0), epochs=1, nodes=1, target=3_000.0)
    assert any("num_workers=1, --cpus-per-task=2 per rank" in v for v in verdict)
    assert any(
        "to feed 3,000 samples/s per rank: num_workers=3, --cpus-per-task=4" in v for v in verdict
    )


def test_default_worker_counts_follow_the_cpus() -> None:
    assert default_workers(1) == [0, 1]
    assert default_workers(2) == [0, 1]
    assert default_workers(16) == [0, 1, 2, 4, 8]


def test_a_missing_compiled_tar_walk_is_said_and_a_built_one_is_not() -> None:
    built = _diagnosis(500.0, 20_000.0)
    assert not [v for v in _verdict(built, epochs=1, nodes=1, target=None) if "tar walk" in v]
    assert "indexes shards with the compiled tar walk" in built.render()
    missing = dataclasses.replace(built, compiled_tar_walk=False)
    (line,) = [v for v in _verdict(missing, epochs=1, nodes=1, target=None) if "tar walk" in v]
    assert "numpy scanner" in line and "C compiler" in line
    assert "numpy scanner (no compiled walk)" in missing.render()


@pytest.mark.parametrize(
    ("field", "topic", "switch", "rendered"),
    [
        ("compiled_stat_runs", "os.stat", "STAGER_NATIVE_STAT=0", "os.stat (no compiled runs)"),
        (
            "compiled_byte_pump",
            "byte pump",
            "STAGER_NATIVE_COPY=0",
            "copies local shards in Python (no compiled pump)",
        ),
    ],
)
def test_a_missing_compiled_helper_is_said_and_a_built_one_is_not(
    field: str, topic: str, switch: str, rendered: str
) -> None:
    built = _diagnosis(500.0, 20_000.0)
    assert not [v for v in _verdict(built, epochs=1, nodes=1, target=None) if topic in v]
    assert rendered not in built.render()
    missing = dataclasses.replace(built, **{field: False})
    (line,) = [v for v in _verdict(missing, epochs=1, nodes=1, target=None) if topic in v]
    assert switch in line and "C compiler" in line
    assert rendered in missing.render()


def test_a_shard_its_user_cannot_read_is_a_source_error_not_a_corrupt_tar(tmp_path: Path) -> None:
    """Run as a user is (root without its permission override): a shard of mode 000 was "not a
    readable tar ... re-create this shard" (IntegrityError, exit 4), or with ``--no-loader`` a
    traceback of the source probe (exit 1), where stage-in and
    ``stager index`` say "not readable (permission denied)", exit 3; the loader raised the same
    IntegrityError, and ``on_error="skip"`` dropped the shard as corrupt."""
    import os
    import shutil

    from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without the permission override")
    as_a_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
    src = tmp_path / "ds"
    write_synthetic_dataset(src, SyntheticSpec(num_shards=2, samples_per_shard=3))
    shard = sorted(src.glob("*.tar"))[1]
    shard.chmod(0)
    argv = [*as_a_user, str(BIN / "stager"), "doctor", str(src), "--dest", str(tmp_path / "s")]
    for extra in ([], ["--no-loader"]):  # the source probe's read was a traceback, exit 1
        result = subprocess.run(
            argv + extra, env=clean_env(), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 3, result.stderr
        assert "Traceback" not in result.stderr
        assert f"{shard}: not readable (permission denied)" in result.stderr.splitlines()[-1]


def test_worker_advice_for_a_rate_already_reached_names_the_workers_that_reached_it() -> None:
    """0 workers measured at 6,000 samples/s against a target of 2,000: the first line said
    num_workers=0, the next "to feed 2,000 samples/s per rank: num_workers=1"."""
    verdict = _verdict(_diagnosis(50.0, 6_000.0), epochs=1, nodes=1, target=2_000.0)
    (line,) = [v for v in verdict if "to feed" in v]
    assert "num_workers=0 is enough (measured 3,000/s), --cpus-per-task=1" in line, line
    verdict = _verdict(_diagnosis(50.0, 6_000.0), epochs=1, nodes=1, target=5_000.0)
    (line,) = [v for v in verdict if "to feed" in v]
    assert "num_workers=1 is enough (measured 6,000/s)" in line, line
