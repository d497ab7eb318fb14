"""stage-in --fanout when a source shard changes size after every node listed it.

The owner's copy retries and takes the size the source has now (as plain stage-in does), so
the bytes it sends are the source's current ones, verified by the owner's hash. The receivers
compared them with the size they listed before the change and failed the shard as corrupt
(exit 4, "differ from their manifest" with no manifest) while the owner kept it: nodes ended
with different shards where plain stage-in staged it everywhere with exit 0. Found by a
hostile review.
"""

from __future__ import annotations

from pathlib import Path

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset

from .test_fanout_procs import Nodes, _assert_identical, _finish

# Loaded after the counting filesystem of test_fanout_procs: the first open of one shard
# (by its owner, after every node listed the source) appends 1 KiB of zeros to it first: a
# tar that stays valid, at a size no node listed.
GROW_ON_FIRST_OPEN = """

_GROW = os.environ.get("FANOUT_TEST_GROW_ON_OPEN")
if _GROW:
    _plain_open = CountingFileSystem._open

    def _growing_open(self, path, mode="rb", block_size=None, **kwargs):
        local = self._strip_protocol(path)
        if local == _GROW:
            try:
                fd = os.open(os.environ["FANOUT_TEST_GROW_MARK"], os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                with open(local, "ab") as f:
                    f.write(bytes(1024))
        return _plain_open(self, path, mode, block_size, **kwargs)

    CountingFileSystem._open = _growing_open
"""


def test_a_shard_growing_after_the_listing_is_staged_on_every_node(tmp_path: Path) -> None:
    src = tmp_path / "src" / "ds"
    write_synthetic_dataset(
        src, SyntheticSpec(num_shards=6, samples_per_shard=12, image_bytes=4000, seed=8)
    )
    victim = sorted(src.glob("*.tar"))[3]
    nodes = Nodes(tmp_path, 2)
    site = tmp_path / "site" / "sitecustomize.py"
    site.write_text(site.read_text() + GROW_ON_FIRST_OPEN)
    results = _finish(
        nodes.start(
            src,
            "--fanout-op-timeout",
            "60",
            FANOUT_TEST_GROW_ON_OPEN=str(victim),
            FANOUT_TEST_GROW_MARK=str(tmp_path / "grown"),
        )
    )
    assert (tmp_path / "grown").exists()  # the shard did change mid-run
    for rank, (code, err) in results.items():
        assert code == 0, (rank, err)
        assert "Traceback" not in err, err
        _assert_identical(src, nodes.dest(rank) / "ds")
