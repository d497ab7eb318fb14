"""What a sample becomes on its way out: decoding, the user's map, tuple selection, collation.

Kept apart from the readers so the staged (random-access) and streaming paths produce the
same batches from the same arguments.

What a decode spec gives (webdataset's image specs; ``.npy`` members hold arrays, which are
returned as stored whatever the spec, so for images saved as ``.npy`` pick ``"rgb8"``, whose
layout they usually already have):

==============  ========================================  =================================
spec            a .jpg/.jpeg/.png/.webp member            batch (images of one size)
==============  ========================================  =================================
``"rgb8"``      numpy uint8 HxWx3                         uint8 tensor [B, H, W, 3]
``"torchrgb8"`` torch uint8 3xHxW                         uint8 tensor [B, 3, H, W]
``"torchrgb"``  torch float32 3xHxW in [0, 1]             float32 tensor [B, 3, H, W]
``"rgb"``       numpy float32 HxWx3 in [0, 1]             float32 tensor [B, H, W, 3]
``"l8"``        numpy uint8 HxW (grey)                    uint8 tensor [B, H, W]
``"pil"``       PIL.Image (RGB)                           list of B PIL images
==============  ========================================  =================================

Images of different sizes collate to a list of tensors, never a padded tensor. ``.cls`` becomes
an int (an int64 tensor per batch), ``.json`` a Python object, ``.txt`` a str.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from stager.errors import UsageError

__all__ = [
    "SamplePipeline",
    "DecodeSpec",
    "make_decoder",
    "decode_sample",
    "select_fields",
    "select_columns",
    "collate_samples",
    "INSTALL_HINTS",
]

DecodeSpec = str | Callable[[dict[str, Any]], dict[str, Any]] | None

#: Modules that webdataset's decoders import on first use, and the pip package providing each.
INSTALL_HINTS = {
    "PIL": "Pillow",
    "msgpack": "msgpack",
    "cbor": "cbor",
    "torchvision": "torchvision",
    "torchaudio": "torchaudio",
    "av": "av",
    "imageio": "imageio",
}


def make_decoder(decode: DecodeSpec) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """A webdataset decoder for an image spec ("torchrgb", "rgb8", "pil", ...), or the callable.

    webdataset's decoder also turns ``.npy``, ``.cls``, ``.json``, ``.txt`` and friends into
    arrays, ints and strings, so any spec decodes the synthetic dataset's members.
    """
    if decode is None or callable(decode):
        return decode
    if not isinstance(decode, str):
        raise UsageError(
            f"decode must be None, a webdataset image spec or a callable, not {decode!r}"
        )
    import webdataset as wds

    try:
        handler = wds.autodecode.imagehandler(decode)
    except (ValueError, AssertionError) as exc:
        raise UsageError(
            f"unknown decode spec {decode!r} ({exc}); use e.g. 'torchrgb', 'rgb8', 'pil'"
        ) from exc
    return wds.autodecode.Decoder([_ImagesOnly(handler)])


class _ImagesOnly:
    """webdataset's image handler imports Pillow for every member; call it for images only.

    So datasets without images (``.npy`` + ``.cls``) decode on machines without Pillow. Arrays
    come back writable: ``np.asarray(PIL image)`` is a read-only view, and torch warns about
    every such array it wraps, once per worker and epoch ("NumPy array is not writable").
    """

    def __init__(self, handler: Callable[[str, bytes], Any]):
        self.handler = handler

    def __call__(self, key: str, data: bytes) -> Any:
        import webdataset as wds

        if key.rsplit(".", 1)[-1].lower() not in wds.autodecode.IMAGE_EXTENSIONS:
            return None
        result = self.handler(key, data)
        if isinstance(result, np.ndarray) and not result.flags.writeable:
            result = result.copy()
        return result


def decode_sample(
    decoder: Callable[[dict[str, Any]], dict[str, Any]], sample: dict[str, Any], spec: DecodeSpec
) -> dict[str, Any]:
    """``decoder(sample)``, with webdataset's ``DecodingError`` turned into one readable line.

    That error wraps the cause (often ``No module named 'PIL'``) and only shows it deep in the
    chained traceback of a worker. A missing module becomes a ``ModuleNotFoundError`` naming
    the package to install; anything else a ``ValueError`` naming the member and sample.
    """
    import webdataset as wds

    try:
        return decoder(sample)
    except wds.autodecode.DecodingError as exc:
        cause = exc.__cause__
        member = f"member {exc.k!r} of sample {exc.key!r}"
        where = sample.get("__shard__") or sample.get("__url__") or exc.url
        if where:
            member += f" in {where}"
        if isinstance(cause, ImportError):
            module = (cause.name or "").split(".")[0]
            package = INSTALL_HINTS.get(module, module or "the missing package")
            raise ModuleNotFoundError(
                f"decode={spec!r}: {member} needs the Python package {package!r}, which is not "
                f"installed here ({cause}); pip install {package}",
                name=cause.name,
            ) from None
        raise ValueError(
            f"decode={spec!r}: cannot decode {member}: {type(cause).__name__}: {cause}; "
            "fix or drop that sample, or decode it yourself (decode=None or a callable)"
        ) from cause


def tuple_fields(to_tuple: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``to_tuple`` as the loader keeps it: a string is split at spaces, as webdataset's
    ``to_tuple("jpg;png cls")`` reads it (not into characters)."""
    if to_tuple is None:
        return None
    names = to_tuple.split() if isinstance(to_tuple, str) else list(to_tuple)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise UsageError(f"to_tuple must name members, e.g. ('jpg;png', 'cls'); got {to_tuple!r}")
    return tuple(names)


