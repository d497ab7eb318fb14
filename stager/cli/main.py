"""Command-line entry points: ``stager <command>``, ``stage-in`` and ``stage-out``.

This module only parses arguments and maps exceptions to exit codes; each command's flags and
its call into the library live in a module of its own (``stager/cli/commands/<command>.py``, or
another package's module registered under the ``stager.commands`` entry point, as the loader's
``doctor`` is). Errors print one line, ``<prog>: error: <what and where; what to do>``, and
exit with the code of their class (:data:`stager.errors.EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from stager.errors import EXIT_INTERRUPTED, EXIT_USAGE, StagerError, exit_code_for, one_line

__all__ = [
    "main",
    "stage_in_main",
    "stage_out_main",
    "build_parser",
    "commands",
    "BUILTIN_COMMANDS",
]

#: Subcommand name -> module that defines it.
BUILTIN_COMMANDS = {
    "stage-in": "stager.cli.commands.stage_in",
    "stage-out": "stager.cli.commands.stage_out",
    "index": "stager.cli.commands.index",
    "make-dataset": "stager.cli.commands.make_dataset",
    "ls": "stager.cli.commands.ls",
    "du": "stager.cli.commands.du",
    "clean": "stager.cli.commands.clean",
}
#: Entry-point group through which other packages add commands.
COMMAND_GROUP = "stager.commands"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), like every other error here.

    argparse prints the whole usage block before the message; in a job log of hundreds of
    nodes that is a dozen lines per node for one wrong flag.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}; see --help\n")


def commands() -> dict[str, str]:
    """Every command: the built-in ones, then those other installed packages register."""
    from importlib.metadata import entry_points

    found = dict(BUILTIN_COMMANDS)
    for point in entry_points(group=COMMAND_GROUP):
        found.setdefault(point.name, point.value)
    return found


def _command_module(module: str) -> ModuleType:
    return importlib.import_module(module)


def build_parser(prog: str = "stager", *, only: str | None = None) -> argparse.ArgumentParser:
    """The umbrella parser with one subparser per command (used by the docs check too).

    ``only``: fully define just that command and leave the others as bare names, so that
    ``stager stage-in`` imports neither the other commands nor the packages they need (the
    loader's ``doctor`` needs torch; a prologue on every node should not pay for it).
    """
    parser = OneLineParser(
        prog=prog,
        description="Stage datasets to node-local scratch and checkpoints back, on SLURM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    known = dict(BUILTIN_COMMANDS) if only in BUILTIN_COMMANDS else commands()
    for name, module in known.items():
        if only is None or name == only:
            _command_module(module).add_parser(sub, name)
        else:
            sub.add_parser(name)
    return parser


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    prog = getattr(args, "prog_name", parser.prog)
    try:
        return int(args.handler(args) or 0)
    except StagerError as exc:
        for line in getattr(exc, "detail_lines", list)():
            print(line, file=sys.stderr)
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt as exc:  # Ctrl-C, or a signal a command turned into one
        why = f" ({exc.args[0]})" if exc.args else ""
        print(f"{prog}: interrupted{why}; rerun to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


def _before_start(prog: str, start: Callable[[], int]) -> int:
    """``start()``, with a Ctrl-C that lands while the command's modules are still importing
    (~0.1 s; longer on a cold page cache) said in one line and exit code, as one during the
    run is, rather than as Python's traceback. Nothing has been written by then."""
    try:
        return start()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted while starting; nothing was done", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """``stager COMMAND ...``"""
    args = list(sys.argv[1:] if argv is None else argv)
    chosen = args[0] if args and not args[0].startswith("-") else None
    return _before_start("stager", lambda: _run(build_parser(only=chosen), args))


def _single(name: str, argv: Sequence[str] | None) -> int:
    def start() -> int:
        parser = OneLineParser(prog=name)
        _command_module(BUILTIN_COMMANDS[name]).configure(parser)
        parser.set_defaults(prog_name=name)
        return _run(parser, argv)

    return _before_start(name, start)


def stage_in_main(argv: Sequence[str] | None = None) -> int:
    """``stage-in ...`` (same as ``stager stage-in ...``)."""
    return _single("stage-in", argv)


def stage_out_main(argv: Sequence[str] | None = None) -> int:
    """``stage-out ...`` (same as ``stager stage-out ...``)."""
    return _single("stage-out", argv)
