#!/usr/bin/env bash
# Create the project's virtual environment and install everything the tests need.
# Idempotent: a second run reuses what is there. Usage: scripts/setup_env.sh [VENV]
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."
# The deploy tests start real sshd servers in network namespaces and restart services with
# start-stop-daemon: install those system tools when we can (root + apt), else name the command.
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ip >/dev/null || need+=(iproute2)
command -v start-stop-daemon >/dev/null || need+=(dpkg)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${need[*]} (deploy test bed)"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
  else
    echo "setup: the deploy tests need ${need[*]}; install them with:" >&2
    echo "  sudo apt-get install -y ${need[*]}" >&2
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip >/dev/null
# torch + a real torchvision (SGLang imports torchvision at start). torch 2.14.1 / torchvision 0.29.1
# are the CUDA builds that lie on this kind of machine's local package store; they run on the CPU.
"$PIP" install -q "torch==2.14.1" "torchvision==0.29.1"
"$PIP" install -q -e ".[test]"
# The real sglang==0.5.13.post1 test environment (patch-series tests), when its script exists.
if [ -x scripts/install_sglang_env.sh ]; then
  scripts/install_sglang_env.sh "$VENV"
fi
echo "setup: $VENV ready ($("$VENV/bin/python" --version))"
