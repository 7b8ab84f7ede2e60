#!/bin/bash
# One device call (issue 27 item 5): the small trained pair's greedy outputs in float32 under
# plain, DFLASH and DDTREE (b15, b63), compared token for token with the plain target's: where bf16
# breaks a tie differently between configurations, float32 should not.
# Usage (repo root, on the GPU machine): bash bench/f32_greedy_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [PIN]
# Neither pin's sgl_kernel has a float32 RMSNorm ("failed to dispatch data type Float" on 0.5.13.post1
# and 0.5.16), so the servers of this run take SGLang's own torch-native forward of every
# MultiPlatformOp (RMSNorm, SiluAndMul, RoPE: `forward_native`, what SGLang runs on CPU): a gate in
# MultiPlatformOp.dispatch_forward, set by DDTREE_NATIVE_OPS=1 for these servers only. All three
# configurations run the same ops, so a difference left is not a kernel's.
set -uo pipefail
out=${1:?usage: bench/f32_greedy_run.sh OUT SITE_TAR_XZ PAIR_TAR_XZ OVERLAY_DIR [PIN]}
site=${2:?}; pair_tar=${3:?}; overlay=${4:?}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=bench/lifted_setup.sh
source "$here/lifted_setup.sh"
PIN=${5:-0.5.13.post1} device_setup "$out" "$site" "$pair_tar" "$overlay" || exit 1
python3 "$here/native_ops_gate.py" /tmp/site/sglang/srt/layers/utils/multi_platform.py || exit 1
DDTREE_NATIVE_OPS=1 python3 "$here/acceptance_run.py" --out "$out/f32" --pin "$pin" --pair "$small" --budgets 15,63 \
  --exactness-only --dtype float32 --port-base 32000 --log-dir "$out/logs" --budget-s 300 \
  --common "$common $graph_bs 8 --max-total-tokens 8192 --max-running-requests 8" 2>&1 \
  | grep -v "^\s*$" | tail -25
