#!/usr/bin/env bash
# Set up a fresh machine for this project: a virtualenv in .venv with the package installed.
#   scripts/setup.sh          runtime only (enough for the demo)
#   scripts/setup.sh --test   also test dependencies and the Debian packages the test tiers
#                             start for real (Slurm, munge, rsync; strace for a commit's
#                             order of system calls); needs root for apt.
# torch is installed first, pinned to 2.13.0, only when it is not importable: a bare "torch"
# requirement would otherwise pull a multi-GB CUDA build. Users bring their own torch.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if [[ $want_test == 1 ]] && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    need=()
    for pkg in munge slurmctld slurmd slurm-client rsync util-linux iproute2 procps shellcheck strace; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
    done
    if (( ${#need[@]} )); then
        echo "setup: apt-get install ${need[*]}" >&2
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
    fi
fi

PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
    # The CPU build: where the indexes this machine uses would give the CUDA build (its
    # nvidia-* packages, gigabytes), from PyTorch's CPU index instead.
    cuda=$("$VPY" -m pip install -q --dry-run --report - torch==2.13.0 2>/dev/null | "$VPY" -c '
import json, sys
try:
    plan = json.load(sys.stdin)["install"]
except Exception:
    plan = []
print(int(any(item["metadata"]["name"].startswith("nvidia-") for item in plan)))' || echo 0)
    if [[ $cuda == 1 ]]; then
        echo "setup: installing torch==2.13.0 (CPU build, from download.pytorch.org/whl/cpu)" >&2
        "$VPY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple --timeout 30 --retries 1 2>&1 \
            | grep -v "^WARNING: Location" || true
    fi
    if ! "$VPY" -W ignore -c "import torch" 2>/dev/null; then  # (no CPU index reachable)
        if [[ $cuda == 1 ]]; then
            echo "setup: PyTorch's CPU index is out of reach: torch==2.13.0 as pip finds it" >&2
        else
            echo "setup: installing torch==2.13.0 (CPU build)" >&2
        fi
        "$VPY" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
    fi
    "$VPY" -W ignore -c "import torch" || { echo "setup: torch failed to install" >&2; exit 1; }
fi
extra=""
[[ $want_test == 1 ]] && extra="[test]"
"$VPY" -m pip install -q -e ".${extra}" 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -c "import stager, stager_loaders" >/dev/null
echo "setup: ready (.venv)" >&2
