"""Gate 6 (`python checks/sglang_smoke.py --build DIR`): passes on the real build, fails on a
build whose DDTREE validation is broken, and reports usage / skip with its documented codes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.checks import sglang_smoke
from ddtree_deploy.deploy.build import buildinfo

REPO = Path(__file__).resolve().parents[2]


def run_gate(build: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "checks" / "sglang_smoke.py"), "--build", str(build)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)


def last_line(text: str) -> str:
    return [ln for ln in text.splitlines() if ln.strip()][-1]


@pytest.mark.slow
def test_gate_passes_on_the_build(sglang_overlay):
    proc = run_gate(sglang_overlay.build_dir)
    assert proc.returncode == sglang_smoke.OK, proc.stdout + proc.stderr[-3000:]
    summary = last_line(proc.stdout)
    assert summary.startswith("sglang smoke passed")
    n_modules = sum(1 for rel in sglang_smoke.build_files(sglang_overlay.build_dir) if rel.endswith(".py"))
    assert f"{n_modules} modules import" in summary


@pytest.mark.slow
def test_gate_fails_when_validation_is_broken(sglang_overlay, tmp_path):
    broken = tmp_path / "build"
    shutil.copytree(sglang_overlay.build_dir, broken)
    hook = broken / "srt/speculative/ddtree_serving.py"  # the budget rule both pins call
    text = hook.read_text()
    # Break the budget derivation: budget 0 is still refused further down (the range check),
    # so the mutation makes a valid budget resolve to the wrong value.
    check = "    budget = int(budget)\n"
    assert check in text
    hook.write_text(text.replace(check, "    budget = int(budget) + 1\n", 1))
    proc = run_gate(broken)
    assert proc.returncode == sglang_smoke.FAILED
    summary = last_line(proc.stdout)
    assert summary.startswith("sglang smoke FAILED") and "DDTREE server args" in summary, summary


def test_missing_build_is_a_usage_error(tmp_path, capsys):
    assert sglang_smoke.main(["--build", str(tmp_path / "nope")]) == sglang_smoke.USAGE
    assert "not a build directory" in capsys.readouterr().err


def test_skipped_without_sglang(tmp_path, monkeypatch, capsys):
    (tmp_path / "srt").mkdir()
    (tmp_path / "srt/x.py").write_text("")
    # Test double: this Python has sglang installed; simulate one that does not.
    monkeypatch.setattr(sglang_smoke, "find_installed_sglang", lambda: None)
    assert sglang_smoke.main(["--build", str(tmp_path)]) == sglang_smoke.SKIPPED
    assert capsys.readouterr().out.startswith("skipped: sglang is not installed")


def test_overlay_never_writes_through_hard_links(tmp_path):
    installed = tmp_path / "site/sglang"
    (installed / "srt/speculative").mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    (installed / "srt/speculative/spec_info.py").write_text("UPSTREAM = True\n")
    (installed / "srt/speculative/__pycache__").mkdir()
    (installed / "srt/speculative/__pycache__/spec_info.cpython-311.pyc").write_bytes(b"stale")
    build = tmp_path / "build"
    (build / "srt/speculative").mkdir(parents=True)
    (build / "srt/speculative/spec_info.py").write_text("PATCHED = True\n")
    (build / "srt/speculative/ddtree_utils.py").write_text("NEW = True\n")
    assert sglang_smoke.METADATA_NAMES == buildinfo.METADATA_NAMES  # the two copies agree
    for name in sglang_smoke.METADATA_NAMES:  # build metadata must not land in the package
        (build / name).write_text("{}")

    root = sglang_smoke.make_overlay(build, tmp_path / "overlay", installed)
    pkg = root / "sglang"
    assert (pkg / "srt/speculative/spec_info.py").read_text() == "PATCHED = True\n"
    assert (pkg / "srt/speculative/ddtree_utils.py").read_text() == "NEW = True\n"
    assert not (pkg / "srt/speculative/__pycache__/spec_info.cpython-311.pyc").exists()
    assert not any((pkg / name).exists() for name in sglang_smoke.METADATA_NAMES)
    # The installed package is exactly as it was.
    assert (installed / "srt/speculative/spec_info.py").read_text() == "UPSTREAM = True\n"
    assert (installed / "srt/speculative/__pycache__/spec_info.cpython-311.pyc").read_bytes() == b"stale"
    assert not (installed / "srt/speculative/ddtree_utils.py").exists()


@pytest.mark.parametrize(
    ("rel", "name"),
    [("srt/server_args.py", "sglang.srt.server_args"), ("srt/speculative/__init__.py", "sglang.srt.speculative"),
     ("srt/layers/attention/x.cuh", None)],
)
def test_module_name(rel, name):
    assert sglang_smoke.module_name(rel) == name
