"""Deploy scenarios against the real test hosts (sshd on loopback and in a network namespace,
systemd-shim / supervisord / start-stop-daemon supervisors, real sglang installs per host).
Every scenario checks the host's files byte for byte afterwards: the whole installed sglang tree
is hashed before and after, and compared with what the scenario must leave there (computed here
from the build directory, not pasted from a run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.build.buildinfo import sha256_file
from deploy_cli import CLI, host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(600)]


def expected_after(before: dict[str, str], build) -> dict[str, str]:
    """The tree `before` with every build file in place (hashes computed from the build dir)."""
    out = dict(before)
    out.update({rel: sha256_file(build.path_of(rel)) for rel in build.files})
    return out


def pid_of(h) -> str | None:
    p = h.root / "run" / ("sglang.pid" if h.name == "ct200" else "service.pid")
    return p.read_text().strip() if p.is_file() else None


def replace_file(path: Path, data: bytes) -> None:
    """Edit a host file the way an editor does (new inode; the shared cache stays untouched)."""
    tmp = path.with_name(path.name + ".edit")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def releases(h) -> list[str]:
    d = h.state / "releases"
    return sorted(os.listdir(d)) if d.is_dir() else []


def journal(h, rid: str) -> list[dict]:
    p = h.state / "releases" / rid / "journal.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def results(r: subprocess.CompletedProcess) -> dict[str, dict]:
    return {o["host"]: o for o in json.loads(r.stdout)["results"]}


@pytest.fixture
def ct200_good(bed, builds, site_cache, cli_env):
    """ct200 running the good build (pushed here unless it already is): the state an upgrade starts from."""
    h, good = bed["hosts"]["ct200"], builds["good"]
    ok = all(tb.sha256_file(h.sglang / rel) == f.sha256 for rel, f in good.files.items() if (h.sglang / rel).is_file())
    if not ok or not (h.state / "current.json").is_file() or not (h.sglang / "srt/speculative/ddtree_utils.py").is_file():
        tb.reset_host(h, good, site_cache)
        r = run_cli(["push", "ct200", "--build", str(good.root)], cli_env)
        assert r.returncode == 0, r.stderr
    return h


def test_fresh_push_and_concurrent_push_refused(bed, builds, site_cache, cli_env):
    h, good = bed["hosts"]["ct200"], builds["good"]
    tb.reset_host(h, good, site_cache)
    before = tb.tree_digest(h.sglang)
    first = subprocess.Popen([str(CLI), "push", "ct200", "--build", str(good.root), "--json"], env=cli_env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (h.state / "lock").is_dir():  # the first push holds the lock while it uploads/verifies
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = run_cli(["push", "ct200", "--build", str(good.root), "--json"], cli_env)
    out, err = first.communicate(timeout=600)
    assert second.returncode == 6, second.stderr
    assert "holds the lock" in second.stderr
    assert first.returncode == 0, err
    res = results(subprocess.CompletedProcess([], 0, out, err))["ct200"]
    assert res["ok"] and res["changed"] and res["restarted"]
    assert res["health"]["algorithm"] == h.algorithm and res["health"]["smoke"]
    assert tb.tree_digest(h.sglang) == expected_after(before, good)
    assert not (h.state / "lock").exists()
    rec = json.loads((h.state / "releases" / res["release"] / "release.json").read_text())
    assert rec["outcome"] == "deployed" and rec["build_id"] == good.build_id
    assert rec["series_sha256"] == good.series_sha256
    # every backup is byte for byte what was there before; the added file was absent
    for rel, sha in rec["backup"].items():
        assert sha == before.get(rel)
    local = [json.loads(x) for x in (Path(cli_env["DDTREE_DEPLOY_STATE"]) / "ct200.jsonl").read_text().splitlines()]
    assert [x["ok"] for x in local] == [False, True] and local[1]["build_id"] == good.build_id
    # status reads the release, the algorithm and acceptance metrics from /get_server_info
    st = run_cli(["status", "ct200", "--build", str(good.root), "--json"], cli_env)
    assert st.returncode == 0, st.stderr
    s = json.loads(st.stdout)
    assert s["healthy"] and s["service"] == "running" and s["speculative_algorithm"] == h.algorithm
    assert s["current"]["release"] == res["release"] and set(s["files"].values()) == {"current"}
    assert s["metrics"]["avg_spec_accept_length"] > 0


def test_repeated_push_changes_nothing(ct200_good, builds, cli_env):
    h = ct200_good
    before, pid, rels = tb.tree_digest(h.sglang), pid_of(h), releases(h)
    r = run_cli(["push", "ct200", "--build", str(builds["good"].root), "--json"], cli_env)
    assert r.returncode == 0, r.stderr
    res = results(r)["ct200"]
    assert res["ok"] and not res["changed"] and not res["restarted"] and "nothing to do" in res["message"]
    assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid and releases(h) == rels


@pytest.mark.parametrize(("variant", "stage"), [("syntax", "py_compile"), ("bad_import", "import")])
def test_broken_build_caught_before_swap(ct200_good, builds, cli_env, variant, stage):
    h = ct200_good
    before, pid = tb.tree_digest(h.sglang), pid_of(h)
    r = run_cli(["push", "ct200", "--build", str(builds[variant].root)], cli_env)
    assert r.returncode == 1, r.stderr
    assert f"{stage} check failed before the swap" in r.stderr and "nothing changed" in r.stderr
    assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid
    assert not (h.state / "lock").exists()


def test_service_fails_at_import_rolls_back(bed, ct200_good, builds, cli_env, tmp_path):
    h = ct200_good
    inv = tmp_path / "hosts.toml"  # the pre-swap import check passes for this build anyway: skip its cost
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], import_check=False))
    before = tb.tree_digest(h.sglang)
    r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(builds["bad_service"].root), "--json"], cli_env)
    assert r.returncode == 1, r.stderr
    res = results(r)["ct200"]
    assert "not running" in res["message"] and "rolled back automatically" in res["message"]
    assert "fails at import inside the service" in res["detail"]  # the service's log tail
    assert tb.tree_digest(h.sglang) == before
    rec = json.loads((h.state / "releases" / sorted(releases(h))[-1] / "release.json").read_text())
    assert rec["outcome"] == "rolled-back"
    st = json.loads(run_cli(["status", "ct200", "--json"], cli_env).stdout)
    assert st["healthy"] and st["speculative_algorithm"] == h.algorithm


def test_health_deadline_rolls_back(bed, ct200_good, builds, cli_env, tmp_path):
    """A service that hangs at start: the health gate gives up at its 40 s deadline and the push
    rolls back. Over 60 s on 2 busy cores: the whole deadline is waited on (shorter risks the old
    service's own restart on a loaded CI box), then the rollback restarts the old service."""
    h = ct200_good
    inv = tmp_path / "hosts.toml"  # same host, a short deadline
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=40, import_check=False))
    before = tb.tree_digest(h.sglang)
    t0 = time.monotonic()
    r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(builds["hang_service"].root), "--json"], cli_env)
    assert r.returncode == 1, r.stderr
    res = results(r)["ct200"]
    assert "deadline" in res["message"] and "rolled back automatically" in res["message"]
    assert time.monotonic() - t0 >= 40
    assert tb.tree_digest(h.sglang) == before
    st = json.loads(run_cli(["status", "ct200", "--json"], cli_env).stdout)
    assert st["healthy"]


