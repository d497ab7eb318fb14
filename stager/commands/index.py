"""`stager index`: being built (see the open issue); parses nothing yet."""

from __future__ import annotations

import argparse

from ..errors import UsageError

HELP = "index (not available yet)"


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    configure(sub.add_parser(name, help=HELP, description=HELP))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    raise UsageError("index is not available in this version yet")
