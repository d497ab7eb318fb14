"""Render the CLI reference (docs/cli.md) from the argument parsers themselves.

The reference is generated, never hand-edited, so it cannot drift from the flags: a test
regenerates it and compares (``python -m stager.cli.clidoc --check``), and
``python -m stager.cli.clidoc`` rewrites it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stager.cli.main import COMMANDS, build_parser

__all__ = ["render_cli_reference", "DEFAULT_PATH"]

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli.md"

_ENVIRONMENT = """\
## Environment variables

| variable | used by | meaning |
|---|---|---|
| `STAGER_DEST` | stage-in, doctor, loader | destination root when `--dest` is not given |
| `SLURM_JOB_ID` | all | inside a job, the destination defaults to `/scratch/$SLURM_JOB_ID` |
| `SLURM_NODEID`, `SLURM_JOB_NUM_NODES`, `SLURM_JOB_NODELIST` | stage-in | node id (start jitter, subset, fan-out) and layout |
| `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` | loader | rank and world size when torch.distributed is not initialised |
| `SLURM_RESTART_COUNT` | jobs/ templates | > 0 after a requeue: restore the newest checkpoint |
| `TMPDIR`, `USER` | stage-in | outside Slurm the destination is `${TMPDIR:-/tmp}/stager-$USER/local` |
"""

_EXIT_CODES = """\
## Exit codes

| code | name | meaning |
|---|---|---|
| 0 | ok | done |
| 1 | unexpected | a bug: please report it with the traceback |
| 2 | usage | bad flag, value or environment variable |
| 3 | source | source missing or unreadable, or shards failed after retries |
| 4 | integrity | bytes differ from the manifest's size or hash |
| 5 | destination | destination unusable (permissions, symlink, foreign owner) |
| 6 | scratch full | not enough space (refused before copying, or ran out during it) |
| 7 | checkpoint | stage-out or restore failed |
| 8 | lock | timed out waiting for another stage-in on the node |
| 9 | no checkpoint | `stage-in --checkpoint`: nothing committed yet (a first start) |
"""


def _section(name: str, parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(prog=f"stager {name}", width=100)
    usage = parser.format_usage().replace("usage: ", "").strip()
    lines = [f"## `{name}`", "", parser.description or "", "", "```text", usage, "```", ""]
    rows = ["| option | meaning |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flag = ", ".join(action.option_strings)
            if action.nargs != 0:
                flag += f" {formatter._format_args(action, action.dest.upper())}"
        else:
            flag = formatter._format_args(action, action.dest.upper())
        text = (action.help or "").replace("|", "\\|")
        if action.choices:
            text += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append(f"| `{flag}` | {text} |")
    return "\n".join(lines + rows) + "\n"


def render_cli_reference() -> str:
    """The whole of docs/cli.md."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = [
        "# CLI reference",
        "",
        "Generated from the argument parsers by `python -m stager.cli.clidoc`; a test fails when it is stale.",
        "`stage-in` and `stage-out` are also installed as standalone commands; `stager COMMAND` and",
        "`python -m stager COMMAND` are the same.",
        "",
    ]
    for name in COMMANDS:
        parts.append(_section(name, sub.choices[name]))
    parts.append(_ENVIRONMENT)
    parts.append(_EXIT_CODES)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    text = render_cli_reference()
    if "--check" in args:
        current = DEFAULT_PATH.read_text() if DEFAULT_PATH.exists() else ""
        if current != text:
            print(f"{DEFAULT_PATH} is stale: run python -m stager.cli.clidoc", file=sys.stderr)
            return 1
        return 0
    DEFAULT_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