def test_connection_drop_mid_upload(ct200_good, builds, cli_env):
    """The faulty transport double (tests/deploy/faults) really closes the SSH connection after the
    first uploaded file; the tool must reconnect, mark the release aborted and release the lock, and
    the host must be unchanged: exit 5."""
    h = ct200_good
    before, pid = tb.tree_digest(h.sglang), pid_of(h)
    env = dict(cli_env, DDTREE_TEST_FAULT="drop@put#1")
    r = run_cli(["push", "ct200", "--build", str(builds["hang_service"].root), "--json"], env)
    assert r.returncode == 5, r.stderr  # a lost connection before any change (docs/DEPLOY.md, exit codes)
    res = results(r)["ct200"]
    assert "connection lost" in res["message"] and "host is unchanged" in res["message"]
    assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid
    assert not (h.state / "lock").exists()
    rec = json.loads((h.state / "releases" / sorted(releases(h))[-1] / "release.json").read_text())
    assert rec["outcome"] == "aborted"


def test_connection_drop_after_swap_rolls_back(bed, ct200_good, builds, cli_env, tmp_path):
    """The connection dies as the swap completes on the host (the double closes the SSH connection
    and loses the answer of `apply`): the tool reconnects and rolls back before anything else happens."""
    h = ct200_good
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], import_check=False))
    before = tb.tree_digest(h.sglang)
    env = dict(cli_env, DDTREE_TEST_FAULT="drop@apply#1")
    r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(builds["bad_service"].root), "--json"], env)
    assert r.returncode == 1, r.stderr
    res = results(r)["ct200"]
    assert "connection lost" in res["message"] and "rolled back automatically" in res["message"]
    assert tb.tree_digest(h.sglang) == before
    assert not (h.state / "lock").exists()
    assert json.loads(run_cli(["status", "ct200", "--json"], cli_env).stdout)["healthy"]


