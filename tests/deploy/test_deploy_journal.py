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
from ddtree_deploy.deploy.build.buildinfo import sha256_file
from deploy_cli import host_toml, run_cli

pytestmark = [pytest.mark.ssh, pytest.mark.slow, pytest.mark.timeout(900)]
TERMINAL = ("healthy", "rolled-back", "aborted")


def expected_after(before: dict[str, str], build) -> dict[str, str]:
    out = dict(before)
    out.update({rel: sha256_file(build.path_of(rel)) for rel in build.files})
    return out


def journals(h) -> dict[str, list[dict]]:
    """Each release's journal steps; `h`: a test host or a copy of a state dir."""
    root = (h if isinstance(h, Path) else h.state) / "releases"
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


def check_host(h, env, allowed: dict[str, dict], build_of: dict[str, str] | None) -> tuple[str, dict]:
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
    if build_of is not None:  # (a rollback's record names no build: the caller checks its state)
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


@pytest.mark.parametrize("kind", ["kill", "drop"])
def test_kill_and_drop_at_every_step(setup, cli_env, site_cache, tmp_path, kind):
    """A push SIGKILLed (kill) or its connection dropped (drop) at every remote operation it makes:
    the host is byte-identical to the old or the new build, status says which, the journal is
    finished. Over 60 s on 2 cores: one real push over sshd per fault point (about 25 points per
    kind); the two kinds are separate tests so that pytest-xdist runs them side by side."""
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
    seen = {kind: set()}
    t0 = time.monotonic()
    # a drop right after lock, current.json or `restarting` is handled like the drop after the swap
    # (reconnect, roll back): only the kill loop covers those three, to stay within the time budget
    drop_points = [p for p in points if not p.startswith(("lock#", "journal#")) and p != "record#1"]
    for kind, pts in ((kind, points if kind == "kill" else drop_points),):
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
    assert seen[kind] == {True, False}, seen
    # a kill after the release record and before the prune leaves one release too many: the next
    # push prunes it. After that clean push, the failed attempts (aborted, rolled back) took no
    # keep_releases slot: the 3 newest successful releases are still on the host
    nxt = a if cur is b else b
    r = run_cli(["push", "ct200", "--build", str(nxt.root)], env)
    assert r.returncode == 0, r.stderr
    recs = [json.loads((d / "release.json").read_text()) for d in sorted((h.state / "releases").iterdir())]
    assert len([r for r in recs if r.get("outcome") in ("deployed", "done")]) == 3, [(r["id"], r.get("outcome")) for r in recs]
    print(f"{len(points if kind == 'kill' else drop_points)} {kind} fault points in {time.monotonic() - t0:.0f}s")


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
    row = next(ln for ln in err.splitlines() if ln.startswith("│ ct200 "))  # the row shows the code the process exits with
    assert res["code"] == 130 and row.split("│")[3].strip() == "130", row
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


def _release(h, rid: str) -> dict:
    return json.loads((h.state / "releases" / rid / "release.json").read_text())


