"""With --json, a command that fails before writing its report still writes one JSON document
(ok: false, the exit code, the message); one that already wrote its report writes no second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "ddtree-deploy"


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="400")
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=300, env=env)


def test_failure_before_the_report_is_one_json_document(tmp_path):
    bad = tmp_path / "hosts.toml"
    bad.write_text('[hosts.x]\naddress = "127.0.0.1"\nprot = 1\n')
    r = run("plan", "x", "-i", str(bad), "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and str(bad) in doc["error"]
    assert "error:" in r.stderr  # the human message still goes to stderr
    # without --json stdout stays empty
    r = run("plan", "x", "-i", str(bad))
    assert r.returncode == 2 and r.stdout == ""


def test_snapshot_error_is_reported_in_json(tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    r = run("snapshot", "verify", "--snapshot-dir", str(snap), "--json")
    assert r.returncode != 0
    doc = json.loads(r.stdout)  # exactly one document
    assert doc["ok"] is False and doc["exit_code"] == r.returncode


def test_usage_error_with_json_is_one_json_document():
    """A usage error the command line itself catches (here --serial 0) still writes the document."""
    r = run("push", "somehost", "--serial", "0", "--json")
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "--serial" in doc["error"]