def test_stale_lock_of_dead_process_taken_over(ct200_good, builds, cli_env):
    """A deploy process that dies mid-push (SIGKILL: no `finally`) leaves the lock and an unfinished
    journal; it ran on this machine and its pid is gone, so the next push says so, takes the lock
    over, finishes the dead transition (it had not touched the files: aborted) and goes on."""
    h = ct200_good
    before, pid = tb.tree_digest(h.sglang), pid_of(h)
    victim = subprocess.Popen([str(CLI), "push", "ct200", "--build", str(builds["bad_import"].root)], env=cli_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (h.state / "lock" / "owner.json").is_file():
        assert victim.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    u = run_cli(["unlock", "ct200"], cli_env)  # the holder is alive on this machine: refused
    assert u.returncode == 6 and "alive on this machine" in u.stderr, u.stderr
    victim.kill()
    victim.wait()
    owner = json.loads((h.state / "lock" / "owner.json").read_text())
    assert owner["pid"] == victim.pid
    r = run_cli(["push", "ct200", "--build", str(builds["syntax"].root), "--json"], cli_env)
    assert r.returncode == 1 and "py_compile check failed" in r.stderr, r.stderr
    msg = results(r)["ct200"]["message"]
    assert "took over the stale lock" in msg and f"pid {victim.pid}" in msg
    assert not (h.state / "lock").exists()
    assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid
    assert all(journal(h, rid)[-1]["step"] in ("healthy", "rolled-back", "aborted") for rid in releases(h) if journal(h, rid))


def test_unlock_holder_on_another_machine(ct200_good, cli_env):
    """A lock whose holder ran on another machine cannot be checked from here: `unlock` refuses
    without --force (exit 6), removes it with --force. The owner record is written as that other
    machine's run would have written it."""
    h = ct200_good
    (h.state / "lock").mkdir()
    (h.state / "lock" / "owner.json").write_text(json.dumps({"owner": "ops@other-machine", "machine": "other-machine",
                                                             "pid": 4242, "time": time.time(), "action": "push",
                                                             "release": None, "token": "feedc0de"}))
    u = run_cli(["unlock", "ct200"], cli_env)
    assert u.returncode == 6 and "another machine" in u.stderr and (h.state / "lock").is_dir()
    u = run_cli(["unlock", "ct200", "--force", "--json"], cli_env)
    assert u.returncode == 0, u.stderr
    assert json.loads(u.stdout)["released"] and not (h.state / "lock").exists()
    u = run_cli(["unlock", "ct200"], cli_env)
    assert u.returncode == 0 and "no lock held" in u.stderr


@pytest.mark.parametrize("case", ["version", "disk"])
def test_preflight_refusals(bed, ct200_good, builds, cli_env, tmp_path, case):
    """Remote SGLang version != the build's, or not enough disk: refused (6) before anything happens."""
    h = ct200_good
    before, pid, rels = tb.tree_digest(h.sglang), pid_of(h), releases(h)
    build, inv = builds["syntax"], bed["inventory"]
    if case == "version":
        manifest = json.loads((build.root / "BUILD-MANIFEST.json").read_text())
        other = tmp_path / "other-version"
        shutil.copytree(build.root, other)
        (other / "BUILD-MANIFEST.json").write_text(json.dumps(dict(manifest, sglang_version="0.5.14")))
        build_dir, words = other, "remote SGLang is 0.5.13.post1"
    else:
        inv = tmp_path / "hosts.toml"
        inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"]).replace("keep_releases = 3", "keep_releases = 3\nmin_free_mb = 1000000000"))
        build_dir, words = build.root, "not enough disk"
    r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(build_dir)], cli_env)
    assert r.returncode == 6 and words in r.stderr, r.stderr
    assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid and releases(h) == rels