def test_reboot_of_the_control_machine(setup, cli_env, site_cache, tmp_path):
    """Over 60 s on 2 cores: four real pushes killed, each followed by a reboot and a recovery.
    A push SIGKILLed at a step (after the stage, mid-swap, after the swap, during the health gate),
    then the control machine "reboots" before the next command: the processes are gone, its boot id
    is new (a bind mount over /proc/sys/kernel/random/boot_id in a private mount namespace), its pids
    start over (the killed push ran in a PID namespace; after the reboot another process has its pid)
    and its local records (DDTREE_DEPLOY_STATE) are lost. The next `status` alone must find the dead
    run's transition in the host's journal, take its lock over and finish it (roll back: none of these
    steps reached healthy); then a `push` or `rollback` works as usual. Each ends with the host byte
    for byte at a known build, every journal terminal, the lock free."""
    import signal
    import subprocess

    from deploy_cli import CLI

    h, inv, (a, b) = setup
    env = _env(cli_env, inv)
    local = Path(env["DDTREE_DEPLOY_STATE"])
    tb.reset_host(h, a, site_cache)
    pristine = tb.tree_digest(h.sglang)
    trees = {a.build_id: expected_after(pristine, a), b.build_id: expected_after(pristine, b)}
    builds = {a.build_id: a, b.build_id: b}
    for x in (a, b):  # b's release records a as its previous state: something for `rollback` to go back to
        r = run_cli(["push", "ct200", "--build", str(x.root)], env)
        assert r.returncode == 0, r.stderr
    boot = tmp_path / "boot_id"
    boot.write_text("00000000-0000-4000-8000-00000000b007\n")

    def reboot_and_run(out: Path, holder_pid: int, cmds: list[str]) -> None:
        """After the "reboot": a fresh PID namespace whose pids are taken until `holder_pid` is alive
        again, the new boot id, no local records; then `cmds` (CLI argument strings), each's JSON in
        out/<k>.json, stderr in out/<k>.err, exit code in out/<k>.rc."""
        shutil.rmtree(local, ignore_errors=True)
        out.mkdir()
        runs = "\n".join(f"{CLI} {c} --json > {out}/{k}.json 2> {out}/{k}.err; echo $? > {out}/{k}.rc" for k, c in enumerate(cmds))
        assert holder_pid < 100, holder_pid  # a pid of the killed run's PID namespace (0: none)
        script = f"""
            while :; do sleep 600 & [ $! -ge {holder_pid} ] && break; done
            [ -d /proc/{holder_pid} ] && echo yes > {out}/pid-reused
            mount --bind {boot} /proc/sys/kernel/random/boot_id || exit 99
            {runs}
            """
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                           check=False, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr

    cur = b
    t0 = time.monotonic()
    for n, point in enumerate(("stage#1", "mid-swap", "apply#1", "http#1")):
        nxt = a if cur is b else b
        before = set(journals(h))
        if point == "mid-swap":  # a real SIGKILL from outside once the host journals the first rename
            p = subprocess.Popen([str(CLI), "push", "ct200", "--build", str(nxt.root)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _wait_for(lambda before=before: "swapping" in _last_steps(h, before), p)
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
            assert p.returncode == -9
        else:  # the faulty transport double SIGKILLs the push right after that operation, in a PID namespace
            # (under sh as its init: the namespace's init cannot SIGKILL itself)
            rcf = tmp_path / f"kill-{n}.rc"
            k = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                                f"{CLI} push ct200 --build {nxt.root}; echo $? > {rcf}"],
                               check=False, env=_env(cli_env, inv, DDTREE_TEST_FAULT=f"kill@{point}"), capture_output=True, text=True, timeout=600)
            assert rcf.read_text().strip() == "137", (point, rcf.read_text(), k.stderr[-1500:])
        holder = json.loads((h.state / "lock" / "owner.json").read_text())  # the dead run's lock is still there
        steps = _last_steps(h, before)
        assert steps and steps[-1] not in TERMINAL, (point, steps)
        # the next command: status (finishes the transition), then push the other build or roll back
        cmd = f"push ct200 --build {nxt.root}" if n % 2 == 0 else "rollback ct200"
        out = tmp_path / f"{n}-{point.replace('#', '-')}"
        reboot_and_run(out, 0 if point == "mid-swap" else int(holder["pid"]), ["status ct200", cmd])
        rc = [int((out / f"{k}.rc").read_text()) for k in (0, 1)]
        st = json.loads((out / "0.json").read_text())
        assert rc[0] == 0 and st["healthy"] and not st["unfinished"], (point, (out / "0.err").read_text()[-2000:])
        notes = " ".join(st["recovered"])
        finished = "had not touched the files: marked aborted" if point == "stage#1" else "rolled back to"
        assert "took over the stale lock" in notes and "(dead)" in notes and finished in notes, (point, st["recovered"])
        assert point == "mid-swap" or (out / "pid-reused").exists(), (point, holder["pid"])  # the reboot reused the dead pid
        # the next command ran as usual and left what it says
        res = json.loads((out / "1.json").read_text())["results"][0]
        assert rc[1] == 0 and res["ok"] and res["changed"] and not res["extra"]["recovered"], (point, cmd, res)
        if cmd.startswith("push"):
            want, build_of = nxt, {x: x for x in trees}
        else:  # back to the state recorded before the current release
            want, build_of = builds[_release(h, _release(h, st["current"]["state"])["previous"])["build_id"]], None
        cur = want
        which, _ = check_host(h, env, {want.build_id: trees[want.build_id], "other": trees[(a if want is b else b).build_id]}, build_of)
        assert which == want.build_id, (point, cmd, which)
        # the lost local records start again: the recovery and the next command are recorded
        local_recs = [json.loads(x) for x in (local / "ct200.jsonl").read_text().splitlines()]
        assert [r["action"] for r in local_recs][:2] == ["recover", cmd.split()[0]], local_recs
    print(f"4 reboots in {time.monotonic() - t0:.0f}s")


