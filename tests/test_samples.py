"""Decoding and collation of real image shards: what each decode spec gives, in a worker too.

pytest turns warnings into errors (pyproject), so a decode spec that makes torch warn
("NumPy array is not writable") fails here, in the main process and in a forked worker alike.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from stager.shards.synth import SyntheticSpec, write_synthetic_dataset
from stager_loaders import LoaderOptions, ShardedLoader
from stager_loaders.metrics import batch_length
from stager_loaders.samples import collate_samples

from .imagedata import write_image_dataset


@pytest.fixture(scope="module")
def square_jpgs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs all 16x20, so batches stack into one tensor."""
    import webdataset as wds
    from PIL import Image

    out = tmp_path_factory.mktemp("jpg") / "square"
    out.mkdir()
    rng = np.random.default_rng(3)
    with wds.ShardWriter(str(out / "s-%04d.tar"), maxcount=7, verbose=0) as sink:
        for i in range(20):
            buf = io.BytesIO()
            pixels = rng.integers(0, 256, size=(16, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, format="JPEG")
            sink.write({"__key__": f"k{i:04d}", "jpg": buf.getvalue(), "cls": str(i % 5).encode()})
    return out


@pytest.fixture(scope="module")
def mixed_jpgs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_dataset(tmp_path_factory.mktemp("jpg") / "mixed", num_samples=30)[0].parent


def _first_batch(data: Path, tmp_path: Path, workers: int = 0, **kw) -> tuple:
    loader = ShardedLoader(
        data,
        batch_size=4,
        num_workers=workers,
        shuffle=False,
        rank=0,
        world_size=1,
        options=LoaderOptions(dest=str(tmp_path / "scratch")),
        **kw,
    )
    batches = []
    for epoch in range(2):  # torch warns once per process: a second epoch re-forks workers
        loader.set_epoch(epoch)
        batches.append(next(iter(loader)))
    return batches[-1]


# spec -> (type, dtype, shape of a batch of 4 images 16x20)
SPECS = {
    "rgb8": (torch.Tensor, torch.uint8, (4, 16, 20, 3)),
    "torchrgb8": (torch.Tensor, torch.uint8, (4, 3, 16, 20)),
    "torchrgb": (torch.Tensor, torch.float32, (4, 3, 16, 20)),
    "rgb": (torch.Tensor, torch.float32, (4, 16, 20, 3)),
    "l8": (torch.Tensor, torch.uint8, (4, 16, 20)),
}


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_each_decode_spec_gives_what_the_docs_say(
    spec: str, workers: int, square_jpgs: Path, tmp_path: Path, caplog
) -> None:
    kind, dtype, shape = SPECS[spec]
    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        images, labels = _first_batch(
            square_jpgs, tmp_path, workers, decode=spec, to_tuple=("jpg", "cls")
        )
    assert isinstance(images, kind) and images.dtype == dtype and tuple(images.shape) == shape
    if dtype == torch.float32:
        assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert labels.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("workers", [0, 1])
def test_pil_images_collate_to_a_list_with_the_default_collate(
    workers: int, square_jpgs: Path, tmp_path: Path, caplog
) -> None:
    from PIL import Image

    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        images, labels = _first_batch(
            square_jpgs, tmp_path, workers, decode="pil", to_tuple=("jpg", "cls")
        )
    assert isinstance(images, list) and len(images) == 4
    assert all(isinstance(im, Image.Image) and im.size == (20, 16) for im in images)
    assert isinstance(labels, torch.Tensor) and labels.tolist() == [0, 1, 2, 3]


def test_images_of_different_sizes_stay_a_list_of_tensors(
    mixed_jpgs: Path, tmp_path: Path, caplog
) -> None:
    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        images, _ = _first_batch(mixed_jpgs, tmp_path, decode="rgb8", to_tuple=("jpg", "cls"))
    assert isinstance(images, list) and len({tuple(im.shape) for im in images}) > 1
    assert all(im.dtype == torch.uint8 and im.shape[-1] == 3 for im in images)


@pytest.mark.parametrize("spec", ["rgb8", "torchrgb", "pil"])
def test_npy_members_decode_as_stored_whatever_the_spec(spec: str, tmp_path: Path) -> None:
    """The README's example: .npy images are uint8 HxWx3 arrays; an image spec leaves them so."""
    data = tmp_path / "npy"
    write_synthetic_dataset(data, SyntheticSpec(num_shards=1, samples_per_shard=8))
    images, labels = _first_batch(data, tmp_path, decode=spec, to_tuple=("npy", "cls"))
    assert images.dtype == torch.uint8 and images.shape[0] == 4 and images.shape[-1] == 3
    assert labels.dtype == torch.int64


def test_a_missing_image_library_fails_with_one_line_naming_the_package(
    square_jpgs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    # As if Pillow were not installed: importing it raises ModuleNotFoundError(name="PIL").
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        with pytest.raises(ModuleNotFoundError) as info:
            _first_batch(square_jpgs, tmp_path, decode="torchrgb", to_tuple=("jpg", "cls"))
    message = str(info.value)
    assert "\n" not in message
    assert "pip install Pillow" in message and "'jpg'" in message and "'k0000'" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_corrupt_image_names_member_and_sample(tmp_path: Path, caplog) -> None:
    data = tmp_path / "bad"
    data.mkdir()
    with tarfile.open(data / "s-0000.tar", "w") as tar:
        for name, payload in (("k1.jpg", b"not a jpeg at all"), ("k1.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        with pytest.raises(ValueError, match=r"cannot decode member 'jpg' of sample 'k1'"):
            _first_batch(data, tmp_path, decode="rgb8", to_tuple=("jpg", "cls"))


def test_a_collate_fn_returning_a_dict_led_by_a_number_does_not_crash(
    square_jpgs: Path, tmp_path: Path, caplog
) -> None:
    """A user's collate_fn whose first value is an int: batch_length used to call len() on it."""

    def collate(samples: list) -> dict:
        return {"count": len(samples), "keys": [s["__key__"] for s in samples]}

    with caplog.at_level(logging.ERROR, logger="stager_loaders"):
        batch = _first_batch(square_jpgs, tmp_path, collate_fn=collate)
    assert batch["count"] == 4 and len(batch["keys"]) == 4


def test_batch_length_is_total() -> None:
    assert batch_length({"count": 3, "images": torch.zeros(5, 2)}) == 5
    assert batch_length({"count": 3}) == 1
    assert batch_length({"__key__": ["a", "b"], "n": 7}) == 2
    assert batch_length((torch.tensor(1.0), [1, 2, 3])) == 2  # a list of two samples
    assert batch_length(torch.tensor(2.0)) == 1  # 0-d: len() would raise
    assert batch_length(np.float32(1.0)) == 1
    assert batch_length(object()) == 1
    assert batch_length("abc") == 1
    assert batch_length([]) == 1


def test_collate_keeps_unknown_objects_as_lists() -> None:
    marker = object()
    assert collate_samples([marker, marker]) == [marker, marker]
    assert collate_samples([(1, b"x"), (2, b"y")])[1] == [b"x", b"y"]


def test_rgb8_does_not_warn_in_a_fresh_process(square_jpgs: Path, tmp_path: Path) -> None:
    """torch warns about a read-only array once per process, so only a fresh one can tell."""
    code = f"""
import logging, warnings
warnings.simplefilter("error")
logging.disable(logging.WARNING)
from stager_loaders import LoaderOptions, ShardedLoader
loader = ShardedLoader({str(square_jpgs)!r}, batch_size=4, num_workers=1, decode="rgb8",
    to_tuple=("jpg", "cls"), rank=0, world_size=1,
    options=LoaderOptions(dest={str(tmp_path / "scratch")!r}))
for epoch in range(2):
    loader.set_epoch(epoch)
    for images, labels in loader:
        pass
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    assert "not writable" not in result.stderr


def _tar(path: Path, members: list[tuple[str, bytes]], gz: bool = False) -> None:
    import gzip

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())


def _batches(ds: Path, tmp_path: Path, **kwargs: object) -> list:
    options = LoaderOptions(dest=str(tmp_path / "nowhere"), rank=0, world_size=1)
    loader = ShardedLoader(ds, batch_size=4, shuffle=False, options=options, **kwargs)
    return list(loader)


@pytest.mark.parametrize("decode", [None, "bytes-callable"])
def test_alternatives_in_to_tuple_are_chosen_per_sample_in_raw_batches_too(
    tmp_path: Path, decode: str | None
) -> None:
    """``to_tuple=("jpg;png", "cls")`` (the README's advice for mixed data) on raw batches
    took the first column present for the whole batch: every PNG of a batch holding a JPEG
    became None. Each sample now gets its own alternative, as decoded batches and webdataset
    give; a sample with none raises the same KeyError on both paths."""
    ds = tmp_path / "mixed"
    exts = ["jpg", "png", "jpg", "png"]
    _tar(
        ds / "s.tar",
        [
            m
            for i, e in enumerate(exts)
            for m in ((f"{i}.{e}", b"I%d" % i), (f"{i}.cls", b"%d" % i))
        ],
    )
    dec = None if decode is None else (lambda sample: sample)
    ((images, _),) = _batches(ds, tmp_path, decode=dec, to_tuple=("jpg;png", "cls"))
    assert [bytes(memoryview(np.asarray(x))) for x in images] == [b"I0", b"I1", b"I2", b"I3"]
    _tar(ds / "s.tar", [("0.jpg", b"x"), ("0.cls", b"0"), ("1.txt", b"t"), ("1.cls", b"1")])
    with pytest.raises(KeyError, match=r"sample '1' has none of 'jpg;png' \(has \[.*'cls'.*\]\)"):
        _batches(ds, tmp_path, decode=dec, to_tuple=("jpg;png", "cls"))


def test_samples_with_other_members_batch_alike_whatever_their_order_and_path(
    tmp_path: Path,
) -> None:
    """A batch of samples with different members (an optional caption) raised KeyError, or
    dropped the extra member, depending on the shuffle's order, on decode and on .tar.gz; raw
    .tar batches gave None. Every path now gives every member, None where a sample lacks it."""
    got = set()
    for gz in (False, True):
        for order in (["a.jpg", "a.cls", "b.jpg"], ["b.jpg", "a.jpg", "a.cls"]):
            for dec in (None, lambda sample: sample):
                ds = tmp_path / f"d{len(got)}-{gz}-{order[0]}-{dec is None}"
                _tar(ds / ("s.tar.gz" if gz else "s.tar"), [(n, b"7") for n in order], gz)
                (batch,) = _batches(ds, tmp_path, decode=dec)
                by_key = {
                    key: tuple(k for k in ("jpg", "cls") if batch[k][i] is not None)
                    for i, key in enumerate(batch["__key__"])
                }
                got.add(tuple(sorted(by_key.items())))
    assert got == {(("a", ("jpg", "cls")), ("b", ("jpg",)))}


def test_json_and_text_samples_batch_one_per_sample_where_they_differ(tmp_path: Path) -> None:
    """Captions with a JSON list of several lengths, and samples with a .txt or a .json: the
    default collate raised torch's "each element in list of batch should be of equal size"
    (naming nothing), and "txt;json" an AttributeError from inside the loader."""
    import json

    from .trees import tar_bytes

    data = tmp_path / "captions"
    data.mkdir()
    members = []
    for i in range(6):
        meta = {"tags": ["t"] * (i + 1), "id": i}
        members.append((f"c{i}.json", json.dumps(meta).encode()))
        if i % 2:
            members.append((f"c{i}.txt", f"caption {i}".encode()))
    (data / "shard-000000.tar").write_bytes(tar_bytes(members))
    options = LoaderOptions(dest=str(tmp_path / "none"), world_size=1)
    batches = list(ShardedLoader(str(data), batch_size=6, decode="rgb8", options=options))
    (batch,) = batches
    tags = batch["json"]["tags"]
    assert sorted(len(t) for t in tags) == [1, 2, 3, 4, 5, 6]  # (one list per sample)
    assert sorted(batch["json"]["id"].tolist()) == list(range(6))
    picked = ShardedLoader(
        str(data), batch_size=6, decode="rgb8", to_tuple=("__key__", "txt;json"), options=options
    )
    ((keys, texts),) = list(picked)
    by_key = dict(zip(keys, texts, strict=True))
    assert by_key["c1"] == "caption 1" and by_key["c0"] == {"tags": ["t"], "id": 0}


def test_values_of_several_kinds_batch_alike_whatever_comes_first() -> None:
    """Which value came first decided: a number then a dict raised "Could not infer dtype of
    dict", a dict then a number gave a list; ragged lists nested in lists still raised."""
    for batch in ([3, {"a": 1}], [{"a": 1}, 3], [3, "x"], [True, "x"]):
        assert collate_samples(list(batch)) == batch
    assert collate_samples([[[1, 2], [3]], [[4], [5, 6]]]) == [[[1, 2], [4]], [[3], [5, 6]]]
    assert collate_samples([[{"a": 1}], [{"b": 2}]]) == [{"a": [1, None], "b": [None, 2]}]
    assert torch.equal(collate_samples([1, 2]), torch.tensor([1, 2]))  # (numbers still stack)