def test_unknown_or_changed_host_key_refused(bed, ct200_good, builds, cli_env, tmp_path):
    h = ct200_good
    before = tb.tree_digest(h.sglang)
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    wrong = tmp_path / "known_hosts_wrong"  # the netns host's key listed for ct200's address
    ns_key = " ".join((bed["ssh"].root / "ns_host_key.pub").read_text().split()[:2])
    wrong.write_text(f"[127.0.0.1]:{bed['ssh'].port} {ns_key}\n")
    for kh, words in ((empty, "not in known_hosts"), (wrong, "MISMATCH")):
        inv = tmp_path / f"hosts-{kh.name}.toml"
        inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], known_hosts=kh))
        r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(builds["good"].root)], cli_env)
        assert r.returncode == 5, r.stderr
        assert words in r.stderr
    assert tb.tree_digest(h.sglang) == before


def test_drifted_file_refused_and_shown(ct200_good, builds, cli_env):
    h = ct200_good
    rel = "srt/speculative/spec_registry.py"
    original = (h.sglang / rel).read_bytes()
    replace_file(h.sglang / rel, original + b"# hand edit on the host\n")
    try:
        before, pid, rels = tb.tree_digest(h.sglang), pid_of(h), releases(h)
        r = run_cli(["push", "ct200", "--build", str(builds["bad_service"].root)], cli_env)
        assert r.returncode == 6, r.stderr
        assert f"{rel} (drifted)" in r.stderr
        assert tb.tree_digest(h.sglang) == before and pid_of(h) == pid and releases(h) == rels
        p = run_cli(["plan", "ct200", "--diff", "--build", str(builds["bad_service"].root), "--json"], cli_env)
        assert p.returncode == 0, p.stderr
        plan = json.loads(p.stdout)
        assert {f["relpath"]: f["status"] for f in plan["facts"]["files"]}[rel] == "drifted"
        assert "-# hand edit on the host" in plan["diffs"][rel]
        assert any("drifted" in x for x in plan["refusals"])
        assert tb.tree_digest(h.sglang) == before  # plan changed nothing
    finally:
        replace_file(h.sglang / rel, original)


def test_force_overwrites_drift_and_keeps_it(bed, ct200_good, builds, cli_env, tmp_path):
    """push --force replaces a hand-edited file; the edit is kept in the release's backup."""
    h, good = ct200_good, builds["good"]
    rel = "srt/speculative/dflash_info.py"
    edited = (h.sglang / rel).read_bytes() + b"# hand edit to keep\n"
    replace_file(h.sglang / rel, edited)
    before = tb.tree_digest(h.sglang)
    inv = tmp_path / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], import_check=False))
    r = run_cli(["push", "ct200", "-i", str(inv), "--force", "--build", str(good.root), "--json"], cli_env)
    assert r.returncode == 0, r.stderr
    res = results(r)["ct200"]
    assert res["ok"] and res["changed"]
    assert tb.tree_digest(h.sglang) == expected_after(before, good)
    assert (h.state / "releases" / res["release"] / "backup" / rel).read_bytes() == edited


def test_two_hosts_one_failing(bed, builds, site_cache, cli_env):
    """ct200 has a drifted file (refused), gpu-b (ssh_config alias, ProxyJump through the loopback
    sshd into the network namespace, supervisord) gets the build; the table and JSON say which."""
    a, b, good = bed["hosts"]["ct200"], bed["hosts"]["gpu-b"], builds["good"]
    tb.reset_host(b, good, site_cache)
    rel = "srt/speculative/spec_info.py"
    original = (a.sglang / rel).read_bytes()
    replace_file(a.sglang / rel, b"# drifted\n" + original)
    try:
        before_a, before_b = tb.tree_digest(a.sglang), tb.tree_digest(b.sglang)
        r = run_cli(["push", "ct200", "gpu-b", "--serial", "2", "--build", str(good.root), "--json"], cli_env)
        assert r.returncode == 6, r.stderr
        res = results(r)
        assert not res["ct200"]["ok"] and res["ct200"]["code"] == 6
        assert res["gpu-b"]["ok"] and res["gpu-b"]["changed"], res["gpu-b"]
        assert "ct200" in r.stderr and "gpu-b" in r.stderr and "FAILED" in r.stderr
        assert tb.tree_digest(a.sglang) == before_a
        assert tb.tree_digest(b.sglang) == expected_after(before_b, good)
        st = json.loads(run_cli(["status", "gpu-b", "--json"], cli_env).stdout)
        assert st["healthy"] and st["speculative_algorithm"] == b.algorithm
    finally:
        replace_file(a.sglang / rel, original)