DIGEST = "import json, sys; from pathlib import Path; import deploy_testbed as tb; print(json.dumps(tb.tree_digest(Path(sys.argv[1]))))"


def run_in_mount_ns(cli_env, *, mount: Path, size_k: int, script: str, fault: str, fill: Path, out: Path) -> None:
    """Run `script` (sh) in a private mount namespace (`unshare -m`: the CLI, its host agent and the
    service it starts see the mount) with a `size_k` KiB tmpfs at `mount`; the faulty transport
    double fills `fill` at `fault`. In `script`: $CLI, $DIGEST <dir> (prints the tree digest) and
    $OUT (= out, created)."""
    import subprocess

    from deploy_cli import CLI

    out.mkdir()
    full = f"""
        mount -t tmpfs -o size={size_k}k ddtree-enospc {mount} || exit 99
        CLI={CLI}; OUT={out}; DIGEST="{sys.executable} -c '{DIGEST}'"
        {script}
        """
    env = dict(cli_env, DDTREE_TEST_FAULT=fault, DDTREE_TEST_FAULT_FILL=str(fill), DDTREE_TEST_FAULT_LOG=str(out / "ops.log"),
               PYTHONPATH=cli_env["PYTHONPATH"] + os.pathsep + str(Path(__file__).parent))
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", full], check=False, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


def _stop_local_service(h) -> None:
    """The service ran inside the namespaces: stop it so later tests start it on the real tree."""
    tb.sh("start-stop-daemon", "--stop", "--quiet", "--pidfile", str(h.root / "run" / "service.pid"),
          "--retry", "TERM/10/KILL/5", "--remove-pidfile", "--oknodo", check=False)


def _dirname(point: str) -> str:
    return point.replace("#", "-").replace(":", "_")


def test_enospc_at_each_step(bed, builds, site_cache, cli_env, tmp_path):
    """The `local` host's sglang package on a small tmpfs, mounted in a private mount namespace
    (`unshare -m`: the CLI, its host agent and the service see it). At each step of a push up to
    the restart, the faulty transport double fills that filesystem. Before the swap the package
    must stay byte for byte pristine with no temp file; once the swap is done nothing needs space.
    Over 60 s on 2 busy cores: a reference push and one push per step (about 7), each with a copy
    of the sglang package into the tmpfs, the pushes past the swap with a service restart (each start of the stub service imports the host's real sglang, about 1.5 CPU-s in a child of the bed's fork server, and the pre-swap import check about 9 CPU-s)."""
    h, good = bed["hosts"]["local"], builds["good"]
    pristine = tb.tree_digest(site_cache / "sglang")
    after = expected_after(pristine, good)
    size_k = sum(p.stat().st_size for p in (site_cache / "sglang").rglob("*") if p.is_file()) // 1024 + 96 * 1024
    filler = h.sglang / ".enospc-filler"

    def run_in_ns(fault: str, out: Path) -> tuple[int, dict, str]:
        shutil.rmtree(h.state, ignore_errors=True)  # every run starts from a pristine package and no state
        run_in_mount_ns(cli_env, mount=h.sglang, size_k=size_k, fault=fault, fill=filler, out=out, script=f"""
            cp -a {site_cache}/sglang/. {h.sglang}/ || exit 99
            $CLI push local --build {good.root} --json > $OUT/push.json 2> $OUT/push.err; echo $? > $OUT/rc
            rm -f {filler}
            eval $DIGEST {h.sglang} > $OUT/digest.json
            """)
        return int((out / "rc").read_text()), json.loads((out / "digest.json").read_text()), (out / "push.err").read_text()

    try:
        rc, digest, err = run_in_ns("log", tmp_path / "ref")
        assert rc == 0 and digest == after, err[-2000:]
        ops = (tmp_path / "ref" / "ops.log").read_text().split()
        points = [op for op in ops[: ops.index("journal#1") + 1] if op.endswith("#1") and not op.startswith("facts#")]
        assert {"stage#1", "put#1", "verify#1", "apply#1"} <= set(points), points
        for point in points:
            rc, digest, err = run_in_ns(f"fill@{point}", tmp_path / _dirname(point))
            swapped_before_fill = ops.index(point) >= ops.index("apply#1")
            before_preflight = ops.index(point) < ops.index("facts#1")  # the lock comes first: the facts see the full disk
            if swapped_before_fill:
                assert rc == 0 and digest == after, (point, err[-2000:])
            elif before_preflight:
                assert rc == 6 and digest == pristine, (point, rc, err[-2000:])
                msg = json.loads((tmp_path / _dirname(point) / "push.json").read_text())["results"][0]["message"]
                assert "not enough disk" in msg and "nothing changed" in msg, (point, msg)
            else:
                assert rc == 1 and digest == pristine, (point, rc, sorted(set(digest) ^ set(pristine))[:5], err[-2000:])
                msg = json.loads((tmp_path / _dirname(point) / "push.json").read_text())["results"][0]["message"]
                assert "No space left on device" in msg and "nothing changed" in msg, (point, msg)
            j = journals(h)
            assert (j or before_preflight) and all(v[-1]["step"] in TERMINAL for v in j.values()), (point, j)
            assert not (h.state / "lock").exists()
    finally:
        _stop_local_service(h)
        shutil.rmtree(h.state, ignore_errors=True)


