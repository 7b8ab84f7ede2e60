#!/usr/bin/env bash
# Install the real sglang==0.5.13.post1 (no deps) plus the minimal runtime dependencies its
# speculative / server_args modules import, into VENV. Used by the patch-series tests on CPU.
# Idempotent and quick when already installed.
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
if "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("sglang") == "0.5.13.post1" else 1)
PYEOF
then
  echo "sglang env: sglang 0.5.13.post1 already installed in $VENV"
  exit 0
fi
"$PY" -m pip install -q --no-deps "sglang==0.5.13.post1"
# Runtime imports of sglang.srt.{server_args,speculative.*,model_executor.*} on CPU
# (see shared/reference/sglang_internals.md §5). transformers is pinned to sglang's own pin.
"$PY" -m pip install -q "torch==2.14.1" "torchvision==0.29.1" "transformers==5.8.1" "openai==2.6.1" \
  numpy orjson psutil pybase64 requests triton packaging pillow starlette tqdm IPython pydantic \
  aiohttp pyzmq partial_json_parser dill sentencepiece einops compressed-tensors gguf msgspec \
  setproctitle uvicorn fastapi uvloop
echo "sglang env: installed sglang 0.5.13.post1 into $VENV"