def test_local_push_and_rollbacks(bed, builds, site_cache, cli_env):
    """`local` (no SSH, start-stop-daemon pidfile): push, rollback, rollback --to <release>, --to pristine.
    Over 60 s on 2 busy cores: a push and the rollbacks each restart the service with its health gate (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, good = bed["hosts"]["local"], builds["good"]
    tb.reset_host(h, good, site_cache)
    pristine = tb.tree_digest(h.sglang)
    deployed = expected_after(pristine, good)
    r = run_cli(["push", "local", "--build", str(good.root), "--json"], cli_env)
    assert r.returncode == 0, r.stderr
    rid = results(r)["local"]["release"]
    assert tb.tree_digest(h.sglang) == deployed
    r = run_cli(["rollback", "local", "--json"], cli_env)  # the state before the release: pristine
    assert r.returncode == 0, r.stderr
    assert tb.tree_digest(h.sglang) == pristine
    assert json.loads((h.state / "current.json").read_text())["state"] == "pristine"
    r = run_cli(["rollback", "local", "--to", rid], cli_env)
    assert r.returncode == 0, r.stderr
    assert tb.tree_digest(h.sglang) == deployed
    r = run_cli(["rollback", "local", "--to", "pristine", "--json"], cli_env)
    assert r.returncode == 0, r.stderr
    assert tb.tree_digest(h.sglang) == pristine
    assert not (h.sglang / "srt/speculative/ddtree_utils.py").exists()
    st = json.loads(run_cli(["status", "local", "--json"], cli_env).stdout)
    assert st["healthy"] and st["speculative_algorithm"] == "DFLASH"
    # keep_releases = 3: deployed pushes take the slots (so `--to` finds them), rollbacks are kept
    # apart (the newest 3), never the current state's release pruned
    kept = releases(h)
    recs = {r: json.loads((h.state / "releases" / r / "release.json").read_text()) for r in kept}
    pushes = [r for r in kept if recs[r].get("action") == "push" and recs[r].get("outcome") == "deployed"]
    assert rid in pushes and len(pushes) <= 3 and len(kept) - len(pushes) <= 3, recs
    assert json.loads((h.state / "current.json").read_text())["release"] in kept
    log = [json.loads(x) for x in (Path(cli_env["DDTREE_DEPLOY_STATE"]) / "local.jsonl").read_text().splitlines()]
    assert [x["outcome"] for x in log] == ["done"] * 4 and log[0]["build_id"] == good.build_id
    r = run_cli(["rollback", "local", "--to", "no-such-release"], cli_env)
    assert r.returncode == 6 and "no-such-release" in r.stderr


def test_rollback_that_cannot_heal_exits_7(bed, ct200_good, builds, cli_env, tmp_path):
    """Exit 7: the automatic rollback restores the files byte for byte, but the service is still
    not healthy afterwards. Made real with a health gate that no build can pass (it expects a
    speculative algorithm the host's service does not run), as a mistyped inventory would."""
    h = ct200_good
    inv = tmp_path / "hosts.toml"
    text = host_toml(bed["ssh"], h, bed["supervisor"], deadline=15, import_check=False)
    assert f'expect_algorithm = "{h.algorithm}"' in text
    inv.write_text(text.replace(f'expect_algorithm = "{h.algorithm}"', 'expect_algorithm = "EAGLE3"'))
    before = tb.tree_digest(h.sglang)
    r = run_cli(["push", "ct200", "-i", str(inv), "--build", str(builds["bad_service"].root), "--json"], cli_env)
    assert r.returncode == 7, r.stderr
    res = results(r)["ct200"]
    assert res["code"] == 7 and not res["ok"]
    assert "restored byte for byte" in res["message"] and "not healthy" in res["message"]
    assert tb.tree_digest(h.sglang) == before
    rec = json.loads((h.state / "releases" / sorted(releases(h))[-1] / "release.json").read_text())
    assert rec["outcome"] == "rolled-back"
    assert not (h.state / "lock").exists()
    # with the right inventory the restored host is healthy again, once its service has started
    # (the gate's 15 s may end before the restarted service answers on a loaded machine)
    tb.wait_healthy(h)  # ct200: systemd on loopback
    st = json.loads(run_cli(["status", "ct200", "--json"], cli_env).stdout)
    assert st["healthy"] and st["speculative_algorithm"] == h.algorithm
