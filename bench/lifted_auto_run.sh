#!/bin/bash
# One device call (issues 27 and 28): re-lift a trained small pair into the Qwen3-8B shape and
# measure DDTREE `auto+off` against plain decode (and DFLASH and DDTREE b15 when the card holds
# them) on the 0.5.16 pin, side by side, with the greedy outputs compared to plain's (bf16). The
# float32 greedy check of the small pair is bench/f32_greedy_run.sh.
# Usage (repo root, on the GPU machine; carry the site, the pair and the overlay):
#   bash bench/lifted_auto_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]
# e.g. bash bench/lifted_auto_run.sh $OUT .gpu/w16x/site.tar.xz .gpu/pairx/pair.tar.xz .gpu/ov016
# An 8B-shaped server takes 20 (plain) to 35 GB (auto: a verify state per width): an H100 holds
# plain + auto only, so DFLASH and b15 run there only on a card of more than 100 GB.
# Environment: BUDGETS (e.g. 63 or 255,auto+off; auto@off: every round off, its cost against plain) and WITHOUT (e.g. DFLASH, or "" for none) replace
# that choice; CONC (default 1,4,16,32,64) the concurrencies; WAVES (default 2)
# the requests per level in multiples of the concurrency (2 left two runs of a c >= 16 level up to 11 % apart);
# ORDER=conc-first measures every server and temperature at c = 1 first, so a deadline drops high c
# (temps-first, the default, keeps auto's controller on one temperature for all its levels).
# Plain is measured after the speculative servers at each level (--plain-last).
# MAX_BS (default 64): the decode-graph batch and --max-running-requests of every server; a
# c = 1-only run with MAX_BS=4 takes less memory per server (auto's verify state per width scales
# with it), so more servers share an 80 GB card. It must cover every CONC level.
# A fixed budget of 255 or more beside plain and DFLASH on a card of <= 100 GB is refused (exit 2):
# it ran out of memory there twice; set WITHOUT=DFLASH.
# TUNE_TREE_ATTN=1 first runs bench/tree_attn_bench.py and serves its fastest setting at batch 1.
# PIN=0.5.13.post1 (carry that pin's site and overlay instead) runs the v1 worker with its own
# graph flags; its default budgets are 63 with plain and DFLASH (auto is a 0.5.16 feature).
set -uo pipefail
out=${1:?usage: bench/lifted_auto_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]}
site=${2:?}; pair_tar=${3:?}; overlay=${4:?}; budget_s=${5:-470}
here=$(cd "$(dirname "$0")" && pwd)
conc=${CONC:-1,4,16,32,64}
max_bs=${MAX_BS:-64}
for c in ${conc//,/ }; do
  if ! [ "$c" -le "$max_bs" ] 2>/dev/null; then echo "CONC level $c is above MAX_BS $max_bs (or not a number)" >&2; exit 2; fi
done
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
# The servers: 0.5.16 on a card of > 100 GB holds plain, DFLASH, b15 and auto+off; on a smaller
# one plain and auto+off (lifted_setup's pin is PIN too).
if [ "${PIN:-0.5.16}" != 0.5.16 ]; then budgets=63; without=()
elif [ "${mem:-0}" -gt 100000 ]; then budgets=15,auto+off; without=(); else budgets=auto+off; without=(--without DFLASH); fi
budgets=${BUDGETS:-$budgets}
if [ -n "${WITHOUT+set}" ]; then without=(); [ -n "$WITHOUT" ] && without=(--without "$WITHOUT"); fi
# b255 beside plain and DFLASH runs out of memory on an 80 GB card (thirteenth and sixteenth
# sessions: 20 + 26 + 32 GB, then a 4.6 GiB logits copy): refused before any setup.
if [[ ",${without[1]:-}," != *,DFLASH,* ]] && [ "${mem:-0}" -le 100000 ]; then
  for b in ${budgets//,/ }; do
    if [[ "$b" =~ ^[0-9]+$ ]] && [ "$b" -ge 255 ]; then
      echo "BUDGETS has b$b: it does not fit beside plain and DFLASH on this ${mem} MiB card; set WITHOUT=DFLASH" >&2; exit 2
    fi
  done
fi
# shellcheck source=bench/lifted_setup.sh
source "$here/lifted_setup.sh"
lifted_setup "$out" "$site" "$pair_tar" "$overlay" || exit 1
if [ "${TUNE_TREE_ATTN:-0}" = 1 ]; then  # time the tree attention's launch settings, serve the fastest at batch 1
  python3 "$here/tree_attn_bench.py" --json "$out/tree_attn.json" \
    --apply /tmp/site/sglang/srt/speculative/ddtree_utils.py 2>&1 | tee "$out/tree_attn.txt" | tail -12
fi
python3 "$here/acceptance_run.py" --out "$out/acc" --pin "$pin" --pair /tmp/lifted --concurrency "$conc" \
  --budgets "$budgets" "${without[@]}" --waves "${WAVES:-2}" --order "${ORDER:-temps-first}" --ddtree-first --plain-last --phase-times --budget-s "$budget_s" \
  --common "$common --max-total-tokens 24576 $graph_bs $max_bs --max-running-requests $max_bs" 2>&1 \
  | grep -v "start \|^\s*$" | tail -40
exit "${PIPESTATUS[0]}"
