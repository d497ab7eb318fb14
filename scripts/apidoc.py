"""Render docs/api.md from the public names (``__all__``) of ``loaders`` and ``stager``.

``python scripts/apidoc.py`` rewrites the page; ``--check`` exits 1 when it is stale
(tests/test_docs.py runs that), so the reference cannot drift from the docstrings.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
PACKAGES = ("stager_loaders", "stager")


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def render() -> str:
    out = [
        "# Python API",
        "",
        "Generated from docstrings by `python scripts/apidoc.py`; a test fails when it is stale.",
        "",
    ]
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        out += [f"## `{package_name}`", "", inspect.getdoc(package) or "", ""]
        for name in sorted(package.__all__):
            if name.startswith("__"):
                continue
            obj = getattr(package, name)
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
            sig = _signature(obj) if kind != "value" else ""
            out += [
                f"### `{package_name}.{name}{sig}`",
                "",
                f"*{kind}*",
                "",
                inspect.getdoc(obj) or "",
                "",
            ]
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    if attr.startswith("_") or not (
                        inspect.isfunction(member) or isinstance(member, property)
                    ):
                        continue
                    doc = inspect.getdoc(member)
                    if doc:
                        msig = _signature(member) if inspect.isfunction(member) else ""
                        out += [f"- `{attr}{msig}`: {doc.splitlines()[0]}"]
                out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python scripts/apidoc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
