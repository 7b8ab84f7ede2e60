#!/bin/bash
# One device call: where the serving round's time goes at concurrency 1 (bench/round_profile.py,
# bench/trace_gaps.py) for plain, DFLASH and DDTREE on the lifted pair: GPU busy and idle time per
# step and the host frames in the idle time, one report per configuration under OUT/prof/.
# Usage (repo root, on the GPU machine; carry the site, the pair and the overlay as for
# bench/lifted_auto_run.sh):
#   bash bench/lifted_profile_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR
# Environment: PIN (default 0.5.16), BUDGETS (default 63), STEPS (default 30: a with_stack trace of the
# scheduler is large, and SGLang writes it while the server waits), TEMP (default 0).
set -uo pipefail
out=${1:?usage: bench/lifted_profile_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR}
site=${2:?}; pair_tar=${3:?}; overlay=${4:?}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=bench/lifted_setup.sh
source "$here/lifted_setup.sh"
lifted_setup "$out" "$site" "$pair_tar" "$overlay" || exit 1
python3 "$here/round_profile.py" --out "$out/prof" --pin "$pin" --pair /tmp/lifted --budgets "${BUDGETS:-63}" \
  --steps "${STEPS:-30}" --temperature "${TEMP:-0}" --log-dir /tmp/round-profile-logs --trace-timeout 240 \
  --common "$common --max-total-tokens 16384 $graph_bs 8 --max-running-requests 8" 2>&1 | tail -120
rc=${PIPESTATUS[0]}
# The device returns a handful of files from $OUT: one archive of the per-configuration folders
# (gaps.json / gaps.txt / the kept traces) beside round_profile.json and the comparisons.
if compgen -G "$out/prof/*/" > /dev/null; then
  (cd "$out/prof" && tar -czf ../prof-details.tgz -- */ && rm -rf -- */)
fi
exit "$rc"
