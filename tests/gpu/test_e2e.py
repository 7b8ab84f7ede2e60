"""The DDTREE end-to-end matrix (tests/gpu/ddtree_e2e.py) as one pytest run.

Needs a CUDA GPU and the patched sglang first on PYTHONPATH, e.g. on the GPU machine:

    bash tests/gpu/run_on_device.sh OUT           # installs, lays the build over, runs the driver
    PYTHONPATH=/tmp/site python3 -m pytest --noconftest tests/gpu/test_e2e.py   # same via pytest

Environment: DDTREE_E2E_ARGS adds driver arguments (e.g. "--backends triton").
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.slow]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ddtree_info = pytest.importorskip("sglang.srt.speculative.ddtree_info",
                                  reason="the patched sglang build is not on the path")

DRIVER = Path(__file__).with_name("ddtree_e2e.py")


def test_ddtree_matrix_matches_base_and_dflash(tmp_path):
    extra = shlex.split(os.environ.get("DDTREE_E2E_ARGS", ""))
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = {
        name: rec.get("error", "mismatch")
        for name, rec in summary.items()
        if not rec["passed"]
    }
    assert summary and not failed, f"{failed}\n{proc.stdout[-4000:]}"
    # Greedy DDTREE outputs were compared with both references on every backend.
    for name, rec in summary.items():
        if "-ddtree-" in name:
            assert rec["matches_base"] is True and rec["matches_dflash"] is True, name
    assert proc.returncode == 0
