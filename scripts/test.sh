#!/usr/bin/env bash
# Set up (see scripts/setup.sh --test) and run the default test tiers. Extra arguments go to
# pytest, e.g. `scripts/test.sh -m slow` for the slow tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"
