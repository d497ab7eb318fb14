"""Brace patterns (``train-{000000..000099}.tar``): bounded before they are expanded.

``braceexpand`` materialises products eagerly, so a typo such as ``{0..99999999}{0..9999}``
would exhaust memory before any limit could be checked; :func:`pattern_size_bound` computes an
upper bound from the text alone, and :func:`expand_pattern` refuses patterns past
:data:`MAX_PATTERN_SHARDS` before expanding anything.
"""

from __future__ import annotations

import itertools
import re

from stager.errors import UsageError

__all__ = ["MAX_PATTERN_SHARDS", "expand_pattern", "is_pattern", "pattern_size_bound"]

#: A brace pattern expanding past this is a typo (``{0..99999999999}``), not a dataset.
MAX_PATTERN_SHARDS = 1_000_000

_INNER_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+|[A-Za-z])\.\.(-?\d+|[A-Za-z])(?:\.\.(-?\d+))?$")


def is_pattern(spec: str) -> bool:
    """True when ``spec`` holds a brace group to expand."""
    return "{" in spec and "}" in spec


def pattern_size_bound(spec: str) -> int:
    """An upper bound on how many names a brace pattern expands to, computed without expanding."""
    bound, text = 1, spec
    while True:
        match = _INNER_BRACE.search(text)
        if match is None:
            return bound
        body = match.group(1)
        rng = _RANGE.match(body)
        if rng:
            lo, hi, step = rng.group(1), rng.group(2), rng.group(3)
            if lo.lstrip("-").isdigit() and hi.lstrip("-").isdigit():
                count = abs(int(hi) - int(lo)) // max(1, abs(int(step or 1))) + 1
            else:
                count = abs(ord(hi[0]) - ord(lo[0])) + 1
        else:
            count = body.count(",") + 1
        bound *= max(1, count)
        if bound > 10 * MAX_PATTERN_SHARDS:
            return bound
        text = text[: match.start()] + "x" + text[match.end() :]


def expand_pattern(spec: str) -> list[str]:
    """The names of a brace pattern, in order; :class:`UsageError` for a typo or a bad pattern."""
    from braceexpand import braceexpand

    too_many = (
        f"brace pattern {spec!r} expands to more than {MAX_PATTERN_SHARDS} names; check the ranges"
    )
    if pattern_size_bound(spec) > MAX_PATTERN_SHARDS:
        raise UsageError(too_many)
    try:
        expanded = list(itertools.islice(braceexpand(spec), MAX_PATTERN_SHARDS + 1))
    except ValueError as exc:  # braceexpand.UnbalancedBracesError
        raise UsageError(
            f"bad brace pattern {spec!r} ({exc}); e.g. train-{{000000..000099}}.tar"
        ) from exc
    if len(expanded) > MAX_PATTERN_SHARDS:
        raise UsageError(too_many)
    return expanded
