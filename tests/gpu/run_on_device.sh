#!/bin/bash
# On the GPU machine: install the offline SGLang archive, lay the overlay over it, run the
# DDTREE matrix. Usage: [PIN=0.5.13.post1] [KERNEL_TESTS=0] [PROBE_DFLASH=0] tests/gpu/run_on_device.sh OUTDIR [ddtree_e2e.py args...]
# PIN=0.5.16: one call when SITE_TAR names a site archive that holds xgrammar too (its wheel
# unpacked, lib/libxgrammar.a dropped and the bindings stripped of debug info, jedi dropped: 48 MB,
# inside the carry limit; docs/TESTING.md "Ninth session"), else two calls: one with
# .gpu/wheelhouse (extracts /tmp/site; OUTDIR=--setup-only stops there), then one with
# .gpu/xgrammar + .gpu/overlay on the warm machine.
set -uo pipefail
out=$1; shift
pin=${PIN:-0.5.13.post1}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p /tmp/site
if [ ! -d /tmp/site/sglang ]; then
  f="${SITE_TAR:-$root/.gpu/wheelhouse/sglang-site.tar.xz}"
  [ -e "$f" ] || { echo "missing $f (and no /tmp/site/sglang): build it here and carry .gpu/wheelhouse" >&2; exit 2; }
  tar -xJf "$f" -C /tmp/site
fi
if [ -d "$root/.gpu/xgrammar" ] && [ ! -d /tmp/site/xgrammar ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.gpu/xgrammar/*.whl || exit 2
fi
[ "$out" = "--setup-only" ] && { echo "site ready: $(ls /tmp/site | head -3 | tr '\n' ' ')"; exit 0; }
f="$root/.gpu/overlay/srt"
[ -e "$f" ] || { echo "missing $f: build it here (PIN=$pin tests/gpu/build_overlay.sh) and carry .gpu/overlay" >&2; exit 2; }
mkdir -p "$out"
cp -r "$root/.gpu/overlay/srt/." /tmp/site/sglang/srt/
if [ -f "$root/.gpu/flashinfer-cache.tgz" ]; then mkdir -p ~/.cache && tar -xzf "$root/.gpu/flashinfer-cache.tgz" -C ~/.cache; fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)" >> "$out/gpu.txt" 2>&1
cp "$root/.gpu/overlay/BUILD-REV" "$out/" 2>/dev/null
if [ "$pin" = "0.5.16" ]; then kernel_tests="tests/gpu/test_v2_round_cuda.py"
else kernel_tests="tests/gpu/test_verify_kernels.py tests/gpu/test_tree_build_graph.py"; fi
krc=0  # KERNEL_TESTS=0 skips them (already run on this build)
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
  (cd "$root" && timeout "${KERNEL_TIMEOUT:-300}" python3 -m pytest --noconftest -p no:cacheprovider -q -s $kernel_tests) > "$out/kernels.log" 2>&1
  krc=$?
  tail -3 "$out/kernels.log"
fi
if [ "$pin" = "0.5.16" ] && [ "${PROBE_DFLASH:-1}" != 0 ]; then  # upstream DFLASH's mixed-batch verify on its own (a hang is a finding)
  timeout 120 python3 "$root/tests/gpu/probe_dflash_mixed.py" > "$out/probe_dflash_mixed.jsonl" 2>&1
  echo "probe_dflash_mixed rc=$?" >> "$out/probe_dflash_mixed.jsonl"
fi
python3 "$root/tests/gpu/ddtree_e2e.py" --pin "$pin" --out /tmp/ddtree-run "$@"
rc=$?
[ $rc -eq 0 ] && rc=$krc
cp /tmp/ddtree-run/summary.json /tmp/ddtree-run/table.md "$out/" 2>/dev/null
tar -czf "$out/logs.tgz" -C /tmp/ddtree-run --exclude summary.json --exclude table.md . 2>/dev/null
exit $rc
