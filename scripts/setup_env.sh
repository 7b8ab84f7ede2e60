#!/usr/bin/env bash
# Create the project's virtual environment and install everything the tests need.
# Idempotent: a second run reuses what is there. Usage: scripts/setup_env.sh [VENV]
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip >/dev/null
# torch first: the CPU build that lies on this kind of machine's disk.
"$PIP" install -q "torch==2.13.0"
"$PIP" install -q -e ".[test]"
# The real sglang==0.5.13.post1 test environment (patch-series tests), when its script exists.
if [ -x scripts/install_sglang_env.sh ]; then
  scripts/install_sglang_env.sh "$VENV"
fi
echo "setup: $VENV ready ($("$VENV/bin/python" --version))"
