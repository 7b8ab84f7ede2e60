"""Restart strategies: the exact shell commands that restart the service, tell whether its process
is alive (for fail-fast health polling), read what its supervisor says about it (`probe`: main
PID, restart count, state; to see a crash loop during the health gate) and show its log tail.
Arguments are shell-quoted."""

from __future__ import annotations

import re
from dataclasses import dataclass
from shlex import quote as q

from ..config.inventory import (
    CommandRestart,
    PidfileRestart,
    SupervisorRestart,
    SystemdRestart,
)
from .transport import Transport

LOG_LINES = 40


def _tail(path: str | None) -> str | None:
    return f"tail -n {LOG_LINES} {q(path)}" if path else None


def commands(r) -> dict[str, str]:
    """{'restart', 'alive', 'probe', 'logs'} shell scripts for a restart strategy from the inventory
    (`probe`: None where the strategy has nothing to read; parsed by `probe_facts`)."""
    if isinstance(r, SystemdRestart):
        sudo = "sudo -n " if r.sudo else ""
        return {
            "restart": f"{sudo}systemctl restart {q(r.unit)}",
            "alive": f"systemctl is-active --quiet {q(r.unit)}",
            "probe": f"systemctl show --property=MainPID,NRestarts,ActiveState,SubState {q(r.unit)}",
            "logs": _tail(r.log_file) or f"{sudo}journalctl -u {q(r.unit)} -n {LOG_LINES} --no-pager",
        }
    if isinstance(r, SupervisorRestart):
        ctl = q(r.supervisorctl) + (f" -c {q(r.config)}" if r.config else "")
        return {
            "restart": f"{ctl} restart {q(r.program)}",
            # supervisorctl status exits 0 only in RUNNING; STARTING counts as alive too
            "alive": f"{ctl} status {q(r.program)} | grep -Eq ' (RUNNING|STARTING) '",
            "probe": f"{ctl} status {q(r.program)}",
            "logs": _tail(r.log_file) or f"{ctl} tail -{LOG_LINES * 120} {q(r.program)} stderr",
        }
    if isinstance(r, PidfileRestart):
        argv = " ".join(q(a) for a in r.command[1:])
        out = f" --output {q(r.log_file)}" if r.log_file else ""
        return {
            "restart": (f"start-stop-daemon --stop --quiet --pidfile {q(r.pidfile)} --retry {q(r.stop_retry)} "
                        f"--remove-pidfile --oknodo && start-stop-daemon --start --background --make-pidfile "
                        f"--pidfile {q(r.pidfile)} --chdir {q(r.chdir)}{out} --startas {q(r.command[0])} -- {argv}"),
            "alive": f"start-stop-daemon --status --pidfile {q(r.pidfile)}",
            "probe": f"cat {q(r.pidfile)}",
            "logs": _tail(r.log_file) or "echo '(no log_file configured)'",
        }
    if isinstance(r, CommandRestart):
        return {
            "restart": f"( {r.stop} ) && ( {r.start} )",
            "alive": r.status,
            "probe": None,
            "logs": _tail(r.log_file) or "echo '(no log_file configured)'",
        }
    raise TypeError(f"unknown restart strategy {r!r}")


def restart(t: Transport) -> tuple[bool, str]:
    # a unit of Type=notify returns only once the service is up: allow the whole health deadline
    r = t.run(commands(t.host.restart)["restart"], int(t.host.health.deadline_s) + 60)
    return r.ok, (r.stdout + r.stderr).strip()


def alive(t: Transport) -> bool:
    return t.run(commands(t.host.restart)["alive"], 30).ok


def log_tail(t: Transport) -> str:
    r = t.run(commands(t.host.restart)["logs"] + " 2>&1", 30)
    return "\n".join((r.stdout + r.stderr).strip().splitlines()[-LOG_LINES:])


def service_state(t: Transport) -> str:
    return "running" if alive(t) else "stopped"


