#!/usr/bin/env bash
# Set up (see scripts/setup.sh --test) and run the default test tiers. Extra arguments go to
# pytest, e.g. `scripts/test.sh -m slow` for the slow tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# The compiled helpers must have been built: without them the fallback paths would pass alone.
export STAGER_NATIVE_TAR=1 STAGER_NATIVE_STAT=1 STAGER_NATIVE_COPY=1
# Lint and types first (configured in pyproject.toml): seconds, and they fail with a file:line.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
