#!/bin/bash
# One device call: start auto, plain, DFLASH and b15 on the lifted pair one at a time, each with
# SGLang's default memory settings on the whole card (no --max-total-tokens, no
# --mem-fraction-static, default graphs), and load each at c = 64 and 256 (bench/default_start.py:
# does it start, its KV tokens, its graphs' memory, its largest batch).
# Usage (repo root, on the GPU machine; carry the site, the pair and the overlay as for
# bench/lifted_auto_run.sh):
#   bash bench/default_start_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]
# Environment: CONFIGS (default auto,plain,DFLASH,b15, in start order), CONC (default 64,256).
set -uo pipefail
out=${1:?usage: bench/default_start_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [BUDGET_S]}
site=${2:?}; pair_tar=${3:?}; overlay=${4:?}; budget_s=${5:-480}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=bench/lifted_setup.sh
source "$here/lifted_setup.sh"
lifted_setup "$out" "$site" "$pair_tar" "$overlay" || exit 1
python3 "$here/default_start.py" --out "$out/ds" --pair /tmp/lifted --configs "${CONFIGS:-auto,plain,DFLASH,b15}" \
  --concurrency "${CONC:-64,256}" --budget-s "$budget_s" 2>&1 | grep -v "start \|^\s*$" | tail -30
exit "${PIPESTATUS[0]}"