# -- crash loops: what the supervisor says between two health polls ----------------------------------
@dataclass
class Probe:
    """What the supervisor says about the service at one health poll (None: not said)."""

    pid: int | None = None       # main PID (systemd MainPID, supervisord `pid N`, the pidfile)
    restarts: int | None = None  # systemd NRestarts (supervisord and pidfiles keep no count)
    state: str | None = None     # supervisord state / systemd ActiveState/SubState
    text: str = ""               # the supervisor's own words, for the message


SUPERVISOR_STOPPED = ("BACKOFF", "EXITED", "FATAL")  # supervisord: the program died after it was started


def probe_facts(r, out: str | None) -> Probe | None:
    """Parse the `probe` command's output for the strategy `r`; None when it said nothing usable."""
    if out is None:
        return None
    text = out.strip()
    if isinstance(r, SystemdRestart):
        kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        if "MainPID" not in kv:
            return None
        def num(k: str) -> int | None:
            return int(kv[k]) if kv.get(k, "").isdigit() else None

        return Probe(num("MainPID") or None, num("NRestarts"), f"{kv.get('ActiveState', '?')}/{kv.get('SubState', '?')}",
                     f"ActiveState={kv.get('ActiveState', '?')} SubState={kv.get('SubState', '?')}")
    if isinstance(r, SupervisorRestart):
        m = re.match(r"^(\S+)\s+([A-Z]+)\b\s*(.*)$", text.splitlines()[-1] if text else "")
        if not m:
            return None
        pid = re.search(r"\bpid (\d+)", m.group(3))
        return Probe(int(pid.group(1)) if pid else None, None, m.group(2), f"{m.group(2)} {m.group(3)}".strip())
    if isinstance(r, PidfileRestart):
        return Probe(int(text), None, None, f"pidfile {r.pidfile}: {text}") if text.isdigit() else None
    return None


class CrashWatch:
    """Tells a crash loop from the supervisor's facts polled during one health gate: the first facts
    after the restart are the reference; a later main PID or a higher restart count means the
    supervisor restarted the service since (it died), and a supervisor that reports a backoff or
    an exit (supervisord BACKOFF/EXITED/FATAL, systemd auto-restart) says so outright."""

    def __init__(self, r):
        self.r = r
        self.name = {SystemdRestart: "systemd", SupervisorRestart: "supervisord"}.get(type(r), "?")
        self.first_pid: int | None = None
        self.first_restarts: int | None = None

    def check(self, p: Probe | None) -> str | None:
        """The reason to fail the health gate now ("crash loop: ..."), or None."""
        if p is None:
            return None
        if self.first_restarts is None and p.restarts is not None:
            self.first_restarts = p.restarts
        if p.restarts is not None and self.first_restarts is not None and p.restarts > self.first_restarts:
            n = p.restarts - self.first_restarts
            pids = f", pid {self.first_pid} -> {p.pid or 'none'}" if self.first_pid else ""
            return (f"crash loop: {self.name} restarted the service {n} time{'s' * (n != 1)} during the health gate "
                    f"(NRestarts {self.first_restarts} -> {p.restarts}{pids}; {p.text})")
        if isinstance(self.r, SupervisorRestart) and p.state in SUPERVISOR_STOPPED:
            return f"crash loop: supervisord reports the service {p.text} during the health gate"
        if isinstance(self.r, SystemdRestart) and p.state and p.state.endswith("/auto-restart"):
            return f"crash loop: systemd is restarting the service ({p.text})"
        if p.pid is not None:
            if self.first_pid is None:
                self.first_pid = p.pid
            elif p.pid != self.first_pid:
                who = "a new process wrote the pidfile" if isinstance(self.r, PidfileRestart) else f"{self.name} restarted it"
                return f"crash loop: the service's pid changed during the health gate ({self.first_pid} -> {p.pid}): {who}"
        return None
