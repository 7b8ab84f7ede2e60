"""tests/gpu/run_on_device.sh refuses to start without the carried .gpu folder."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent / "gpu" / "run_on_device.sh"


def test_run_on_device_without_gpu_folder_says_what_is_missing(tmp_path):
    root = tmp_path / "repo"  # a checkout without .gpu (git-ignored, carried by hand)
    (root / "tests" / "gpu").mkdir(parents=True)
    script = root / "tests" / "gpu" / "run_on_device.sh"
    shutil.copy(SCRIPT, script)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(script), str(out)], check=False, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"missing {root}/.gpu/wheelhouse/sglang-site.tar.xz" in proc.stderr
    assert "carry" in proc.stderr
    assert not out.exists()  # nothing written before the check
