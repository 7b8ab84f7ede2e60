"""The per-host deploy lock: an atomic `mkdir <state_dir>/lock` with owner.json inside (who, pid,
time, release id, a random token). Released in `finally`; after a dropped connection the tool
reconnects once to release it. A lock left by a crashed run stays until someone looks: the next run
is refused (exit 6) and names the holder; `--break-lock` removes it."""

from __future__ import annotations

import getpass
import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from deploy.errors import RemoteRefused, RemoteUnreachable
from deploy.agent_client import call_agent
from deploy.transport import Transport
from deploy.ui import warn


def owner(release_id: str | None, action: str) -> dict:
    return {"owner": f"{getpass.getuser()}@{socket.gethostname()}", "pid": os.getpid(), "time": time.time(),
            "action": action, "release": release_id, "token": secrets.token_hex(8)}


def describe(holder: dict) -> str:
    age = time.time() - float(holder.get("remote_time") or holder.get("time") or time.time())
    return f"{holder.get('owner', '?')} pid {holder.get('pid', '?')} ({holder.get('action', '?')} {holder.get('release') or ''}, {age:.0f}s ago)"


def break_lock(t: Transport) -> dict | None:
    r = call_agent(t, "unlock", {"state_dir": t.host.state_dir, "force": True}, 60)
    return r.get("holder") if r.get("released") else None


@contextmanager
def held(t: Transport, release_id: str | None, action: str) -> Iterator[dict]:
    me = owner(release_id, action)
    r = call_agent(t, "lock", {"state_dir": t.host.state_dir, "owner": me}, 60)
    if not r["acquired"]:
        raise RemoteRefused(f"{t.label}: another deploy holds the lock: {describe(r['holder'])}; "
                            f"if that run is gone, use --break-lock")
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
