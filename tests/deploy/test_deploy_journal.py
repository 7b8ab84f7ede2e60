"""The host journal and recovery, on the real sshd bed (ct200: loopback sshd, systemd shim).

A reference push runs through the faulty transport double (tests/deploy/faults) in log mode: the
sequence of SSH operations it makes is the list of fault points (the first of each kind, and the
last upload). Then, at every point, a push between two healthy builds is (a) SIGKILLed right after
that operation ran on the host, (b) has its connection really closed right after it, the answer
lost. Each ends, after the next command (`status`), with the package byte-identical to before or
to the pushed build, every journal ending in a terminal step, the lock free, no temp file left,
and the reports (the push's, when it lived, and status's) matching the host."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.buildinfo import sha256_file
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(900)]
TERMINAL = ("healthy", "rolled-back", "aborted")


def expected_after(before: dict[str, str], build) -> dict[str, str]:
    out = dict(before)
    out.update({rel: sha256_file(build.path_of(rel)) for rel in build.files})
    return out


def journals(h) -> dict[str, list[dict]]:
    root = h.state / "releases"
    out = {}
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        p = d / "journal.jsonl"
        if p.is_file():
            out[d.name] = [json.loads(x) for x in p.read_text().splitlines()]
    return out


@pytest.fixture(scope="module")
def setup(bed, builds, site_cache, tmp_path_factory):
    h, good = bed["hosts"]["ct200"], builds["good"]
    root = tmp_path_factory.mktemp("journal")
    utils = "srt/speculative/ddtree_utils.py"
    other = tb.derive_build(good, root / "good2", {utils: good.path_of(utils).read_bytes() + b"\n# second healthy build\n"})
    inv = root / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, bed["supervisor"], deadline=60, import_check=False))
    return h, inv, (good, other)


def _env(cli_env, inv, **kw):
    return dict(cli_env, DDTREE_DEPLOY_HOSTS=str(inv), **kw)


def check_host(h, env, allowed: dict[str, dict], build_of: dict[str, str]) -> tuple[str, dict]:
    """After the next command: which allowed tree the host has; status agrees; journal/lock clean."""
    st = run_cli(["status", "ct200", "--json"], env)
    s = json.loads(st.stdout)
    digest = tb.tree_digest(h.sglang)
    which = next((k for k, v in allowed.items() if v == digest), None)
    extra = sorted(set(digest) ^ set(next(iter(allowed.values()))))
    assert which is not None, f"host matches neither state; extra/missing paths: {extra[:5]}; status: {st.stderr[-2000:]}"
    assert st.returncode == 0, st.stderr
    assert s["healthy"] and not s["unfinished"] and all(v == "ok" for v in s["verify"].values()), s
    assert s["verify"], "status verified no file"
    assert not (h.state / "lock").exists()
    for rid, j in journals(h).items():
        assert j[-1]["step"] in TERMINAL, (rid, j)
    rec = json.loads((h.state / "releases" / s["current"]["release"] / "release.json").read_text()) if s["current"].get("release") else {}
    assert rec.get("build_id") == build_of[which], (which, s["current"], rec.get("build_id"))
    return which, s


def _points(log: Path) -> list[str]:
    """One fault point per journal step boundary, taken from the reference run's operations: the
    lock, the stage, the first upload, verify, the swap, current.json, `restarting`, the restart
    command, the first health poll, the final record (healthy), the unlock. (Repeated polls and the
    read-only facts calls are left out to keep the test within its time budget.)"""
    ops = log.read_text().split()
    skip = ("facts#", "journal#2", "prune#", "sh:systemctl-is-active#")
    firsts = [op for op in ops if op.endswith("#1") and not op.startswith(skip)]
    last_record = [op for op in ops if op.startswith("record#")][-1]
    return firsts + [last_record]


def test_kill_and_drop_at_every_step(setup, cli_env, site_cache, tmp_path):
    h, inv, (a, b) = setup
    env = _env(cli_env, inv)
    tb.reset_host(h, a, site_cache)
    pristine = tb.tree_digest(h.sglang)
    r = run_cli(["push", "ct200", "--build", str(a.root)], env)
    assert r.returncode == 0, r.stderr
    trees = {a.build_id: expected_after(pristine, a), b.build_id: expected_after(pristine, b)}
    log = tmp_path / "ops.log"
    r = run_cli(["push", "ct200", "--build", str(b.root)], _env(cli_env, inv, DDTREE_TEST_FAULT="log", DDTREE_TEST_FAULT_LOG=str(log)))
    assert r.returncode == 0, r.stderr
    points = _points(log)
    assert {"lock#1", "stage#1", "put#1", "verify#1", "apply#1", "journal#1", "http#1", "unlock#1"} <= set(points), points
    cur = b
    seen = {"kill": set(), "drop": set()}
    t0 = time.monotonic()
    # a drop right after lock, current.json or `restarting` is handled like the drop after the swap
    # (reconnect, roll back): only the kill loop covers those three, to stay within the time budget
    drop_points = [p for p in points if not p.startswith(("lock#", "journal#")) and p != "record#1"]
    for kind, pts in (("kill", points), ("drop", drop_points)):
        for point in pts:
            nxt = a if cur is b else b
            allowed = {cur.build_id: trees[cur.build_id], nxt.build_id: trees[nxt.build_id]}
            r = run_cli(["push", "ct200", "--build", str(nxt.root), "--json"], _env(cli_env, inv, DDTREE_TEST_FAULT=f"{kind}@{point}"))
            if kind == "kill":
                assert r.returncode == -9, (point, r.returncode, r.stderr[-1500:])
            else:
                assert r.returncode in (0, 1, 5, 8), (point, r.returncode, r.stderr[-1500:])
                res = json.loads(r.stdout)["results"][0]
                now = tb.tree_digest(h.sglang)
                # the surviving process's report matches the host it left
                if res["ok"]:
                    assert now == trees[nxt.build_id] and res["changed"], (point, res)
                elif res["code"] != 8:
                    assert now == trees[cur.build_id] and not res["changed"], (point, res)
                    assert res["restarted"] == (res["extra"].get("restarts", 0) > 0)
            which, _ = check_host(h, env, allowed, {a.build_id: a.build_id, b.build_id: b.build_id})
            seen[kind].add(which == nxt.build_id)
            cur = nxt if which == nxt.build_id else cur
    # both outcomes happened for each fault kind: before the swap the host keeps its build, after healthy the new one
    assert seen["kill"] == {True, False} and seen["drop"] == {True, False}, seen
    # the failed attempts (aborted, rolled back) took no keep_releases slot: the 3 newest successful
    # releases are still on the host
    recs = [json.loads((d / "release.json").read_text()) for d in sorted((h.state / "releases").iterdir())]
    assert len([r for r in recs if r.get("outcome") in ("deployed", "done")]) == 3, [(r["id"], r.get("outcome")) for r in recs]
    print(f"{len(points)} kill + {len(drop_points)} drop fault points in {time.monotonic() - t0:.0f}s")


def _wait_for(pred, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _last_steps(h, before: set | None = None) -> list[str]:
    """Steps of the newest journal; with `before`, of the newest one not in `before` (one read of
    the journals: reading twice let the previous release's steps pass for the new one's)."""
    j = journals(h)
    new = set(j) - before if before is not None else set(j)
    return [e["step"] for e in j[max(new)]] if new else []


def test_signals_stop_at_a_safe_point(setup, cli_env, site_cache, tmp_path):
    """Real signals to the real CLI process. SIGINT after the swap (during the health gate), then a
    second SIGINT during the rollback: the rollback completes, exit 130, table and local record.
    SIGTERM before the swap: nothing changes, exit 143."""
    import signal
    import subprocess

    from deploy_cli import CLI

    h, inv, (a, b) = setup
    env = _env(cli_env, inv)
    utils = "srt/speculative/ddtree_utils.py"
    if not (h.sglang / utils).is_file() or tb.sha256_file(h.sglang / utils) not in (a.files[utils].sha256, b.files[utils].sha256):
        tb.reset_host(h, a, site_cache)
        assert run_cli(["push", "ct200", "--build", str(a.root)], env).returncode == 0
    nxt = b if tb.sha256_file(h.sglang / utils) == a.files[utils].sha256 else a
    before, rels_before = tb.tree_digest(h.sglang), set(journals(h))

    p = subprocess.Popen([str(CLI), "push", "ct200", "--build", str(nxt.root), "--json"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: "restarted" in _last_steps(h, rels_before), p)
    p.send_signal(signal.SIGINT)
    _wait_for(lambda: "rolling-back" in _last_steps(h), p)
    p.send_signal(signal.SIGINT)  # during the rollback: reported, ignored
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    assert "again: still stopping" in err and "rolled back" in err  # the table's column header at least
    res = json.loads(out)["results"][0]
    assert res["extra"]["rolled_back"] and res["extra"]["interrupted"] and not res["changed"] and res["extra"]["restarts"] == 2
    assert tb.tree_digest(h.sglang) == before
    assert _last_steps(h)[-1] == "rolled-back" and not (h.state / "lock").exists()
    local = [json.loads(x) for x in (Path(env["DDTREE_DEPLOY_STATE"]) / "ct200.jsonl").read_text().splitlines()]
    assert local[-1]["interrupted"] and local[-1]["rolled_back"] and not local[-1]["ok"]

    rels_before = set(journals(h))
    p = subprocess.Popen([str(CLI), "push", "ct200", "--build", str(nxt.root)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (h.state / "lock").is_dir(), p)  # locked: the transition is about to start
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-2000:]
    assert "interrupted before the swap" in err
    assert tb.tree_digest(h.sglang) == before and not (h.state / "lock").exists()
    j = journals(h)  # no new transition, or one that ended aborted (the prune may have removed older failed ones)
    assert all(j[rid][-1]["step"] == "aborted" for rid in set(j) - rels_before), j


DIGEST = "import json, sys; from pathlib import Path; import deploy_testbed as tb; print(json.dumps(tb.tree_digest(Path(sys.argv[1]))))"


def test_enospc_at_each_step(bed, builds, site_cache, cli_env, tmp_path):
    """The `local` host's sglang package on a small tmpfs, mounted in a private mount namespace
    (`unshare -m`: the CLI, its host agent and the service see it). At each step of a push up to
    the restart, the faulty transport double fills that filesystem. Before the swap the package
    must stay byte for byte pristine with no temp file; once the swap is done nothing needs space."""
    import subprocess

    from deploy_cli import CLI

    h, good = bed["hosts"]["local"], builds["good"]
    pristine = tb.tree_digest(site_cache / "sglang")
    after = expected_after(pristine, good)
    size_k = sum(p.stat().st_size for p in (site_cache / "sglang").rglob("*") if p.is_file()) // 1024 + 96 * 1024
    filler = h.sglang / ".enospc-filler"

    def run_in_ns(fault: str, out: Path) -> tuple[int, dict, str]:
        out.mkdir()
        shutil.rmtree(h.state, ignore_errors=True)  # every run starts from a pristine package and no state
        script = f"""
            mount -t tmpfs -o size={size_k}k ddtree-enospc {h.sglang} && cp -a {site_cache}/sglang/. {h.sglang}/ || exit 99
            {CLI} push local --build {good.root} --json > {out}/push.json 2> {out}/push.err; echo $? > {out}/rc
            rm -f {filler}
            {sys.executable} -c '{DIGEST}' {h.sglang} > {out}/digest.json
            """
        env = dict(cli_env, DDTREE_TEST_FAULT=fault, DDTREE_TEST_FAULT_FILL=str(filler), DDTREE_TEST_FAULT_LOG=str(out / "ops.log"),
                   PYTHONPATH=cli_env["PYTHONPATH"] + os.pathsep + str(Path(__file__).parent))
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return int((out / "rc").read_text()), json.loads((out / "digest.json").read_text()), (out / "push.err").read_text()

    try:
        rc, digest, err = run_in_ns("log", tmp_path / "ref")
        assert rc == 0 and digest == after, err[-2000:]
        ops = (tmp_path / "ref" / "ops.log").read_text().split()
        points = [op for op in ops[: ops.index("journal#1") + 1] if op.endswith("#1") and not op.startswith("facts#")]
        assert {"stage#1", "put#1", "verify#1", "apply#1"} <= set(points), points
        for point in points:
            rc, digest, err = run_in_ns(f"fill@{point}", tmp_path / point.replace("#", "-").replace(":", "_"))
            swapped_before_fill = ops.index(point) >= ops.index("apply#1")
            if swapped_before_fill:
                assert rc == 0 and digest == after, (point, err[-2000:])
            else:
                assert rc == 1 and digest == pristine, (point, rc, sorted(set(digest) ^ set(pristine))[:5], err[-2000:])
                msg = json.loads((tmp_path / point.replace("#", "-").replace(":", "_") / "push.json").read_text())["results"][0]["message"]
                assert "No space left on device" in msg and "nothing changed" in msg, (point, msg)
            j = journals(h)
            assert j and all(v[-1]["step"] in TERMINAL for v in j.values()), (point, j)
            assert not (h.state / "lock").exists()
    finally:  # the service ran inside the namespaces: stop it so later tests start it on the real tree
        tb.sh("start-stop-daemon", "--stop", "--quiet", "--pidfile", str(h.root / "run" / "service.pid"),
              "--retry", "TERM/10/KILL/5", "--remove-pidfile", "--oknodo", check=False)
        shutil.rmtree(h.state, ignore_errors=True)
