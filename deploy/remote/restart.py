"""Restart strategies: the exact shell commands that restart the service, tell whether its process
is alive (for fail-fast health polling) and show its log tail. Arguments are shell-quoted."""

from __future__ import annotations

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
    """{'restart', 'alive', 'logs'} shell scripts for a restart strategy from the inventory."""
    if isinstance(r, SystemdRestart):
        sudo = "sudo -n " if r.sudo else ""
        return {
            "restart": f"{sudo}systemctl restart {q(r.unit)}",
            "alive": f"systemctl is-active --quiet {q(r.unit)}",
            "logs": _tail(r.log_file) or f"{sudo}journalctl -u {q(r.unit)} -n {LOG_LINES} --no-pager",
        }
    if isinstance(r, SupervisorRestart):
        ctl = q(r.supervisorctl) + (f" -c {q(r.config)}" if r.config else "")
        return {
            "restart": f"{ctl} restart {q(r.program)}",
            # supervisorctl status exits 0 only in RUNNING; STARTING counts as alive too
            "alive": f"{ctl} status {q(r.program)} | grep -Eq ' (RUNNING|STARTING) '",
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
            "logs": _tail(r.log_file) or "echo '(no log_file configured)'",
        }
    if isinstance(r, CommandRestart):
        return {
            "restart": f"( {r.stop} ) && ( {r.start} )",
            "alive": r.status,
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
