"""The per-host deploy lock: an atomic `mkdir <state_dir>/lock` with owner.json inside (who, control
machine, boot id, pid and its start time, release id, a random token). Released in `finally`; after
a dropped connection the tool reconnects once to release it.

A lock whose holder is a dead process of *this* machine (same hostname and boot id, the pid gone,
a zombie, or reused by another process) is stale: any later command takes it over (journal
recovery, deploy.releases) and says so. A holder on another machine cannot be checked from here:
the run is refused (exit 6) naming it; `ddtree-deploy unlock HOST --force` or `--break-lock`."""

from __future__ import annotations

import getpass
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .agent_client import call_agent
from .errors import RemoteRefused, RemoteUnreachable
from .transport import Transport
from .ui import warn

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"


def _boot_id() -> str | None:
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process, None if it does not exist."""
    try:
        raw = open(f"/proc/{int(pid)}/stat").read()
    except (OSError, ValueError):
        return None
    rest = raw.rsplit(")", 1)[1].split()
    return rest[0], rest[19]


def owner(release_id: str | None, action: str) -> dict:
    st = _proc_stat(os.getpid())
    return {"owner": f"{getpass.getuser()}@{socket.gethostname()}", "machine": socket.gethostname(),
            "boot_id": _boot_id(), "pid": os.getpid(), "pid_start": st[1] if st else None, "time": time.time(),
            "action": action, "release": release_id, "token": secrets.token_hex(8)}


def holder_status(holder: dict | None) -> str:
    """alive / dead / unknown (another machine, or an owner record without the fields to tell)."""
    if not holder:
        return DEAD
    machine = holder.get("machine") or str(holder.get("owner", "")).rpartition("@")[2]
    if machine != socket.gethostname() or not holder.get("pid"):
        return UNKNOWN
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return DEAD  # this machine rebooted since
    st = _proc_stat(holder["pid"])
    if st is None:
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return DEAD
        except (PermissionError, ValueError, OSError):
            return UNKNOWN
        return ALIVE if not os.path.isdir("/proc") else DEAD
    if st[0] in ("Z", "X") or (holder.get("pid_start") and st[1] != holder["pid_start"]):
        return DEAD
    return ALIVE


def describe(holder: dict) -> str:
    age = time.time() - float(holder.get("remote_time") or holder.get("time") or time.time())
    return f"{holder.get('owner', '?')} pid {holder.get('pid', '?')} ({holder.get('action', '?')} {holder.get('release') or ''}, {age:.0f}s ago)"


def break_lock(t: Transport) -> dict | None:
    r = call_agent(t, "unlock", {"state_dir": t.host.state_dir, "force": True}, 60)
    return r.get("holder") if r.get("released") else None


@contextmanager
def held(t: Transport, release_id: str | None, action: str, take_over: str | None = None) -> Iterator[dict]:
    """Hold the host lock; `take_over` = the token of a holder known to be dead."""
    me = owner(release_id, action)
    r = call_agent(t, "lock", {"state_dir": t.host.state_dir, "owner": me, "take_over": take_over}, 60)
    if not r["acquired"]:
        raise RemoteRefused(f"{t.label}: another deploy holds the lock: {describe(r['holder'])}; "
                            f"if that run is gone: `ddtree-deploy unlock {t.label}` (or --break-lock)")
    try:
        yield me
    finally:
        release(t, me["token"])


def release(t: Transport, token: str) -> None:
    for attempt in (1, 2):
        try:
            call_agent(t, "unlock", {"state_dir": t.host.state_dir, "token": token}, 60)
            return
        except RemoteUnreachable:
            if attempt == 2:
                warn(f"{t.label}: could not release the deploy lock ({t.host.state_dir}/lock); "
                     "the next run will report it (use --break-lock once you have checked the host)")
                return
            try:
                t.reconnect()
            except RemoteUnreachable:
                warn(f"{t.label}: could not reconnect to release the deploy lock; use --break-lock later")
                return
