"""``faulty://``: the local filesystem, failing on purpose, for the fault-injection tests.

Registered with fsspec on import. The faults are set by environment variables, read at every
``open`` so a test can change them with ``monkeypatch.setenv`` (the filesystem is not cached):

``FAULTY_READ_FAIL_RATE``  fraction of ``read``/``readinto`` calls that raise ``OSError(EIO)``,
                           a transient error stage-in must retry;
``FAULTY_SEED``            seed of the fault pattern. Whether read *k* of open *n* of a file
                           fails is a hash of (seed, file name, n, k), so a run is reproducible
                           whatever order the copy threads take and wherever the files are;
``FAULTY_DENY``            comma-separated substrings: opening a matching path raises
                           ``PermissionError`` (a permanent error, never retried);
``FAULTY_FILL_ON`` +       opening a path containing ``FAULTY_FILL_ON`` first fills the
``FAULTY_FILL_PATH``       filesystem holding the file ``FAULTY_FILL_PATH`` to the last byte:
                           "another writer" taking the scratch space mid-copy.

In a subprocess: ``python -m tests.faulty_fs stage-in ARGS...`` (or ``index``) runs the CLI with
this filesystem registered.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from collections import Counter

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

__all__ = ["FaultyFileSystem", "PROTOCOL"]

PROTOCOL = "faulty"


def _env_list(name: str) -> list[str]:
    return [item for item in os.environ.get(name, "").split(",") if item]


def _fill(path: str) -> None:
    """Write ``path`` until its filesystem has no byte left (ENOSPC ends the loop)."""
    block = b"\xff" * (64 << 10)
    with open(path, "ab", buffering=0) as handle:
        for size in (len(block), 4096, 1):
            try:
                while True:
                    handle.write(block[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


class _FaultyFile:
    """A read-only file that raises ``OSError(EIO)`` on the reads the pattern picks."""

    def __init__(self, inner, key: str, rate: float, seed: int):
        self._inner = inner
        self._key = key
        self._rate = rate
        self._seed = seed
        self._reads = 0

    def _maybe_fail(self) -> None:
        self._reads += 1
        if self._rate <= 0:
            return
        draw = (
            xxhash.xxh64_intdigest(f"{self._key}:{self._reads}".encode(), seed=self._seed) / 2**64
        )
        if draw < self._rate:
            FaultyFileSystem.count("injected")
            raise OSError(
                errno.EIO, f"injected transient read error ({self._key}, read {self._reads})"
            )

    def read(self, size: int = -1) -> bytes:
        self._maybe_fail()
        return self._inner.read(size)

    def readinto(self, buffer) -> int:
        self._maybe_fail()
        return self._inner.readinto(buffer)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._inner.close()


class FaultyFileSystem(LocalFileSystem):
    """Local files behind a ``faulty://`` URL, with the faults the environment asks for."""

    protocol = PROTOCOL
    cachable = False  # each url_to_fs sees the current environment
    _counts: Counter = Counter()
    _lock = threading.Lock()

    @classmethod
    def count(cls, what: str, n: int = 1) -> None:
        with cls._lock:
            cls._counts[what] += n

    @classmethod
    def counts(cls) -> Counter:
        with cls._lock:
            return Counter(cls._counts)

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls._counts.clear()

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        path = self._strip_protocol(path)
        if "r" in mode:
            for needle in _env_list("FAULTY_DENY"):
                if needle in path:
                    raise PermissionError(errno.EACCES, f"injected permanent error: {path}")
            fill_on, fill_path = (
                os.environ.get("FAULTY_FILL_ON"),
                os.environ.get("FAULTY_FILL_PATH"),
            )
            if fill_on and fill_path and fill_on in path and not os.path.exists(fill_path):
                _fill(fill_path)
        with self._lock:
            self._counts[f"open:{path}"] += 1
            opened = self._counts[f"open:{path}"]
        inner = super()._open(path, mode=mode, block_size=block_size, **kwargs)
        if "r" not in mode:
            return inner
        rate = float(os.environ.get("FAULTY_READ_FAIL_RATE", "0") or 0)
        # Keyed by the file name, not the full path: the pattern must not depend on tmp dirs.
        key = f"{os.path.basename(path)}#{opened}"
        return _FaultyFile(inner, key, rate, int(os.environ.get("FAULTY_SEED", "0") or 0))


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)


if __name__ == "__main__":
    from stager.cli.main import main, stage_in_main

    command, argv = sys.argv[1], sys.argv[2:]
    sys.exit(stage_in_main(argv) if command == "stage-in" else main([command, *argv]))
