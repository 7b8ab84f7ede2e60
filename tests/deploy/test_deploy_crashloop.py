"""A crash loop is caught early (issue 29, item 5): under a supervisor that starts the service again
whenever it exits, the liveness check passes nearly all the time, and the health gate used to wait
its whole deadline. The gate now reads what the supervisor says in the same agent call as each
poll (deploy/remote/restart.py: CrashWatch) and fails at once on a new PID, a higher restart count
or a supervisor that reports a backoff or an exit.

The host `gpu-crash` is reached like gpu-b (ssh_config alias through ProxyJump into the network
namespace) and runs under a real supervisord with `autorestart=true` and `startsecs=0` (the service
counts as started at once, as a model server with a short startsecs does after its load), with the
launch flags in an env file that a DDTREE push creates. The build pushed is the session's
`bad_service` build (DDTREE; it imports fine in the pre-swap check, but the service dies at import
inside its own environment): supervisord restarts it over and over. The systemd shim of the bed
has no `Restart=`, so the systemd reading (NRestarts, MainPID, auto-restart) is checked on its
documented `systemctl show` format only (no host needed)."""

from __future__ import annotations

import json
import time

import deploy_testbed as tb
import pytest
from ddtree_deploy.deploy.config.inventory import (
    PidfileRestart,
    SupervisorRestart,
    SystemdRestart,
)
from ddtree_deploy.deploy.remote import restart
from deploy_cli import VENV_BIN, host_toml, run_cli
from test_deploy_report import journals, result, settled

DEADLINE = 900  # the inventory default: the gate must fail in a small fraction of it


def supervisor_status(conf) -> str:
    return tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(conf), "status", "sglang", check=False).stdout


@pytest.fixture(scope="module")
def crash_host(bed, algorithm, site_cache, tmp_path_factory):
    if algorithm != "DDTREE":
        pytest.skip("the build at hand has no DDTREE (fallback build): no flags to turn on")
    root = tmp_path_factory.mktemp("crashloop")
    h = tb.make_host("gpu-crash", root / "gpu-crash", site_cache, "NONE")
    env_file = h.root / "etc" / "sglang" / "ddtree.env"  # absent: no speculative flags before the push
    conf = tb.setup_supervisor(h, bed["ssh"].ns, env_file=env_file, autorestart=True)
    inv = root / "hosts.toml"
    inv.write_text(host_toml(bed["ssh"], h, conf, kind="gpu-b", import_check=False, deadline=DEADLINE,
                             launch=f'env_file = "{env_file}"'))
    tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(conf), "start", "sglang")
    tb.wait_healthy(h, bed["ssh"].ns)
    yield h, inv, env_file, conf
    tb.sh(str(VENV_BIN / "supervisorctl"), "-c", str(conf), "shutdown", check=False)


@pytest.mark.ssh
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crash_loop_under_supervisord_fails_the_gate_at_once(crash_host, builds, cli_env):
    """push of a build whose service crash-loops under supervisord: the gate fails within seconds
    (not the 900 s deadline) with `crash loop: ...` and the service's log tail, the automatic
    rollback restores the files and removes the env file again, the service runs steadily after
    it; exit 1 and the row as docs/DEPLOY.md says, every journal finished, the local record
    `failed-rolled-back`."""
    h, inv, env_file, conf = crash_host
    env = dict(cli_env, DDTREE_DEPLOY_HOSTS=str(inv))
    before = tb.tree_digest(h.sglang)
    assert " RUNNING " in supervisor_status(conf) and not env_file.exists()
    t0 = time.monotonic()
    r = run_cli(["push", "gpu-crash", "--build", str(builds["bad_service"].root), "--json"], env)
    wall = time.monotonic() - t0
    res = result(r, "gpu-crash")
    assert res["message"].count("crash loop: ") == 1, res["message"]
    assert "rolled back automatically" in res["message"] and "service healthy again" in res["message"], res["message"]
    assert res["extra"]["rolled_back"] and not res["changed"] and res["extra"]["restarts"] == 2, res
    assert "fails at import inside the service" in (res["detail"] or ""), res["detail"]  # the log tail
    s = settled(h, env, tree=before, state=None, code=1, r=r, outcome="failed-rolled-back", host="gpu-crash")
    assert s["healthy"] and s["speculative_algorithm"] is None and not env_file.exists()
    # the row of the table (stderr): FAILED, exit 1, rolled back; the log tail below it
    row = next(ln for ln in r.stderr.splitlines() if ln.startswith("│ gpu-crash "))
    assert [c.strip() for c in row.split("│")[2:5]] == ["FAILED", "1", "-"], row
    assert "crash loop" in row and "gpu-crash: log tail" in r.stderr
    # the gate failed early: from the restart to the start of the rollback, by the host's journal
    rid, j = next((k, v) for k, v in journals(h).items() if any(e["step"] == "rolling-back" for e in v))
    t_restarted = next(e["time"] for e in j if e["step"] == "restarted")
    t_rollback = next(e["time"] for e in j if e["step"] == "rolling-back")
    assert t_rollback - t_restarted < DEADLINE / 15, (t_rollback - t_restarted, j)
    assert wall < DEADLINE / 6, wall
    rec = json.loads((h.state / "releases" / rid / "release.json").read_text())
    assert rec["outcome"] == "rolled-back" and rec["error"].startswith("crash loop: "), rec
    assert rec["health_after_rollback"]["ok"] and rec["health_after_rollback"]["algorithm"] is None, rec
    # after the rollback the service runs steadily: one pid over a few polls
    pids = set()
    for _ in range(4):
        st = supervisor_status(conf)
        assert " RUNNING " in st, st
        pids.add(st.split("pid ")[1].split(",")[0])
        time.sleep(0.5)
    assert len(pids) == 1, pids


