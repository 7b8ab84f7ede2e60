"""The gates record (GATES.json): written by `patch`/`check`, read by `push`, which refuses a build
whose quality gates did not all pass for this very build id. No hosts needed: the refusal happens
before any connection."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.checks.base import FAIL, PASS, SKIP, GateResult
from ddtree_deploy.checks.registry import GATES, record_gates
from ddtree_deploy.deploy.build.build import Inputs, build
from ddtree_deploy.deploy.build.buildinfo import GATES_RECORD, gates_verdict, load_build

CLI = Path(sys.executable).parent / "ddtree-deploy"
INVENTORY = """\
[hosts.gpu]
address = "127.0.0.1"
port = 1
user = "nobody"
python = "/usr/bin/python3"
restart = { strategy = "systemd", unit = "sglang.service" }
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gates") / "build"
    return build(Inputs(build_root=root)).info


@pytest.fixture
def fresh(built, tmp_path):
    """A private copy of the real build (so records written by one test do not leak)."""
    dest = tmp_path / built.root.name
    shutil.copytree(built.root, dest)
    (dest / GATES_RECORD).unlink(missing_ok=True)
    return load_build(dest)


def results(status_of: dict[int, str]) -> list[GateResult]:
    return [GateResult(g.NUMBER, g.NAME, status_of.get(g.NUMBER, PASS)) for g in GATES if g.NUMBER in status_of]


def test_verdict_needs_every_gate_and_no_failure(fresh):
    assert gates_verdict(fresh) == (False, gates_verdict(fresh)[1])
    assert "has not been through the quality gates" in gates_verdict(fresh)[1]
    rec = record_gates(fresh.root, results({1: PASS, 2: PASS}))
    assert rec["ok"] is False
    assert "no result for gate(s) 3, 4, 5, 6, 7" in gates_verdict(fresh)[1]
    # a later partial run adds to the record of the same build; a skip counts as done
    rec = record_gates(fresh.root, results({3: PASS, 4: PASS, 5: PASS, 6: SKIP, 7: PASS}))
    assert rec["ok"] is True and set(rec["gates"]) == {str(n) for n in range(1, 8)}
    assert gates_verdict(fresh) == (True, "all quality gates passed")
    on_disk = json.loads((fresh.root / GATES_RECORD).read_text())
    assert on_disk == rec and on_disk["build_id"] == fresh.build_id
    # one failure anywhere turns the verdict
    rec = record_gates(fresh.root, results({5: FAIL}))
    assert rec["ok"] is False and "failed quality gate(s) 5" in gates_verdict(fresh)[1]


def test_record_of_another_build_is_not_trusted(fresh):
    record_gates(fresh.root, results({n: PASS for n in range(1, 8)}))
    path = fresh.root / GATES_RECORD
    rec = json.loads(path.read_text())
    rec["build_id"] = "0" * 16
    path.write_text(json.dumps(rec))
    ok, why = gates_verdict(fresh)
    assert not ok and "is for build 0000000000000000" in why
    # record_gates starts over for the real build id instead of merging the stale results
    rec = record_gates(fresh.root, results({1: PASS}))
    assert rec["build_id"] == fresh.build_id and set(rec["gates"]) == {"1"} and rec["ok"] is False


def run_push(build_dir: Path, tmp_path: Path, **env_extra) -> subprocess.CompletedProcess:
    inv = tmp_path / "hosts.toml"
    inv.write_text(INVENTORY)
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_DEPLOY_ALLOW_UNGATED"}
    env.update(COLUMNS="400", **env_extra)
    return subprocess.run(
        [str(CLI), "push", "gpu", "-i", str(inv), "--build", str(build_dir)],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_push_refuses_an_ungated_build(fresh, tmp_path):
    r = run_push(fresh.root, tmp_path)
    assert r.returncode == 2, r.stderr
    assert "has not been through the quality gates" in r.stderr and r.stdout == ""
    record_gates(fresh.root, results({n: PASS for n in range(1, 8)} | {4: FAIL}))
    r = run_push(fresh.root, tmp_path)
    assert r.returncode == 2 and "failed quality gate(s) 4" in r.stderr


def test_push_of_a_gated_build_goes_on_to_the_host(fresh, tmp_path):
    record_gates(fresh.root, results({n: PASS for n in range(1, 8)}))
    r = run_push(fresh.root, tmp_path)
    # past the gates check it tries the host; port 1 on loopback refuses: unreachable (5)
    assert r.returncode == 5, r.stderr
    assert "quality gates" not in r.stderr


def test_round_trip_and_smoke_file_set_ignore_the_record(fresh):
    from ddtree_deploy.checks import gate_roundtrip
    from ddtree_deploy.checks.base import Context
    from ddtree_deploy.checks.sglang_smoke import build_files

    record_gates(fresh.root, results({n: PASS for n in range(1, 8)}))
    res = gate_roundtrip.run(Context(inputs=Inputs(build_root=fresh.root.parent)), lambda _m: None)
    assert res.status == PASS, (res.summary, res.details)
    assert set(build_files(fresh.root)) == set(fresh.files)
