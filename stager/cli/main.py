"""Command-line entry points: ``stager <command>``, ``stage-in`` and ``stage-out``.

This module only parses arguments and maps exceptions to exit codes; each command's flags and
its call into the library live in ``stager/commands/<command>.py``. Errors print one line,
``<prog>: error: <what and where; what to do>``, and exit with the documented code
(see :mod:`stager.errors`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stager.errors import StagerError, exit_code_for

__all__ = ["main", "stage_in_main", "stage_out_main", "build_parser", "COMMANDS"]

#: Subcommand name -> module under stager.cli.commands.
COMMANDS = {
    "stage-in": "stage_in",
    "stage-out": "stage_out",
    "index": "index",
    "doctor": "doctor",
    "make-dataset": "make_dataset",
}


def _command_module(name: str):
    import importlib

    return importlib.import_module(f"stager.cli.commands.{COMMANDS[name]}")


def build_parser(prog: str = "stager") -> argparse.ArgumentParser:
    """The umbrella parser with one subparser per command (used by the docs check too)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Stage datasets to node-local scratch and checkpoints back, on SLURM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = _command_module(name)
        module.add_parser(sub, name)
    return parser


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    prog = getattr(args, "prog_name", parser.prog)
    try:
        return int(args.handler(args) or 0)
    except StagerError as exc:
        for line in getattr(exc, "detail_lines", lambda: [])():
            print(line, file=sys.stderr)
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """``stager COMMAND ...``"""
    return _run(build_parser(), argv)


def _single(name: str, argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog=name)
    module = _command_module(name)
    module.configure(parser)
    parser.set_defaults(prog_name=name)
    return _run(parser, argv)


def stage_in_main(argv: Sequence[str] | None = None) -> int:
    """``stage-in ...`` (same as ``stager stage-in ...``)."""
    return _single("stage-in", argv)


def stage_out_main(argv: Sequence[str] | None = None) -> int:
    """``stage-out ...`` (same as ``stager stage-out ...``)."""
    return _single("stage-out", argv)