def test_crash_watch_reads_each_supervisor():
    """The probe's output of each strategy (systemctl show, supervisorctl status, the pidfile) read
    into pid / restart count / state, and what CrashWatch makes of a sequence of them. The systemd
    lines are in `systemctl show --property=...` format (KEY=VALUE); the bed's systemctl shim has
    no Restart=, so a real restart count is not seen on the bed."""
    sd = SystemdRestart(strategy="systemd", unit="sglang.service")
    show = "MainPID={}\nNRestarts={}\nActiveState={}\nSubState={}\n".format
    w = restart.CrashWatch(sd)
    assert w.check(restart.probe_facts(sd, show(100, 2, "active", "running"))) is None  # the reference
    assert w.check(restart.probe_facts(sd, show(100, 2, "active", "running"))) is None
    why = w.check(restart.probe_facts(sd, show(230, 3, "active", "running")))
    assert why.startswith("crash loop: systemd restarted the service 1 time ") and "NRestarts 2 -> 3" in why and "100 -> 230" in why
    w = restart.CrashWatch(sd)
    assert w.check(restart.probe_facts(sd, show(100, 0, "active", "running"))) is None
    assert "auto-restart" in w.check(restart.probe_facts(sd, show(0, 0, "activating", "auto-restart")))
    assert restart.probe_facts(sd, "Failed to connect to bus") is None
    # an old systemd without NRestarts: the pid alone
    w = restart.CrashWatch(sd)
    assert w.check(restart.probe_facts(sd, "MainPID=7\nActiveState=active\nSubState=running")) is None
    assert "pid changed during the health gate (7 -> 8)" in w.check(restart.probe_facts(sd, "MainPID=8\nActiveState=active\nSubState=running"))

    sv = SupervisorRestart(strategy="supervisor", program="sglang")
    line = "sglang                           {}\n".format
    w = restart.CrashWatch(sv)
    assert w.check(restart.probe_facts(sv, line("RUNNING   pid 4242, uptime 0:00:03"))) is None
    assert w.check(restart.probe_facts(sv, line("RUNNING   pid 4242, uptime 0:00:04"))) is None
    assert "(4242 -> 4300): supervisord restarted it" in w.check(restart.probe_facts(sv, line("RUNNING   pid 4300, uptime 0:00:01")))
    for state in ("BACKOFF   Exited too quickly (process log may have details)", "EXITED    Dec 05 05:30 PM", "FATAL     Exited too quickly"):
        w = restart.CrashWatch(sv)
        why = w.check(restart.probe_facts(sv, line(state)))
        assert why.startswith(f"crash loop: supervisord reports the service {state.split()[0]} ") and why.endswith(" during the health gate"), why
    assert restart.probe_facts(sv, "unix:///run/supervisor.sock no such file") is None

    pf = PidfileRestart(strategy="pidfile", pidfile="/run/s.pid", command=["/bin/true"])
    w = restart.CrashWatch(pf)
    assert w.check(restart.probe_facts(pf, "17\n")) is None
    assert "a new process wrote the pidfile" in w.check(restart.probe_facts(pf, "18\n"))
    assert restart.probe_facts(pf, "cat: /run/s.pid: No such file or directory") is None
