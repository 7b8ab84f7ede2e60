"""The report always matches the host (issue 29): faults and states a new user meets, each on the
real sshd test bed (ct200: loopback sshd + systemd shim; `local`: start-stop-daemon), each ending
with the same four checks (`settled`):

* the host's package tree byte for byte what the tool reports (status's state, verify and files),
* every journal on the host finished (a terminal step), no lock left,
* the exit code and the result row's code as docs/DEPLOY.md's table says,
* the local record's outcome (deploy-state/<host>.jsonl) what happened.

They share the session's test bed and one module setup; most take 5-60 s on 2 cores (a push with
its restart and health gate is ~15 s); the two over a minute say why."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.build.buildinfo import sha256_file
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(600)]

TERMINAL = ("healthy", "rolled-back", "aborted")


def tree_after(before: dict[str, str], build) -> dict[str, str]:
    out = dict(before)
    out.update({rel: sha256_file(build.path_of(rel)) for rel in build.files})
    return out


def journals(h) -> dict[str, list[dict]]:
    root = h.state / "releases"
    out = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        p = d / "journal.jsonl"
        if p.is_file():
            out[d.name] = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return out


def local_records(env, host: str) -> list[dict]:
    p = os.path.join(env["DDTREE_DEPLOY_STATE"], f"{host}.jsonl")
    return [json.loads(x) for x in open(p).read().splitlines()] if os.path.isfile(p) else []


def result(r: subprocess.CompletedProcess, host: str = "ct200") -> dict:
    assert r.stdout.strip(), (r.returncode, r.stderr[-3000:])
    return next(o for o in json.loads(r.stdout)["results"] if o["host"] == host)


def settled(h, env, *, tree: dict[str, str], state: str | None, code: int, r: subprocess.CompletedProcess,
            outcome: str, host: str = "ct200") -> dict:
    """The four checks; returns `status --json`."""
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    if r.stdout.strip():
        doc = json.loads(r.stdout)
        rows = [o for o in doc.get("results") or [] if o["host"] == host]
        assert not rows or rows[0]["code"] == code, rows
    assert local_records(env, host)[-1]["outcome"] == outcome, local_records(env, host)[-1]
    st = run_cli(["status", host, "--json"], env)
    s = json.loads(st.stdout)
    assert tb.tree_digest(h.sglang) == tree, sorted(set(tb.tree_digest(h.sglang).items()) ^ set(tree.items()))[:4]
    assert (s.get("current") or {}).get("state", "pristine") == (state or "pristine"), s.get("current")
    assert all(v == "ok" for v in s["verify"].values()), s["verify"]
    for rid, j in journals(h).items():
        assert j[-1]["step"] in TERMINAL, (rid, j)
    assert not (h.state / "lock").exists()
    return s


@pytest.fixture(scope="module")
def setup(bed, builds, site_cache, tmp_path_factory):
    """ct200 without the import check (fast), a 60 s health deadline; `other`: a second healthy build."""
    h, good = bed["hosts"]["ct200"], builds["good"]
    root = tmp_path_factory.mktemp("report")
    inv = root / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False))
    utils = "srt/speculative/ddtree_utils.py"
    other = tb.derive_build(good, root / "other", {utils: good.path_of(utils).read_bytes() + b"\n# another healthy build\n"})
    return h, inv, other


@pytest.fixture
def env(setup, cli_env):
    return dict(cli_env, DDTREE_DEPLOY_HOSTS=str(setup[1]))


def replace_file(path, data: bytes) -> None:
    """Edit a host file the way an editor does (new inode; the shared cache stays untouched)."""
    tmp = path.with_name(path.name + ".edit")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def newest_release(h) -> dict:
    d = max((h.state / "releases").iterdir())
    return json.loads((d / "release.json").read_text())


def fresh(h, good, site_cache, env) -> tuple[dict, dict, str]:
    """ct200 pristine, then the good build pushed: (pristine tree, good tree, release id)."""
    tb.reset_host(h, good, site_cache)
    pristine = tb.tree_digest(h.sglang)
    r = run_cli(["push", "ct200", "--build", str(good.root), "--json"], env)
    assert r.returncode == 0, r.stderr[-3000:]
    return pristine, tree_after(pristine, good), result(r)["release"]


# -- 1. a lost connection is reported as one: exit 5 before any change, 8 when left unfinished ------------
def test_connection_cut_during_the_first_host_read_is_exit_5(setup, builds, site_cache, env):
    """The connection dies while the host's facts are being read (the library reports exit status -1):
    exit 5, the host as it was, the lock freed after reconnecting."""
    h, _, other = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    r = run_cli(["push", "ct200", "--build", str(other.root), "--json"], dict(env, DDTREE_TEST_FAULT="cut@facts#1"))
    res = result(r)
    assert "connection lost" in res["message"] and not res["changed"] and not res["restarted"], res
    assert res["message"].count("ct200:") == 1, res["message"]
    settled(h, env, tree=after, state=rid, code=5, r=r, outcome="unreachable")


def test_connection_cut_during_verify_is_exit_5_and_aborts_the_release(setup, builds, site_cache, env):
    """The connection dies during verify (before the swap); reconnecting works: the release is
    aborted on the host, exit 5, the host as it was."""
    h, _, other = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    r = run_cli(["push", "ct200", "--build", str(other.root), "--json"], dict(env, DDTREE_TEST_FAULT="cut@verify#1"))
    res = result(r)
    assert "connection lost" in res["message"] and "unchanged" in res["message"] and not res["changed"], res
    settled(h, env, tree=after, state=rid, code=5, r=r, outcome="unreachable")
    assert newest_release(h)["outcome"] == "aborted"


def test_connection_cut_during_verify_for_good_is_exit_8(setup, builds, site_cache, env):
    """Same, but the network stays down: exit 8 (the journal is at `staged`); the next command (status)
    finishes it: aborted, the host as it was."""
    h, _, other = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    r = run_cli(["push", "ct200", "--build", str(other.root), "--json"],
                dict(env, DDTREE_TEST_FAULT="cut@verify#1", DDTREE_TEST_FAULT_REFUSE_RECONNECT="1"))
    res = result(r)
    assert "connection lost" in res["message"] and "UNFINISHED" in res["message"], res
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    settled(h, env, tree=after, state=rid, code=8, r=r, outcome="unfinished")
    assert newest_release(h)["outcome"] == "aborted"


# -- 2. rollback after an unfinished push ------------------------------------------------------------------
def test_rollback_after_an_unfinished_push_reports_what_it_did(setup, builds, site_cache, env):
    """A push killed right after its swap leaves the new files and an unfinished journal; `rollback`
    finishes it (puts the previous files back, restarts) and says so, exit 0, changed."""
    h, _, other = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    k = run_cli(["push", "ct200", "--build", str(other.root)], dict(env, DDTREE_TEST_FAULT="kill@apply#1"))
    assert k.returncode == -9, k.stderr[-2000:]
    left = {k: v for k, v in tb.tree_digest(h.sglang).items() if ".ddtree-" not in k.rpartition("/")[2]}
    assert left == tree_after(after, other)  # the new files, and the `.old` links the recovery restores from
    r = run_cli(["rollback", "ct200", "--json"], env)
    res = result(r)
    assert res["ok"] and res["changed"] and res["restarted"] and "unfinished" in res["message"], res
    s = settled(h, env, tree=after, state=rid, code=0, r=r, outcome="done")
    assert s["healthy"]


# -- 3. drift is what is on disk ---------------------------------------------------------------------------
def test_a_hand_edit_put_back_by_rollback_shows_as_drift(setup, builds, site_cache, env):
    """push --force over a hand-edited file, then rollback: the edit is back on disk, and status,
    plan and push all see it (drifted), whatever put it there. Over 60 s on 2 cores: three
    transitions (push, push --force, rollback), each with a restart and a health gate."""
    h, _, other = setup
    good = builds["good"]
    _, after, rid = fresh(h, good, site_cache, env)
    rel = "srt/speculative/ddtree_utils.py"
    edited = (h.sglang / rel).read_bytes() + b"# hand edit on the host\n"
    replace_file(h.sglang / rel, edited)
    assert run_cli(["push", "ct200", "--build", str(other.root), "--force"], env).returncode == 0
    r = run_cli(["rollback", "ct200", "--json"], env)
    tree = dict(after, **{rel: hashlib.sha256(edited).hexdigest()})
    s = settled(h, env, tree=tree, state=rid, code=0, r=r, outcome="done")
    assert s["drift"] == [rel], s
    st = run_cli(["status", "ct200", "--build", str(good.root), "--json"], env)
    assert st.returncode == 1 and "changed outside this tool" in st.stderr, st.stderr[-2000:]
    assert json.loads(st.stdout)["files"][rel] == "drifted"
    p = json.loads(run_cli(["plan", "ct200", "--build", str(good.root), "--json"], env).stdout)
    assert {f["relpath"]: f["status"] for f in p["facts"]["files"]}[rel] == "drifted"
    r = run_cli(["push", "ct200", "--build", str(good.root), "--json"], env)
    assert r.returncode == 6 and f"{rel} (drifted)" in result(r)["message"], r.stderr[-2000:]
    assert tb.tree_digest(h.sglang) == tree


# -- 4. a stopped service is seen ------------------------------------------------------------------------
def test_push_of_the_build_in_place_starts_a_stopped_service(setup, builds, site_cache, env):
    """The service is stopped: push of the build already there restarts it (health gate), says so;
    `ddtree-deploy restart` does the same on request. Both journaled, nothing else changed. Over
    60 s on 2 cores: a push and two restarts, each with the health gate, and three status calls."""
    h, _, _ = setup
    good = builds["good"]
    _, after, rid = fresh(h, good, site_cache, env)
    systemctl = str(h.root / "bin" / "systemctl")
    tb.sh(systemctl, "stop", "sglang")
    st = run_cli(["status", "ct200", "--json"], env)
    assert st.returncode == 1 and json.loads(st.stdout)["service"] == "stopped"
    r = run_cli(["push", "ct200", "--build", str(good.root), "--json"], env)
    res = result(r)
    assert res["restarted"] and not res["changed"] and "service was stopped" in res["message"], res
    s = settled(h, env, tree=after, state=rid, code=0, r=r, outcome="restarted")
    assert s["healthy"] and s["service"] == "running"
    tb.sh(systemctl, "stop", "sglang")
    r = run_cli(["restart", "ct200", "--json"], env)
    res = result(r)
    assert res["ok"] and res["restarted"] and not res["changed"], res
    s = settled(h, env, tree=after, state=rid, code=0, r=r, outcome="restarted")
    assert s["healthy"]


# -- 6. a second fault during the automatic rollback keeps the first cause ---------------------------------
def test_a_fault_during_the_automatic_rollback_keeps_the_first_cause(setup, builds, site_cache, env):
    """The new build's service dies at start (the first cause, with its log tail); the automatic
    rollback restores the files, then the connection drops for good: exit 8, and the message, the
    log tail and (after the next command finishes it) release.json still name the first cause.
    Over 60 s on 2 busy cores: a fresh push, the failing one with its rollback and the next command's
    recovery each restart the service (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, _, _ = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    r = run_cli(["push", "ct200", "--build", str(builds["bad_service"].root), "--json"],
                dict(env, DDTREE_TEST_FAULT="drop@apply#2", DDTREE_TEST_FAULT_REFUSE_RECONNECT="1"))
    res = result(r)
    assert "not running" in res["message"] and "connection lost" in res["message"], res["message"]
    assert "UNFINISHED" in res["message"] and "fails at import inside the service" in (res["detail"] or ""), res
    failed = newest_release(h)["id"]
    s = settled(h, env, tree=after, state=rid, code=8, r=r, outcome="unfinished")
    assert s["healthy"]
    rec = json.loads((h.state / "releases" / failed / "release.json").read_text())
    assert rec["outcome"] == "rolled-back" and "not running" in rec["error"], rec["error"]


# -- 8. a failed canary stops the rollout ------------------------------------------------------------------
def test_serial_rollout_stops_at_the_first_failed_host(bed, setup, builds, site_cache, env, tmp_path):
    """push ct200 local --serial 1: ct200 (the canary) fails and is rolled back, so `local` is not
    touched; the table and --json name it. --max-failures without --serial is a usage error (exit 2,
    with a JSON document under --json). Over 60 s on 2 busy cores: a fresh push, the canary's
    failing push and its rollback each restart the service (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, _, _ = setup
    loc = bed["hosts"]["local"]
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False)
                   + host_toml(bed["ssh"], loc, bed["supervisor"], deadline=60, import_check=False))
    env2 = dict(env, DDTREE_DEPLOY_HOSTS=str(inv))
    loc_before, loc_records = tb.tree_digest(loc.sglang), local_records(env, "local")
    r = run_cli(["push", "ct200", "local", "--serial", "1", "--build", str(builds["bad_service"].root), "--json"], env2)
    doc = json.loads(r.stdout)
    assert doc["untouched"] == ["local"] and [o["host"] for o in doc["results"]] == ["ct200"], doc
    assert "not touched" in r.stderr and "local" in r.stderr.rpartition("not touched")[2], r.stderr[-2000:]
    assert result(r)["extra"]["rolled_back"], result(r)
    settled(h, env2, tree=after, state=rid, code=1, r=r, outcome="failed-rolled-back")
    assert tb.tree_digest(loc.sglang) == loc_before and local_records(env, "local") == loc_records
    m = run_cli(["push", "ct200", "--max-failures", "1", "--build", str(builds["good"].root), "--json"], env2)
    assert m.returncode == 2 and "--serial" in m.stderr and json.loads(m.stdout)["exit_code"] == 2, m.stderr[-1000:]


# -- 7. a full state disk during the upload is not a lost connection ---------------------------------------
def test_a_full_state_disk_during_upload_is_reported_as_such(setup, builds, site_cache, env):
    """ct200's state dir on a tmpfs (mounted for the whole machine: sshd's sessions see it) just big
    enough for the preflight, filled after the first upload: the SFTP write fails on the host while
    the connection is fine. Exit 1 naming the upload and the free space (not 'connection lost',
    not 8), the release aborted, the package untouched."""
    h, _, _ = setup
    good = builds["good"]
    tb.reset_host(h, good, site_cache)
    pristine = tb.tree_digest(h.sglang)
    old = sum((h.sglang / rel).stat().st_size for rel in good.files if (h.sglang / rel).is_file())
    need_mb = (sum(f.size for f in good.files.values()) + old) // (1 << 20) + 1 + 64  # space_shortfall, min_free_mb 64
    h.state.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={need_mb + 8}m", "ddtree-report-enospc", str(h.state)], check=True)
    try:
        filler = h.state / ".enospc-filler"
        r = run_cli(["push", "ct200", "--build", str(good.root), "--json"],
                    dict(env, DDTREE_TEST_FAULT="fill@put#1", DDTREE_TEST_FAULT_FILL=str(filler)))
        res = result(r)
        assert "upload of" in res["message"] and "kB free" in res["message"], res["message"]
        assert "connection lost" not in res["message"] and not res["changed"], res
        filler.unlink()
        settled(h, env, tree=pristine, state=None, code=1, r=r, outcome="failed")
        assert newest_release(h)["outcome"] == "aborted"
    finally:
        subprocess.run(["umount", str(h.state)], check=False)


# -- 9. the small ones --------------------------------------------------------------------------------------
def test_a_python_without_sglang_is_a_configuration_error(bed, setup, builds, site_cache, env, tmp_path):
    """`python` in the inventory names an interpreter without sglang: exit 2 (configuration), the
    host untouched, the lock freed, the local record `config-error`."""
    h, _, _ = setup
    _, after, rid = fresh(h, builds["good"], site_cache, env)
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False)
                   .replace(f'python = "{h.python}"', 'python = "/usr/bin/python3"'))
    r = run_cli(["push", "ct200", "--build", str(builds["good"].root), "--json"], dict(env, DDTREE_DEPLOY_HOSTS=str(inv)))
    assert "sglang is not importable" in result(r)["message"], result(r)
    settled(h, env, tree=after, state=rid, code=2, r=r, outcome="config-error")


def test_messages_name_the_host_once(setup, builds, site_cache, env):
    """push (a change, a no-op), plan, status, rollback (a refusal, later one that works) and, with
    the lock held by a run on another machine, push, rollback, restart, plan and status: no
    message says the host twice in a row (`ct200: ct200: ...`), the table's message column does not
    repeat the host column, the final error line names it once, and the lock refusal hints at
    `unlock ct200 --force` (a plain `unlock` refuses a holder on another machine). `plan --help`
    says that plan may finish an earlier run's transition. Over 60 s on 2 cores (about 80 s): three
    pushes and a rollback with their health gates and a dozen other commands, to see the messages
    of each command and path once."""
    h, _, other = setup
    good = builds["good"]
    tb.reset_host(h, good, site_cache)
    pristine = tb.tree_digest(h.sglang)
    runs: list[tuple[tuple, subprocess.CompletedProcess]] = []

    def cli(*args: str) -> subprocess.CompletedProcess:
        r = run_cli([*args, "--json"], env)
        runs.append((args, r))
        return r

    assert cli("push", "ct200", "--build", str(good.root)).returncode == 0
    assert "nothing to do" in result(cli("push", "ct200", "--build", str(good.root)))["message"]
    assert cli("plan", "ct200", "--build", str(other.root)).returncode == 0
    assert cli("status", "ct200").returncode == 0
    assert cli("rollback", "ct200", "--to", "no-such-release").returncode == 6
    (h.state / "lock").mkdir()  # a run on another machine holds the lock
    (h.state / "lock" / "owner.json").write_text(json.dumps(
        {"owner": "ops@elsewhere", "machine": "elsewhere", "pid": 4242, "time": time.time(), "action": "push",
         "release": None, "token": "0123456789abcdef"}))
    for args in (("push", "ct200", "--build", str(other.root)), ("rollback", "ct200"), ("restart", "ct200")):
        r = cli(*args)
        assert r.returncode == 6 and "`ddtree-deploy unlock ct200 --force`" in result(r)["message"], (args, r.stderr[-2000:])
    plan = cli("plan", "ct200", "--build", str(other.root))
    assert any("lock held by ops@elsewhere" in x for x in json.loads(plan.stdout)["refusals"]), plan.stdout[-2000:]
    assert json.loads(cli("status", "ct200").stdout)["lock"]["owner"] == "ops@elsewhere"
    assert run_cli(["unlock", "ct200"], env).returncode == 6  # another machine: refused without --force
    assert run_cli(["unlock", "ct200", "--force"], env).returncode == 0
    assert cli("push", "ct200", "--build", str(other.root)).returncode == 0
    r = cli("rollback", "ct200")  # back to the good build (ct200's service runs DDTREE: not to pristine)
    assert r.returncode == 0 and tb.tree_digest(h.sglang) == tree_after(pristine, good), r.stderr[-2000:]
    for args, r in runs:
        text = r.stdout + r.stderr
        assert "ct200: ct200:" not in text, (args, text[-3000:])
        for line in r.stderr.splitlines():
            if line.startswith("│ ct200 "):  # a row of the result table: the host column names it
                assert not line.split("│")[8].strip().startswith("ct200"), (args, line)
            if line.startswith("error:"):
                assert not re.search(r"ct200 failed \(exit \d+\): ct200: ", line), (args, line)
    helptext = run_cli(["plan", "--help"], env)
    words = " ".join(helptext.stdout.replace("│", " ").split())
    assert helptext.returncode == 0 and "finishes a transition an earlier run left unfinished" in words, words


def test_free_space_below_10_mb_is_shown_in_kb(builds):
    """The preflight's shortfall names a nearly full filesystem in kB (500 kB free is not `0 MB`);
    the facts are built here as the agent reports them (no host needed)."""
    from ddtree_deploy.deploy.remote.facts import HostFacts
    from ddtree_deploy.deploy.remote.plan import space_shortfall

    free = 500 * 1024
    facts = HostFacts(python="/usr/bin/python3", sglang_dir="/x/sglang", version="0", free_mb={"sglang": 5000, "state": free >> 20},
                      current=None, lock=None, releases=[], pristine_store={}, free_bytes={"sglang": 5000 << 20, "state": free})
    low = space_shortfall(facts, builds["good"], 64)
    need = sum(f.size for f in builds["good"].files.values()) // (1 << 20) + 1 + 64
    assert low == f"state filesystem has {free // 1024} kB free, needs {need} MB", low
