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


def _load_round_cost():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "round_cost", Path(__file__).parents[1] / "bench" / "round_cost.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_round_cost_phase_table_reads_the_workers_gpu_and_host_line(tmp_path):
    """bench/round_cost.py parses the line DDTreePhaseTimer (0.5.16 patch 0004) logs; the
    format string is taken from the patch itself so the two cannot drift apart."""
    import json

    rc = _load_round_cost()
    patch = (Path(__file__).parents[1] / "patches" / "0.5.16" / "0004-ddtree-worker-v2.patch").read_text()
    fmt = next(ln for ln in patch.splitlines() if "DDTREE phase ms bs=" in ln).strip("+ ").strip('",')
    gpu = {p: 1.0 + i for i, p in enumerate(rc._PHASES)}
    host = {p: 0.5 for p in rc._PHASES}
    line = fmt % (4, 50, json.dumps(gpu), json.dumps(host))
    (tmp_path / "rc-ddtree_b15.log").write_text(f"[2026-12-04 00:00:00] {line}\n")
    table = rc.phase_table(str(tmp_path), ["ddtree_b15", "dflash"])
    row = next(r for r in table.splitlines() if r.startswith("| ddtree_b15 | 4 | 50 |"))
    assert "3.000 (0.500)" in row  # verify: GPU 3.0, host 0.5
    assert row.endswith(f"| {sum(gpu.values()):.3f} ({sum(host.values()):.3f}) |")


def test_round_cost_table_compares_every_ddtree_server_with_dflash_of_the_same_run():
    rc = _load_round_cost()
    res = [
        {"config": "dflash", "bs": 1, "round_ms": 8.0},
        {"config": "ddtree_b15", "bs": 1, "round_ms": 8.8},
        {"config": "ddtree_b15_ext", "bs": 1, "round_ms": 8.2},
        {"config": "ddtree_b63_ext", "bs": 1, "round_ms": 9.0},
        {"config": "ddtree_b63_ext", "bs": 4, "error": "timed out"},
        {"config": "ddtree_b63", "error": "server not ready"},
    ]
    table = rc.table(res, [1, 4])
    lines = table.splitlines()
    assert lines[0] == ("| batch | dflash | ddtree_b15 | ddtree_b15_ext | ddtree_b63_ext | "
                        "ddtree_b15 / DFLASH | ddtree_b15_ext / DFLASH | ddtree_b63_ext / DFLASH |")
    assert lines[2] == "| 1 | 8.00 | 8.80 | 8.20 | 9.00 | 1.100 | 1.025 | 1.125 |"
    assert lines[3] == "| 4 | - | - | - | - | - | - | - |"
    assert "- ddtree_b15 <= 1.05x DFLASH at bs 1: MISSED" in lines
    assert "- ddtree_b15_ext <= 1.05x DFLASH at bs 1: met" in lines
    assert "- ddtree_b63_ext <= 1.2x DFLASH at bs 1: met" in lines
    # a server that never came up is named, not a crash of the table
    assert "- not measured: ddtree_b63 (server not ready)" in lines
    assert rc.SERVER_ENV["ddtree_b15_ext"] == {"SGLANG_DDTREE_TREE_ATTENTION": "0"}
