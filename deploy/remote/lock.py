"""The per-host deploy lock: an atomic `mkdir <state_dir>/lock` with owner.json inside (who, control
machine, boot id, pid and its start time, release id, a random token). Released in `finally`; after
a dropped connection the tool reconnects once to release it.

A lock whose holder is a dead process of *this* machine (same hostname and boot id, the pid gone,
a zombie, or reused by another process) is stale: any later command takes it over (journal
recovery, deploy.remote.releases) and says so. A holder on another machine cannot be checked from here:
the run is refused (exit 6) naming it; `ddtree-deploy unlock HOST --force` or `--break-lock`.
Nothing here prints: a failure to release is passed to the caller's `warn`."""

from __future__ import annotations

import getpass
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import RemoteRefused, RemoteUnreachable
from .agent_client import call_agent
from .transport import Transport

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


def try_lock(t: Transport, me: dict, take_over: str | None = None) -> dict:
    """One `lock` call: {"acquired": True} or {"acquired": False, "holder": ..., "unfinished": [...]}."""
    return call_agent(t, "lock", {"state_dir": t.host.state_dir, "owner": me, "take_over": take_over}, 60)


def refusal(label: str, holder: dict, unfinished: list[dict] | None = None) -> str:
    """Why a command cannot take the lock, and what to do about it (by what can be known of the holder)."""
    st = holder_status(holder)
    if st == ALIVE:
        hint = "wait for it to finish"
    else:
        hint = (f"if that run is gone: `ddtree-deploy unlock {label} --force` or --break-lock "
                "(it runs on another machine: this one cannot check it)")
    unf = "".join(f"; UNFINISHED transition {u['release']} (last step: {(u.get('last') or {}).get('step', '?')}): "
                  "the next command after the lock is freed finishes it" for u in unfinished or [])
    return f"{label}: another deploy holds the lock: {describe(holder)}{unf}; {hint}"


@contextmanager
def held(t: Transport, release_id: str | None, action: str, take_over: str | None = None,
         warn: Callable[[str], None] | None = None) -> Iterator[dict]:
    """Hold the host lock; `take_over` = the token of a holder known to be dead. `warn` gets the
    message when the lock cannot be released at the end (this layer prints nothing)."""
    me = owner(release_id, action)
    r = try_lock(t, me, take_over)
    if not r["acquired"]:
        raise RemoteRefused(refusal(t.label, r["holder"], r.get("unfinished")))
    try:
        yield me
    finally:
        release(t, me["token"], warn)


_break_any = break_lock  # `taken` has a parameter of that name


@contextmanager
def taken(t: Transport, release_id: str | None, action: str, *, break_lock: bool = False,
          notes: list[str], warn: Callable[[str], None] | None = None) -> Iterator[dict]:
    """Take the host lock before anything else is read: a holder that is a dead process of this
    machine is taken over, any holder with `break_lock`; a live or unknown one refuses (exit 6).
    What was done to another holder's lock is appended to `notes`."""
    me = owner(release_id, action)
    r = try_lock(t, me)
    if not r["acquired"]:
        holder = r["holder"]
        st = holder_status(holder)
        if st == DEAD and holder.get("token"):
            r = try_lock(t, me, holder["token"])
            notes.append(f"took over the stale lock of {describe(holder)} ({st})")
        elif st == DEAD or break_lock:
            broken = _break_any(t)
            notes.append(f"broke the lock held by {describe(broken or holder)}" + ("" if st == DEAD else f" ({st})"))
            r = try_lock(t, me)
        if not r["acquired"]:
            raise RemoteRefused(refusal(t.label, r["holder"], r.get("unfinished")))
    try:
        yield me
    finally:
        release(t, me["token"], warn)


def release(t: Transport, token: str, warn: Callable[[str], None] | None = None) -> None:
    say = warn or (lambda _m: None)
    for attempt in (1, 2):
        try:
            call_agent(t, "unlock", {"state_dir": t.host.state_dir, "token": token}, 60)
            return
        except RemoteUnreachable:
            if attempt == 2:
                say(f"could not release the deploy lock ({t.host.state_dir}/lock); "
                    "the next run will report it (use --break-lock once you have checked the host)")
                return
            try:
                t.reconnect()
            except RemoteUnreachable:
                say("could not reconnect to release the deploy lock; use --break-lock later")
                return