def select_fields(sample: dict[str, Any], to_tuple: Sequence[str]) -> tuple[Any, ...]:
    """``sample[name]`` for each name; ``"jpg;png"`` takes the first extension present. A name
    found only lower-cased names a member (extensions are grouped lower-cased: ``"JPG"`` reads
    ``000.JPG``); one found as given may be a key that ``map`` made (``"Label"``)."""
    out = []
    for spec in to_tuple:
        for name in spec.split(";"):
            if name in sample or (name := name.lower()) in sample:
                out.append(sample[name])
                break
        else:
            raise _none_of(sample.get("__key__"), spec, sorted(sample))
    return tuple(out)


def select_columns(columns: dict[str, list[Any]], to_tuple: Sequence[str]) -> tuple[list[Any], ...]:
    """:func:`select_fields` over a raw batch's columns (``None`` where a sample lacks that
    member): for each sample the first alternative it has, so ``"jpg;png"`` gives a batch of
    both its JPEGs and its PNGs (it took the first column present, and left ``None`` for every
    sample of the other kind). A sample with none raises the same :class:`KeyError`."""
    keys = columns["__key__"]
    out: list[list[Any]] = []
    for spec in to_tuple:
        present = []
        for name in spec.split(";"):
            if name in columns or (name := name.lower()) in columns:
                present.append(columns[name])
        if present and all(value is not None for value in present[0]):
            out.append(present[0])  # (every sample has the first alternative: the usual case)
            continue
        picked = []
        for i, key in enumerate(keys):
            value = next((column[i] for column in present if column[i] is not None), None)
            if value is None:
                has = sorted(k for k, column in columns.items() if column[i] is not None)
                raise _none_of(key, spec, has)
            picked.append(value)
        out.append(picked)
    return tuple(out)


def _none_of(key: object, spec: str, has: list[str]) -> KeyError:
    return KeyError(
        f"sample {key!r} has none of {spec!r} (has {has}); name members the samples have in "
        "to_tuple ('jpg;png' takes the first present)"
    )


#: What torch's default_collate can stack; anything else (PIL images, custom objects) stays a list.
_COLLATABLE = (torch.Tensor, np.ndarray, np.generic, numbers.Number, Mapping, Sequence)