def test_state_dir_enospc_at_each_step(bed, builds, site_cache, cli_env, tmp_path):
    """Over 60 s on 2 cores: a real push per write step that fills the disk, then status and a clean push.
    The `local` host's state dir (journal, releases, backups, uploads, lock) on a small tmpfs in
    a private mount namespace. Too small from the start: the preflight refuses, nothing written.
    Then at one step of each kind of write a push makes (lock, backups, uploads, the swap's journal
    and current.json, `restarting`, the health gate, after the healthy record) the faulty transport
    double fills it. After the
    push, a `status` while the disk is still full, and (space freed) a `status` that finishes what
    the push left: the package is byte for byte pristine or the new build, status healthy and
    agreeing, every journal terminal, the lock free, no temp file in the state dir; the push's exit
    code and report match the host it left (an unfinished transition is exit 8 naming the cause)."""
    h, good = bed["hosts"]["local"], builds["good"]
    pristine = tb.tree_digest(site_cache / "sglang")
    after = expected_after(pristine, good)
    mb = 1 << 20
    old = sum((site_cache / "sglang" / rel).stat().st_size for rel in good.files if (site_cache / "sglang" / rel).is_file())
    need_mb = (sum(f.size for f in good.files.values()) + old) // mb + 1 + 64  # space_shortfall's, min_free_mb 64
    filler = h.state / ".enospc-filler"
    quiet = "env -u DDTREE_TEST_FAULT"  # only the push gets the fault

    def run_in_ns(fault: str, out: Path, size_mb: int) -> dict:
        tb.reset_host(h, good, site_cache)  # pristine package, no state
        h.state.mkdir()
        run_in_mount_ns(cli_env, mount=h.state, size_k=size_mb * 1024, fault=fault, fill=filler, out=out, script=f"""
            $CLI push local --build {good.root} --json > $OUT/push.json 2> $OUT/push.err; echo $? > $OUT/rc
            eval $DIGEST {h.sglang} > $OUT/digest-push.json
            {quiet} $CLI status local --json > $OUT/status-full.json 2> $OUT/status-full.err; echo $? > $OUT/rc-full
            [ -e {h.state}/lock ] && echo held > $OUT/lock-while-full
            rm -f {filler}
            {quiet} $CLI status local --json > $OUT/status.json 2> $OUT/status.err; echo $? > $OUT/rc-status
            eval $DIGEST {h.sglang} > $OUT/digest.json
            cp -a {h.state} $OUT/state
            """)
        rd = lambda n: (out / n).read_text()
        push = json.loads(rd("push.json") or "{}")
        return {"rc": int(rd("rc")), "res": (push.get("results") or [{}])[0], "err": rd("push.err")[-2000:],
                "d_push": json.loads(rd("digest-push.json")), "d": json.loads(rd("digest.json")),
                "lock_while_full": (out / "lock-while-full").exists(), "rc_status": int(rd("rc-status")),
                "status": json.loads(rd("status.json") or "{}"), "status_err": rd("status.err")[-2000:], "state": out / "state"}

    def check(point: str, r: dict) -> bool:
        rc, res, d1, d2 = r["rc"], r["res"], r["d_push"], r["d"]
        if rc == 8:  # unfinished: the `.old` links the recovery restores from are still beside the files
            d1 = {k: v for k, v in d1.items() if ".ddtree-" not in k.rpartition("/")[2]}
        assert d1 in (pristine, after), (point, rc, sorted(set(d1) ^ set(pristine))[:5], r["err"])
        assert res.get("code") == rc, (point, rc, res)
        assert res["changed"] == (d1 != pristine), (point, res)  # the report tells what the host has
        if rc == 0:
            assert d1 == after, (point, res)
        elif rc == 6:  # filled right after the lock, before the facts: the preflight sees the full disk
            assert point == "lock#1" and d1 == pristine, (point, res)
            assert "not enough disk" in res["message"] and "nothing changed" in res["message"], (point, res["message"])
        else:
            assert rc in (1, 8), (point, rc, res["message"], r["err"])
            assert "No space left on device" in res["message"], (point, res["message"])
            if rc == 1:
                assert d1 == pristine, (point, res)
            else:
                assert "UNFINISHED" in res["message"], (point, res["message"])
        assert not r["lock_while_full"], (point, "a command on the full disk left the lock behind")
        s = r["status"]
        assert r["rc_status"] == 0 and s["healthy"] and not s["unfinished"], (point, r["status_err"])
        assert all(v == "ok" for v in s["verify"].values()), (point, s["verify"])
        assert d2 in (pristine, after) and (rc != 0 or d2 == after), (point, rc, sorted(set(d2) ^ set(pristine))[:5])
        assert (s["current"] or {}).get("build_id") == (good.build_id if d2 == after else None), (point, s["current"])
        j = journals(r["state"])
        assert all(v[-1]["step"] in TERMINAL for v in j.values()), (point, j)
        assert not (r["state"] / "lock").exists(), point
        stray = [str(p.relative_to(r["state"])) for p in r["state"].rglob("*") if ".tmp-" in p.name]
        assert not stray, (point, stray)
        return d2 == after

    try:
        # the state filesystem too small from the start: refused before anything is written
        r = run_in_ns("log", tmp_path / "small", need_mb - 8)
        assert r["rc"] == 6 and "state filesystem has" in r["res"]["message"] and "nothing changed" in r["res"]["message"], r["res"]
        assert r["d_push"] == pristine and not r["res"]["changed"] and not journals(r["state"]), r["res"]
        r = run_in_ns("log", tmp_path / "ref", need_mb + 8)
        assert r["rc"] == 0 and r["d_push"] == after, r["err"]
        ops = (tmp_path / "ref" / "ops.log").read_text().split()
        # one fill point per kind of write the push still has to make: lock -> backups (stage) ->
        # uploads (put) -> the swap's journal lines and current.json (verify: fill just before the
        # swap) -> `restarting` (journal) -> the health gate (http) -> after the healthy record. The
        # other operations repeat one of these (current.json after apply#1 as after verify#1, the
        # restart commands as `restarting`, prune/unlock as the healthy record): left out for time.
        firsts = ("lock#1", "stage#1", "put#1", "verify#1", "journal#1", "http#1")
        points = [op for op in ops if op in firsts] + [op for op in ops if op.startswith("record#")][-1:]
        assert len(points) == 7 and points[-1] != "record#1", points
        outcomes = {}
        for point in points:
            outcomes[point] = check(point, run_in_ns(f"fill@{point}", tmp_path / _dirname(point), need_mb + 8))
        # before the swap the host keeps its files; a fill after the healthy record keeps the new ones
        assert set(outcomes.values()) == {True, False}, outcomes
        print("state-dir fill points (True: new build kept):", outcomes)
    finally:
        _stop_local_service(h)
        shutil.rmtree(h.state, ignore_errors=True)
