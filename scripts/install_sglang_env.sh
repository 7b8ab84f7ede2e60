#!/usr/bin/env bash
# Install the real SGLang of every pin for the CPU tests and quality gate 6 (smoke), into VENV.
# Idempotent and quick when already installed. Usage: scripts/install_sglang_env.sh [VENV]
#
#   0.5.13.post1  into the venv itself (sglang --no-deps plus the runtime dependencies its
#                 speculative / server_args modules import; torch 2.14.1 CPU-capable)
#   0.5.16        into VENV/sglang-sites/0.5.16 (pip --no-deps --target: sglang 0.5.16 and the
#                 packages whose versions differ from the venv's), put ahead of the venv's own
#                 site-packages on PYTHONPATH by whoever runs it (deploy.build.pins.sglang_env)
#
# A pin's site is VENV/sglang-sites/<version>/; `ddtree-deploy check` (gate 6) and the tests look
# for it there (or under $DDTREE_SGLANG_SITES/<version>/ when that is set).
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
SITES="$VENV/sglang-sites"

installed() {  # installed VERSION [PYTHONPATH]: the sglang that python imports is VERSION
  PYTHONPATH="${2:-}" "$PY" - "$1" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("sglang") == sys.argv[1] else 1)
PYEOF
}

# -- 0.5.13.post1: in the venv ------------------------------------------------------------------
if installed 0.5.13.post1; then
  echo "sglang env: sglang 0.5.13.post1 already installed in $VENV"
else
  "$PY" -m pip install -q --no-deps "sglang==0.5.13.post1"
  # Runtime imports of sglang.srt.{server_args,speculative.*,model_executor.*} on CPU
  # (see shared/reference/sglang_internals.md §5). transformers is pinned to sglang's own pin.
  "$PY" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" "transformers==5.8.1" "openai==2.6.1" \
    numpy orjson psutil pybase64 requests triton packaging pillow starlette tqdm IPython pydantic \
    aiohttp pyzmq partial_json_parser dill sentencepiece einops compressed-tensors gguf msgspec \
    setproctitle uvicorn fastapi uvloop
  echo "sglang env: installed sglang 0.5.13.post1 into $VENV"
fi

# -- 0.5.16: a --target site over the venv --------------------------------------------------------
# sglang 0.5.16 needs newer transformers / huggingface-hub (2.x of the hub needs httpx2: keep 1.x),
# xgrammar 0.2 with its tvm-ffi, and openai-harmony; everything else comes from the venv.
site="$SITES/0.5.16"
if [ -f "$site/sglang/__init__.py" ] && installed 0.5.16 "$site"; then
  echo "sglang env: sglang 0.5.16 already installed in $site"
else
  mkdir -p "$SITES"
  tmp="$SITES/.0.5.16.tmp$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip install -q --no-deps --target "$tmp" "sglang==0.5.16" "transformers==5.12.1" \
    "huggingface-hub==1.33.0" "xgrammar==0.2.1" "apache-tvm-ffi==0.1.11" "openai-harmony==0.0.4"
  rm -rf "$site"
  mv "$tmp" "$site"
  trap - EXIT
  installed 0.5.16 "$site" || { echo "sglang env: $site does not import as sglang 0.5.16" >&2; exit 1; }
  echo "sglang env: installed sglang 0.5.16 into $site"
fi
