#!/bin/bash
# On the GPU machine: install the offline SGLang archive, lay the overlay over it, run the
# DDTREE matrix. Usage: tests/gpu/run_on_device.sh OUTDIR [ddtree_e2e.py args...]
set -uo pipefail
out=$1; shift
root=$(cd "$(dirname "$0")/../.." && pwd)
for f in "$root/.gpu/wheelhouse/sglang-site.tar.xz" "$root/.gpu/overlay/srt"; do
  [ -e "$f" ] || { echo "missing $f: build it here and name .gpu in the run tool's carry" >&2; exit 2; }
done
mkdir -p /tmp/site "$out"
if [ ! -d /tmp/site/sglang ]; then tar -xJf "$root/.gpu/wheelhouse/sglang-site.tar.xz" -C /tmp/site; fi
cp -r "$root/.gpu/overlay/srt/." /tmp/site/sglang/srt/
if [ -f "$root/.gpu/flashinfer-cache.tgz" ]; then mkdir -p ~/.cache && tar -xzf "$root/.gpu/flashinfer-cache.tgz" -C ~/.cache; fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)" >> "$out/gpu.txt" 2>&1
cp "$root/.gpu/overlay/BUILD-REV" "$out/" 2>/dev/null
(cd "$root" && python3 -m pytest --noconftest -p no:cacheprovider -q -s tests/gpu/test_verify_kernels.py tests/gpu/test_tree_build_graph.py) > "$out/kernels.log" 2>&1
krc=$?
tail -3 "$out/kernels.log"
python3 "$root/tests/gpu/ddtree_e2e.py" --out /tmp/ddtree-run "$@"
rc=$?
[ $rc -eq 0 ] && rc=$krc
cp /tmp/ddtree-run/summary.json /tmp/ddtree-run/table.md "$out/" 2>/dev/null
tar -czf "$out/logs.tgz" -C /tmp/ddtree-run --exclude summary.json --exclude table.md . 2>/dev/null
exit $rc
