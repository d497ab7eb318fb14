"""The console scripts' entry points: they import the CLI themselves, so that a Ctrl-C while it
imports is said in one line and exit code 130, as one a moment later is.

The scripts pip writes import their entry point's module before calling it, and
:mod:`stager.cli.main` takes 10-50 ms to import (its error classes, argparse, dataclasses):
a SIGINT then ended stage-in with Python's traceback. Here only ``sys`` is imported first.
(An interrupt while the interpreter itself starts, before any of this, is Python's to report.)
"""

from __future__ import annotations

import sys

__all__ = ["main", "stage_in", "stage_out"]

#: :data:`stager.errors.EXIT_INTERRUPTED`, restated: that module is part of the import guarded
#: here (tests/test_interrupt.py holds the two equal).
EXIT_INTERRUPTED = 130


def main() -> int:
    """``stager COMMAND ...``"""
    return _start("stager", "main")


def stage_in() -> int:
    """``stage-in ...``"""
    return _start("stage-in", "stage_in_main")


def stage_out() -> int:
    """``stage-out ...``"""
    return _start("stage-out", "stage_out_main")


def _start(prog: str, entry: str) -> int:
    try:
        from stager.cli import main as cli
    except KeyboardInterrupt:
        print(f"{prog}: interrupted while starting; nothing was done", file=sys.stderr)
        return EXIT_INTERRUPTED
    return int(getattr(cli, entry)())
