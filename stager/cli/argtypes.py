"""Argument types that refuse what cannot be meant: NaN, infinities, negatives, absurd rates.

argparse's ``type=float`` accepts ``nan`` and ``inf``: ``--interval nan`` made ``--watch``
spin, ``--bw-limit 1e-300`` overflowed a timestamp. Every numeric flag goes through one of these
instead, so a bad value is a one-line usage error (exit 2) at parse time, naming the flag.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from stager.units import parse_duration, parse_size

__all__ = [
    "path",
    "seconds",
    "positive_seconds",
    "count",
    "positive_count",
    "mbps",
    "size",
    "duration",
    "default_of",
]

#: Rates below 1 byte/s are typos (and overflow timers); above 1 PB/s no link exists.
_MIN_MBPS, _MAX_MBPS = 1e-6, 1e9
#: A duration past ten years is a typo, and past it timestamps overflow.
_MAX_SECONDS = 10 * 365 * 24 * 3600.0


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _bounded(lo: float, hi: float, *, open_lo: bool, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _number(text)
        if value < lo or (open_lo and value == lo) or value > hi:
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return value

    parse.__name__ = what.split()[0]
    return parse


#: Seconds, >= 0 (a delay or margin that may be zero).
seconds = _bounded(
    0.0, _MAX_SECONDS, open_lo=False, what="seconds must be >= 0 and at most ten years"
)
#: Seconds, > 0 (an interval or timeout).
positive_seconds = _bounded(
    0.0, _MAX_SECONDS, open_lo=True, what="seconds must be > 0 and at most ten years"
)
#: A rate in MB/s.
mbps = _bounded(_MIN_MBPS, _MAX_MBPS, open_lo=False, what="MB/s must be between 1e-6 and 1e9")


def _integer(lo: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return value

    parse.__name__ = "integer"
    return parse


#: An integer >= 0.
count = _integer(0, "must be >= 0")
#: An integer >= 1.
positive_count = _integer(1, "must be >= 1")


def size(text: str) -> int:
    """Bytes, written ``4096``, ``500M``, ``10G`` or ``2GiB`` (:func:`stager.units.parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as exc:  # UsageError is a ValueError
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(text: str) -> float:
    """Seconds, written ``90s``, ``30m``, ``12h``, ``2d`` or ``1w`` (see
    :func:`stager.units.parse_duration`)."""
    try:
        value = parse_duration(text)
    except ValueError as exc:  # UsageError is a ValueError
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most ten years")
    return value


def path(text: str) -> str:
    """A path or URL: not empty. ``--report ""`` was passed over and ``stage-out CKPT ""``
    committed into the working directory: an unset variable (``"$CKPT_DEST"``), never meant."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset variable?); give a path")
    return text


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass field ``name``: flags take their defaults from the library's
    option classes, so a default is written once."""
    for item in fields(cls):
        if item.name == name:
            if item.default is not MISSING:
                return item.default
            if item.default_factory is not MISSING:
                return item.default_factory()
            break
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")