@dataclass
class RaggedBatch:
    """Tensors of different shapes (images of several sizes) packed into one flat tensor.

    A list of tensors leaving a DataLoader worker goes to shared memory one tensor at a time:
    one segment, one file descriptor and a few system calls per image. For 64 small JPEGs that
    made a worker ~7x slower than the main process. Packed, a batch is one segment, and
    :meth:`unpack` in the training process gives back the list, as views.
    """

    flat: torch.Tensor
    shapes: list[tuple[int, ...]]

    @classmethod
    def pack(cls, items: list[Any]) -> RaggedBatch:
        tensors = [torch.as_tensor(s) for s in items]
        return cls(torch.cat([t.reshape(-1) for t in tensors]), [tuple(t.shape) for t in tensors])

    def unpack(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self.shapes:
            count = math.prod(shape)
            out.append(self.flat[offset : offset + count].view(shape))
            offset += count
        return out

    def pin_memory(self, device: str | None = None) -> RaggedBatch:
        return RaggedBatch(self.flat.pin_memory(device), self.shapes)


def unpack_ragged(batch: Any) -> Any:
    """``batch`` with every :class:`RaggedBatch` in it turned back into its list of tensors."""
    if isinstance(batch, RaggedBatch):
        return batch.unpack()
    if isinstance(batch, tuple):
        return _same_kind(batch, [unpack_ragged(v) for v in batch])
    if isinstance(batch, list):
        return [unpack_ragged(v) for v in batch]
    if isinstance(batch, dict):
        return _same_kind(batch, {k: unpack_ragged(v) for k, v in batch.items()})
    return batch


def _same_kind(like: Any, values: Any) -> Any:
    """``values`` (a list for a tuple, a dict for a mapping) as the type of ``like``, as
    torch's default_collate keeps a namedtuple (``batch.image``) or an ``OrderedDict``; a
    plain tuple or dict where that type cannot be built from them."""
    if isinstance(like, tuple):
        if hasattr(like, "_fields"):  # a namedtuple
            return type(like)(*values)
        return tuple(values)
    if type(like) is not dict:
        try:
            return type(like)(values)
        except TypeError:
            pass
    return values


def _kind(value: Any) -> Any:
    """What collates alike: numbers with numbers (bool apart), arrays with arrays, else the
    type."""
    if isinstance(value, bool):
        return bool
    if isinstance(value, numbers.Number):
        return numbers.Number
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return np.ndarray
    return type(value)


def _alike(samples: list[Any]) -> bool:
    """Whether ``samples`` are all of one kind (:func:`_kind`), and lists all of one length."""
    first = samples[0]
    if isinstance(first, list):
        return all(isinstance(s, list) and len(s) == len(first) for s in samples)
    kind = _kind(first)
    return all(_kind(s) is kind for s in samples)


def collate_samples(samples: list[Any]) -> Any:
    """torch's default collation, but bytes/str/None, PIL images, other objects, ragged
    tensors and values of several kinds stay lists.

    default_collate would fail on images of different sizes and on PIL images (``decode="pil"``).
    Tensors of different shapes travel as one :class:`RaggedBatch` and reach the training loop
    as a list of tensors. Values of several kinds ("txt;json": a str here, a dict there; a
    number and a dict) and lists of several lengths (a JSON array) are one per sample, as
    webdataset gives them: default_collate raised "each element in list of batch should be of
    equal size" or "Could not infer dtype", naming nothing, by the order samples came in.
    """
    if any(s is None for s in samples) or not _alike(samples):
        return list(samples)
    first = samples[0]
    if isinstance(first, (tuple, list)):  # (transposed as default_collate does, each column ours)
        columns = [collate_samples(list(column)) for column in zip(*samples, strict=True)]
        return _same_kind(first, columns) if isinstance(first, tuple) else columns
    if isinstance(first, dict):
        # Every member any sample has, None where one lacks it, as a raw batch gives them: the
        # first sample's keys raised KeyError when it had more, and dropped the others' extra
        # members (a caption) when it had fewer, by the shuffle's order.
        keys = dict.fromkeys(k for s in samples for k in s)
        return _same_kind(first, {k: collate_samples([s.get(k) for s in samples]) for k in keys})
    if isinstance(first, (bytes, str)) or not isinstance(first, _COLLATABLE):
        return list(samples)
    if isinstance(first, (torch.Tensor, np.ndarray)) and len({tuple(s.shape) for s in samples}) > 1:
        same_dtype = len({s.dtype for s in samples}) == 1
        return RaggedBatch.pack(samples) if same_dtype else [torch.as_tensor(s) for s in samples]
    return default_collate(samples)


@dataclass(frozen=True)
class SamplePipeline:
    """decode -> map (on the sample dict) -> to_tuple; picklable so spawned workers get it."""

    decode: DecodeSpec = None
    map: Callable[[Any], Any] | None = None
    to_tuple: tuple[str, ...] | None = None

    def __call__(self, sample: dict[str, Any]) -> Any:
        decoder = _decoder_for(self.decode)
        if decoder is not None:
            sample = decode_sample(decoder, sample, self.decode)
        if self.map is not None:
            sample = self.map(sample)
        if self.to_tuple is not None:
            return select_fields(sample, self.to_tuple)
        return sample


_DECODERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def _decoder_for(decode: DecodeSpec) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    # Decoders are rebuilt once per process rather than pickled with the pipeline.
    if isinstance(decode, str):
        if decode not in _DECODERS:
            decoder = make_decoder(decode)
            assert decoder is not None
            _DECODERS[decode] = decoder
        return _DECODERS[decode]
    return decode
