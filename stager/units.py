"""Sizes, rates and ages as people write them: ``human_bytes``/``human_duration`` for messages,
``parse_size``/``parse_duration`` for flags.

Decimal units throughout (1 MB = 10^6 bytes), as MB/s is; ``Ki``/``Mi``/``Gi``/``Ti`` are the
binary ones for whoever needs exact powers of two.
"""

from __future__ import annotations

import math
import re

from stager.errors import UsageError

__all__ = ["human_bytes", "parse_size", "human_duration", "parse_duration"]

_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
_SECONDS = {"": 1, "S": 1, "M": 60, "H": 3600, "D": 86400, "W": 7 * 86400}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]?)\s*$")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (decimal units, as MB/s is)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def parse_size(text: str, *, flag: str = "size") -> int:
    """``"10G"`` -> 10_000_000_000, ``"500M"``, ``"2GiB"``, ``"1.5T"``, plain ``"4096"`` bytes.

    A trailing ``B`` is optional (``10GB`` = ``10G``). Refuses negatives, NaN and infinities
    with a :class:`UsageError` naming ``flag``.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"{flag} {text!r} is not a size; write e.g. 4096, 500M, 10G or 2GiB")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit.endswith("B") and unit != "B":
        unit = unit[:-1]
    factor = _UNITS.get(unit) or _BINARY.get(unit)
    if factor is None:
        raise UsageError(
            f"{flag} {text!r} has an unknown unit {match.group(2)!r}; use K, M, G, T or Ki, Mi, "
            "Gi, Ti"
        )
    value = number * factor
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {text!r} must be a finite, non-negative size")
    return int(value)


def parse_duration(text: str, *, flag: str = "duration") -> float:
    """``"2d"`` -> 172800.0; units ``s``, ``m``, ``h``, ``d``, ``w``; a plain number is seconds.

    Refuses negatives, NaN, infinities and unknown units with a :class:`UsageError` naming
    ``flag`` (``--older-than 2 days`` is refused, not read as 2 seconds).
    """
    match = _DURATION.match(str(text))
    if not match:
        raise UsageError(f"{flag} {text!r} is not a duration; write e.g. 90s, 30m, 12h, 2d or 1w")
    factor = _SECONDS.get(match.group(2).upper())
    if factor is None:
        raise UsageError(
            f"{flag} {text!r} has an unknown unit {match.group(2)!r}; use s, m, h, d or w"
        )
    value = float(match.group(1)) * factor
    if not math.isfinite(value):
        raise UsageError(f"{flag} {text!r} must be a finite duration")
    return value


def human_duration(seconds: float) -> str:
    """``90`` -> ``"1m"``, ``7200`` -> ``"2h"``, ``200000`` -> ``"2d"``: the largest whole unit."""
    seconds = max(0.0, seconds)
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
