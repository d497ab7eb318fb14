"""The compiled helpers are optional at install time: without a C compiler the package still
builds and installs, stage-in's indexing falls back to the numpy scanner (which
tests/test_tarcount.py and tests/test_tarscan.py hold to tarfile's answer), its size probe
to ``os.stat`` (tests/test_statmany.py holds both to the same answers), and its copies to the
Python byte path (tests/test_copy_paths.py runs every path)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stager.shards import tarnative
from stager.storage import bytepath, statmany

from .conftest import REPO, clean_env

_FALLBACK_CHECK = """
import io, tarfile
import stager.shards.tarnative as tarnative
import stager.storage.statmany as statmany
import stager.storage.bytepath as bytepath
from stager.shards.tarparse import TarSampleCounter
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w") as tar:
    for name in ("a.jpg", "a.cls", "b.jpg"):
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
data = buf.getvalue()
counter = TarSampleCounter()
counter.feed(data)
counter.finish(lambda offset, nbytes: data[offset : offset + nbytes])
rows, _ = statmany.stat_many([tarnative.__file__, tarnative.__file__ + "-gone"], 60.0)
print(tarnative.__file__, tarnative.available(), counter.samples, statmany.available(), rows[1],
      bytepath.available())
"""


def test_the_compiled_helpers_are_built_here() -> None:
    """The test run's own install has them (scripts/test.sh also sets STAGER_NATIVE_TAR=1 and
    STAGER_NATIVE_STAT=1)."""
    assert tarnative.available(), "stager/shards/_tarwalk.c was not built: pip install -e ."
    assert statmany.available(), "stager/storage/_statmany.c was not built: pip install -e ."
    assert bytepath.available(), "stager/storage/_bytepump.c was not built: pip install -e ."


@pytest.mark.timeout(600)
def test_without_a_c_compiler_the_package_builds_and_falls_back(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("stager", "loaders"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("*.so"))
    env = clean_env(CC="/bin/false")  # (without STAGER_NATIVE_*=1, which would refuse)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "wheel"), str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]
        archive.extractall(tmp_path / "site")
    checked = subprocess.run(
        [sys.executable, "-c", _FALLBACK_CHECK],
        env={**env, "PYTHONPATH": str(tmp_path / "site")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stderr
    where, available, samples, stat_available, gone, pump = checked.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "site")  # the wheel's, not this checkout's
    assert (available, samples, stat_available, gone, pump) == ("False", "2", "False", "2", "False")
