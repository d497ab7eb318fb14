"""What a sample becomes on its way out: decoding, the user's map, tuple selection, collation.

Kept apart from the readers so the staged (random-access) and streaming paths produce the
same batches from the same arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from stager.errors import UsageError

__all__ = ["SamplePipeline", "DecodeSpec", "make_decoder", "select_fields", "collate_samples"]

DecodeSpec = str | Callable[[dict[str, Any]], dict[str, Any]] | None


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

    So datasets without images (``.npy`` + ``.cls``) decode on machines without Pillow.
    """

    def __init__(self, handler: Callable[[str, bytes], Any]):
        self.handler = handler

    def __call__(self, key: str, data: bytes) -> Any:
        import webdataset as wds

        if key.rsplit(".", 1)[-1].lower() not in wds.autodecode.IMAGE_EXTENSIONS:
            return None
        return self.handler(key, data)


def select_fields(sample: dict[str, Any], to_tuple: Sequence[str]) -> tuple[Any, ...]:
    """``sample[name]`` for each name; ``"jpg;png"`` takes the first extension present."""
    out = []
    for spec in to_tuple:
        for name in spec.split(";"):
            if name in sample:
                out.append(sample[name])
                break
        else:
            raise KeyError(
                f"sample {sample.get('__key__')!r} has none of {spec!r} (has {sorted(sample)})"
            )
    return tuple(out)


def collate_samples(samples: list[Any]) -> Any:
    """torch's default collation, but bytes/str/None and ragged tensors stay lists.

    default_collate would fail on images of different sizes; a list keeps each tensor in shared
    memory all the same.
    """
    first = samples[0]
    if isinstance(first, tuple):
        return tuple(collate_samples(list(column)) for column in zip(*samples, strict=True))
    if isinstance(first, dict):
        return {k: collate_samples([s[k] for s in samples]) for k in first}
    if isinstance(first, (bytes, str)) or first is None:
        return list(samples)
    if isinstance(first, (torch.Tensor, np.ndarray)) and len({tuple(s.shape) for s in samples}) > 1:
        return [torch.as_tensor(s) for s in samples]
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
            sample = decoder(sample)
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
