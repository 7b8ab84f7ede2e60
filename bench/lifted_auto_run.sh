#!/bin/bash
# One device call (issues 27 and 28): re-lift a trained small pair into the Qwen3-8B shape and
# measure DDTREE `auto+off` against plain decode (and DFLASH and DDTREE b15 when the card holds
# them) on the 0.5.16 pin, side by side; beside it, the greedy exactness of the small pair in
# float32 (plain, DFLASH, b15, auto+off), whose servers are small and done before the timing.
# Usage (repo root, on the GPU machine; carry the site, the pair and the overlay):
#   bash bench/lifted_auto_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]
# e.g. bash bench/lifted_auto_run.sh $OUT .gpu/w16x/site.tar.xz .gpu/pairx/pair.tar.xz .gpu/ov016
# An 8B-shaped server takes 20 (plain) to 35 GB (auto: a verify state per width): an H100 holds
# plain + auto only, so DFLASH and b15 run there only on a card of more than 100 GB.
# Environment: BUDGETS (e.g. 63 or 255,auto+off) and WITHOUT (e.g. DFLASH, or "" for none) replace
# that choice; F32=0 skips the float32 exactness run (it needs the 0.5.13.post1 pin to pass: 0.5.16's
# sgl_kernel RMSNorm has no float32 path); CONC (default 1,4,16,32,64) the concurrencies; WAVES (default 2)
# the requests per level in multiples of the concurrency (2 left two runs of a c >= 16 level up to 11 % apart).
# PIN=0.5.13.post1 (carry that pin's site and overlay instead) runs the v1 worker with its own
# graph flags; its default budgets are 63 with plain and DFLASH (auto is a 0.5.16 feature).
set -uo pipefail
out=${1:?usage: bench/lifted_auto_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]}
site=${2:?}; pair_tar=${3:?}; overlay=${4:?}; budget_s=${5:-470}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
pin=${PIN:-0.5.16}; conc=${CONC:-1,4,16,32,64}
if [ "$pin" != 0.5.16 ]; then budgets=63; without=()
elif [ "$mem" -gt 100000 ]; then budgets=15,auto+off; without=(); else budgets=auto+off; without=(--without DFLASH); fi
budgets=${BUDGETS:-$budgets}
if [ -n "${WITHOUT+set}" ]; then without=(); [ -n "$WITHOUT" ] && without=(--without "$WITHOUT"); fi
mkdir -p /tmp/site /tmp/px
tar -xJf "$site" -C /tmp/site && tar -xJf "$pair_tar" -C /tmp/px && cp -r "$overlay/srt/." /tmp/site/sglang/srt/ || exit 1
small=$(ls -d /tmp/px/*/ | head -1)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 "$here/lift_pair.py" --pair "$small" --out /tmp/lifted --device cuda > "$out/lift.log" 2>&1 || { tail "$out/lift.log"; exit 1; }
echo "lifted $small at $(date +%T)"
common="--skip-tokenizer-init --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.9 --random-seed 0"
if [ "$pin" = 0.5.16 ]; then common+=" --cuda-graph-backend-prefill disabled"; graph_bs=--cuda-graph-max-bs-decode
else common+=" --disable-piecewise-cuda-graph"; graph_bs=--cuda-graph-max-bs; fi
f32=
if [ "${F32:-1}" != 0 ]; then
  f32_budgets=15,auto+off; [ "$pin" = 0.5.16 ] || f32_budgets=63
  python3 "$here/acceptance_run.py" --out "$out/f32" --pin "$pin" --pair "$small" --budgets "$f32_budgets" --exactness-only \
    --dtype float32 --port-base 32000 --log-dir /tmp/f32-logs --budget-s 300 \
    --common "$common --max-total-tokens 8192 $graph_bs 8 --max-running-requests 8" > "$out/f32.out" 2>&1 &
  f32=$!
fi
python3 "$here/acceptance_run.py" --out "$out/acc" --pin "$pin" --pair /tmp/lifted --concurrency "$conc" \
  --budgets "$budgets" "${without[@]}" --waves "${WAVES:-2}" --ddtree-first --phase-times --budget-s "$budget_s" \
  --common "$common --max-total-tokens 24576 $graph_bs 64 --max-running-requests 64" 2>&1 \
  | grep -v "start \|^\s*$" | tail -40
rc=${PIPESTATUS[0]}
if [ -n "$f32" ]; then wait "$f32"; grep -h "greedy outputs" "$out/f32.out"; fi
exit "$rc"
