"""The optional compiled helpers (``setup.py`` builds them where a C compiler is found).

Each has an environment switch: ``0`` turns it off (to compare, or to rule it out), ``1`` makes
its absence an import error (the test suite sets it, so a build that silently failed cannot
pass on the Python fallback alone), anything else takes it where it was built.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load_optional"]


def load_optional(module: str, switch: str) -> ModuleType | None:
    """``module`` imported, or None where it was not built or ``switch`` is ``0``."""
    wanted = os.environ.get(switch, "")
    if wanted == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        if wanted == "1":
            raise
        return None
