#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the demo: make a small synthetic dataset, stage it to
# scratch under a simulated (or the real) Slurm job environment, and load a few batches.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python jobs/examples/demo.py "$@"
