#!/bin/bash
# One GPU call: install the offline SGLang archive (0.5.13.post1, or 0.5.16 with --pin 0.5.16), lay the project's patched build
# over it, then train the tiny pair and measure plain / DFLASH / DDTREE (bench/acceptance_run.py).
# Usage (repo root, on the GPU machine): bash bench/acceptance_run.sh OUTDIR [acceptance_run.py args...]
# Needs .gpu/wheelhouse/sglang-site.tar.xz and .gpu/overlay/srt (tests/gpu/build_overlay.sh), carried as .gpu.
set -uo pipefail
out=${1:?usage: bench/acceptance_run.sh OUTDIR [args...]}; shift
root=$(cd "$(dirname "$0")/.." && pwd)
need="$root/.gpu/overlay/srt"
[ -d /tmp/site/sglang ] || need="$root/.gpu/wheelhouse/sglang-site.tar.xz $need"  # archive extracted already?
for f in $need; do
  [ -e "$f" ] || { echo "missing $f: build it here and name .gpu in the run tool's carry" >&2; exit 2; }
done
mkdir -p /tmp/site "$out"
if [ ! -d /tmp/site/sglang ]; then tar -xJf "$root/.gpu/wheelhouse/sglang-site.tar.xz" -C /tmp/site; fi
# 0.5.16 (two calls, as tests/gpu/run_on_device.sh): the archive first, then .gpu/xgrammar + overlay.
if [ -d "$root/.gpu/xgrammar" ] && [ ! -d /tmp/site/xgrammar ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.gpu/xgrammar/*.whl || exit 2
fi
cp -r "$root/.gpu/overlay/srt/." /tmp/site/sglang/srt/
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sglang, tokenizers; print('torch', torch.__version__, 'sglang', sglang.__version__, 'tokenizers', tokenizers.__version__)"
  cat "$root/.gpu/overlay/BUILD-REV" 2>/dev/null; } > /tmp/gpu.txt 2>&1
cat /tmp/gpu.txt
cd "$root" && python3 bench/acceptance_run.py --out "$out" "$@"
rc=$?
cp /tmp/gpu.txt "$out/gpu.txt"
exit $rc
