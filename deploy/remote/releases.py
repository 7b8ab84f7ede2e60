"""Releases on a host: push a build, roll back, and the automatic rollback after a failed swap.

Remote layout under the host's `state_dir`:
  releases/<id>/files/<rel>    the files this release puts in place (uploaded, for a push)
  releases/<id>/backup/<rel>   what was there before (byte for byte), absent files recorded as null
  releases/<id>/release.json   id, time, action, build id, series hash, files, backup, previous, outcome
  pristine/<rel>               the first pristine copy of each file seen (for `rollback --to pristine`)
  current.json                 the state in effect: {"state": <release id> | "pristine", ...}
  lock/owner.json              the deploy lock (deploy.remote.lock)
One transition = stage (backup) -> upload -> verify (hash, compile, import with the service python)
-> atomic per-file swap -> restart -> health gate; a failure after the swap restores the backup,
restarts and checks health again.
"""

from __future__ import annotations

import secrets
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..build.buildinfo import BuildInfo
from ..config.inventory import Host, Inventory
from ..config.launch import store_rel
from ..errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_ROLLBACK_FAILED,
    EXIT_UNFINISHED,
    DDTreeDeployError,
    DeployFailed,
    RemoteRefused,
    RemoteUnreachable,
    RollbackFailed,
    host_once,
    without_host,
)
from . import envfile, health, lock, records, restart
from .agent_client import call_agent
from .facts import HostFacts, choose_build, read_facts
from .plan import PRISTINE, make_plan
from .transport import Transport, TransportLost, connect

OUTCOME_BY_CODE = {1: "failed-rolled-back", 2: "config-error", 5: "unreachable", 6: "refused", 7: "rollback-failed",
                   8: "unfinished"}


class Events:
    """Progress hooks; the CLI renders them with rich. The default does nothing."""

    def step(self, host: str, message: str) -> None: ...

    def upload(self, host: str, nbytes: int, total: int) -> None: ...

    def waiting(self, host: str, elapsed: float, deadline: float) -> None: ...

    def warn(self, host: str, message: str) -> None: ...


@dataclass
class Outcome:
    host: str
    action: str
    ok: bool
    code: int
    message: str
    release: str | None = None
    changed: bool = False
    restarted: bool = False
    health: dict | None = None
    detail: str | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def new_release_id(tag: str) -> str:
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{tag}-{secrets.token_hex(2)}"


def _step(e: dict) -> str:
    return e.get("step", "?") + (f" {e['k']}/{e['n']}" if "k" in e else "")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Interrupted(Exception):
    """Raised at a safe point once STOP is set (the CLI's SIGINT/SIGTERM handler)."""


# Set by the CLI's first SIGINT/SIGTERM: every host stops at its next safe point (before the
# stage, between uploads, before the swap, after the swap, at each health poll) and rolls back if
# its files were swapped. A rollback in progress ignores it.
STOP = threading.Event()


class Releaser:
    """Runs one host's transitions over an open transport; journals every step on the host."""

    def __init__(self, t: Transport, events: Events | None = None):
        self.t = t
        self.h: Host = t.host
        self.ev = events or Events()
        self.restarts = 0          # service restarts this run caused
        self.changed = False       # the host's files differ from before this run
        self.rolled_back = False   # an automatic rollback ran (and restored the files)
        self.open_rid: str | None = None  # a transition started here and not finished yet
        self.recovered: list[str] = []    # unfinished transitions of earlier runs finished by this one
        # the health gate's speculative algorithm: the inventory's, or with [launch] that of the flags
        # the transition puts in place (set by push/rollback; _auto_rollback switches to the previous)
        self.expect = health.INVENTORY
        self.build: BuildInfo | None = None  # the build a push chose (the host's pin, or --build)
        self.staged: dict[str, dict] = {}  # release records (with their backup) staged by this run
        self.cause: dict[str, tuple[str, str | None]] = {}  # why a transition is being undone (first fault, log tail)

    def _warn(self, message: str) -> None:
        self.ev.warn(self.h.name, f"{self.h.name}: {message}")

    def _agent(self, op: str, payload: dict, timeout_s: int | None = None) -> dict:
        return call_agent(self.t, op, dict(payload, state_dir=self.h.state_dir), timeout_s)

    def _record(self, rid: str, updates: dict, current: dict | None = None) -> None:
        self._agent("record", {"release_id": rid, "updates": updates, "current": current})

    def _journal(self, rid: str, step: str, **info) -> None:
        self._agent("journal", {"release_id": rid, "step": step, "info": info})

    def _finish(self, rid: str, step: str, updates: dict, sglang_dir: str, files, current: dict | None = None,
                drop_uploads: bool = False) -> None:
        """Terminal journal step, after release.json/current.json and the removal of temp files."""
        self._agent("record", {"release_id": rid, "updates": updates, "current": current, "journal": step,
                               "cleanup": {"sglang_dir": sglang_dir, "files": sorted(files), "tags": [rid, rid + "-undo"]},
                               "drop_uploads": drop_uploads})
        if self.open_rid == rid:
            self.open_rid = None

    def _state_free(self) -> str:
        """`; the state filesystem has N kB free` (best effort, for an upload that failed on the host)."""
        r = self.t.run(f"df -Pk {shlex.quote(self.h.state_dir)} | tail -n 1", 30)
        cols = r.stdout.split()
        return f"; the state filesystem has {cols[3]} kB free" if r.ok and len(cols) > 3 and cols[3].isdigit() else ""

    def _rdir(self, rid: str) -> str:
        return f"{self.h.state_dir}/releases/{rid}"

    def _safe_point(self) -> None:
        if STOP.is_set():
            raise Interrupted()

    # -- the transition shared by push and rollback ------------------------------------------------
    def transition(self, facts: HostFacts, rid: str, record: dict, targets: dict[str, dict],
                   uploads: dict[str, Path] | None, new_state: str) -> Outcome:
        """Make the host's files equal `targets` ({rel: {"src": remote path|None, "sha256": hex|None}})."""
        name, sd = self.h.name, facts.sglang_dir
        swapped, healthy = False, None
        try:
            self._safe_point()
            self.ev.step(name, "backing up the current files")
            self.open_rid = rid
            staged = self._agent("stage", {"release_id": rid, "sglang_dir": sd, "files": sorted(targets),
                                           "pristine": record.get("pristine", {}), "record": record})
            if not staged.get("ok"):
                self.open_rid = None
                raise DeployFailed(f"{name}: {staged['error']} (nothing restarted)")
            self.staged[rid] = dict(record, backup=staged["backup"])
            if uploads:
                total = sum(p.stat().st_size for p in uploads.values())
                self.ev.step(name, f"uploading {len(uploads)} files")
                for rel, local in sorted(uploads.items()):
                    self._safe_point()
                    try:
                        self.t.put(local, f"{self._rdir(rid)}/files/{store_rel(rel)}", lambda n: self.ev.upload(name, n, total))
                    except OSError as exc:  # the state filesystem filled up, ...
                        err = f"upload of {rel} failed ({exc}{self._state_free()})"
                        self._finish(rid, "aborted", {"outcome": "aborted", "error": err}, sd, targets, drop_uploads=True)
                        raise DeployFailed(f"{name}: {err}; nothing changed, nothing restarted") from None
                self.ev.step(name, "verifying on the host (hash, compile, import with the service python)")
                v = self._agent("verify", {"release_id": rid, "sglang_dir": sd, "import_check": self.h.import_check,
                                           "files": {r: targets[r]["sha256"] for r in uploads}, "timeout": 900}, 960)
                if not v["ok"]:
                    self._finish(rid, "aborted", {"outcome": "aborted", "error": v["error"]}, sd, targets)
                    raise DeployFailed(f"{name}: {v['stage']} check failed before the swap: {v['error']} "
                                       "(nothing changed, nothing restarted)", detail=v.get("log"))
            self._safe_point()
            self.ev.step(name, "swapping files (atomic per file)")
            swapped = True
            a = self._agent("apply", {"sglang_dir": sd, "targets": targets, "tag": rid, "release_id": rid, "phase": "swap"})
            if not a["ok"] and (a.get("swapped", 0) == 0 or a.get("restored")):
                swapped = False
                self._finish(rid, "aborted", {"outcome": "aborted", "error": a["error"]}, sd, targets)
                raise DeployFailed(f"{name}: {a['error']}; every file is as before, temp files removed (nothing restarted)")
            self.changed = True
            if not a["ok"]:
                return self._undo(facts, rid, record, None, why=f"swap failed: {a['error']}")
            current = {"state": new_state, "release": rid, "action": record["action"], "time": _now(),
                       "build_id": record.get("build_id"), "files": a["files"]}
            self._record(rid, {"outcome": "swapped"}, current=current)
            self._safe_point()
            ok, report = self._restart_and_check(rid)
            if ok:
                healthy = report
                return self._healthy(rid, record, report, sd, targets)
            return self._undo(facts, rid, record, report)
        except Interrupted:
            if not swapped:
                if self.open_rid == rid:  # staged: end its journal (before the stage nothing exists on the host)
                    self._finish(rid, "aborted", {"outcome": "aborted", "error": "interrupted"}, sd, targets)
                raise DeployFailed(f"{name}: interrupted before the swap; the host is unchanged "
                                   f"(release {rid} aborted, nothing restarted)") from None
            return self._undo(facts, rid, record, None, why="interrupted by a signal")
        except TransportLost as exc:
            why = exc.message.removeprefix(f"{name}: ")  # the messages below name the host once
            self.ev.step(name, "connection lost; reconnecting")
            try:
                self.t.reconnect()  # RemoteUnreachable here: run_host reports the transition unfinished (exit 8)
            except RemoteUnreachable as exc2:
                again = exc2.message.removeprefix(name + ": ")
                if rid not in self.cause:
                    raise RemoteUnreachable(f"{name}: {why}; reconnecting failed: {again}") from None
                first, detail = self.cause[rid]  # the fault that started the rollback, not only the last one
                raise RemoteUnreachable(f"{name}: {first}; then, during the automatic rollback: {why}, and "
                                        f"reconnecting failed: {again}", detail=detail) from None
            if healthy is not None:  # the health gate passed: finish it again (idempotent), never undo
                return self._healthy(rid, record, healthy, sd, targets)
            if swapped:
                return self._undo(facts, rid, record, None, why=why)
            self._finish(rid, "aborted", {"outcome": "aborted", "error": why}, sd, targets)
            raise RemoteUnreachable(f"{name}: {why} before the swap; reconnected: the host is unchanged "
                                    f"(release {rid} marked aborted, nothing restarted)") from None

    def _healthy(self, rid: str, record: dict, report: health.HealthReport, sd: str, targets) -> Outcome:
        self._finish(rid, "healthy", {"outcome": "deployed" if record["action"] == "push" else "done",
                                      "health": report.to_json()}, sd, targets)
        return Outcome(self.h.name, record["action"], True, EXIT_OK, f"{record['action']} {rid}: healthy",
                       release=rid, changed=True, restarted=True, health=report.to_json())

    def _restart_and_check(self, rid: str, *, interruptible: bool = True) -> tuple[bool, health.HealthReport]:
        name = self.h.name
        self.ev.step(name, f"restarting ({self.h.restart.strategy})")
        self._journal(rid, "restarting")
        self.restarts += 1
        ok, out = restart.restart(self.t)
        self._journal(rid, "restarted", ok=ok)
        if not ok:
            return False, health.HealthReport(False, f"restart command failed: {out[-300:]}", 0.0,
                                              log_tail=restart.log_tail(self.t))
        self.ev.step(name, "waiting for the health gate")

        def tick(e: float) -> None:
            self.ev.waiting(name, e, self.h.health.deadline_s)
            if interruptible:
                self._safe_point()

        rep = health.wait_healthy(self.t, tick, self.expect)
        return rep.ok, rep

    def _restore(self, rid: str, rec: dict, reason: str, sglang_dir: str) -> tuple[bool, health.HealthReport]:
        """Put the backup of transition `rid` back, restart, health gate: journal rolling-back ->
        restoring k/n -> restored -> restarting -> restarted -> rolled-back. Not interruptible."""
        name = self.h.name
        if "backup" not in rec:
            raise RollbackFailed(f"{name}: release {rid} has no backup record; restore by hand from {self._rdir(rid)}/backup")
        backup = rec["backup"]
        self.open_rid = rid
        self._journal(rid, "rolling-back", reason=reason)
        if rec.get("launch"):  # [launch]: the backup restores the previous flags; expect their algorithm
            self.expect = rec["launch"]["previous_expect_algorithm"]
        targets = {rel: {"src": f"{self._rdir(rid)}/backup/{store_rel(rel)}" if sha else None, "sha256": sha}
                   for rel, sha in backup.items()}
        a = self._agent("apply", {"sglang_dir": sglang_dir, "targets": targets, "tag": rid + "-undo",
                                  "forward_tag": rid, "release_id": rid, "phase": "restore"})
        if not a["ok"]:
            raise RollbackFailed(f"{name}: rollback could not restore the files: {a['error']}; "
                                 f"originals are in {self._rdir(rid)}/backup")
        self.changed, self.rolled_back = False, True
        prev = rec.get("previous")
        current = {"state": prev or PRISTINE, "release": prev, "action": "auto-rollback", "time": _now(), "files": a["files"]}
        self._record(rid, {"outcome": "rolled-back", "error": reason}, current=current)
        ok, rep = self._restart_and_check(rid, interruptible=False)
        self._finish(rid, "rolled-back", {"health_after_rollback": rep.to_json()}, sglang_dir, targets)
        return ok, rep

    def _undo(self, facts: HostFacts, rid: str, record: dict, report: health.HealthReport | None,
              why: str | None = None) -> Outcome:
        name = self.h.name
        reason = why or (report.reason if report else "unknown failure")
        detail = report.log_tail if report and report.log_tail else None
        if rid in self.cause:  # a second fault while undoing: the first cause stays first, with its log tail
            first, first_detail = self.cause[rid]
            reason, detail = f"{first}; then, during the automatic rollback: {reason}", first_detail or detail
        else:
            self.cause[rid] = (reason, detail)
        self.ev.step(name, f"FAILED ({reason}); rolling back automatically")
        ok, rep2 = self._restore(rid, self.staged.get(rid) or self._release(rid), reason, facts.sglang_dir)
        if not ok:
            raise RollbackFailed(f"{name}: {reason}; files were restored byte for byte but the service is not healthy "
                                 f"after the rollback either ({rep2.reason})", detail=rep2.log_tail or detail)
        raise DeployFailed(f"{name}: {reason}; rolled back automatically (files restored byte for byte, "
                           "service healthy again)", detail=detail)

    def _release(self, rid: str) -> dict:
        rec = next((r for r in read_facts(self.t).releases if r.get("id") == rid), None)
        if rec is None:
            raise RollbackFailed(f"{self.h.name}: release {rid} has no record; restore by hand from {self._rdir(rid)}/backup")
        return rec

    # -- recovery of transitions left unfinished by an earlier run -----------------------------------
    def recover(self, *, break_lock: bool = False, facts: HostFacts | None = None) -> list[str]:
        """Finish every unfinished transition (journal not ending in healthy/rolled-back/aborted):
        files touched -> roll back to the recorded previous state; else -> aborted. Takes over the
        lock of a dead holder of this machine; a live holder means it is still running (left
        alone); a holder on another machine is left alone unless `break_lock`. Returns notes."""
        name = self.h.name
        facts = facts or read_facts(self.t)
        unf, holder = facts.unfinished, facts.lock
        if not unf and not holder:
            return []
        notes: list[str] = []
        take = None
        if holder:
            st = lock.holder_status(holder)
            if st == lock.ALIVE:
                if unf:
                    notes.append(f"transition {unf[0]['release']} in progress (lock held by live {lock.describe(holder)})")
                return notes
            if st == lock.UNKNOWN and not break_lock:
                for u in unf:
                    notes.append(f"UNFINISHED transition {u['release']} (last step: {_step(u['last'])}); lock held by "
                                 f"{lock.describe(holder)} on another machine: `ddtree-deploy unlock {name} --force` "
                                 "once that run is gone, and the next command finishes it")
                return notes
            take = holder.get("token") or None
            if take is None:  # an owner.json torn by a crash: no token to take over
                lock.break_lock(self.t)
            notes.append(f"took over the stale lock of {lock.describe(holder)} ({st})")
        try:
            with lock.held(self.t, None, "recover", take_over=take, warn=self._warn):
                if not unf:
                    return notes
                notes += self._recover_all(read_facts(self.t))  # again, under the lock
        except RemoteRefused as exc:  # someone else took the lock meanwhile (the notes are shown after the host's name)
            notes.append(without_host(exc.message, name))
        self.recovered = notes
        return notes

    def _recover_all(self, facts: HostFacts) -> list[str]:
        """Finish every unfinished transition of `facts` (read under the lock this run holds)."""
        recs = {r.get("id"): r for r in facts.releases}
        return [self._recover_one(u, recs.get(u["release"]) or {}, facts.sglang_dir) for u in facts.unfinished]

    def _recover_one(self, u: dict, rec: dict, sd: str) -> str:
        rid = u["release"]
        where = _step(u["last"])
        self.ev.step(self.h.name, f"unfinished transition {rid} (stopped at: {where}); finishing it")
        files = sorted(set(rec.get("files") or {}) | set(rec.get("backup") or {}))
        if not u["files_touched"]:
            self._finish(rid, "aborted", {"outcome": "aborted", "error": f"left unfinished at {where}; recovered"}, sd, files)
            return f"unfinished transition {rid} (stopped at: {where}) had not touched the files: marked aborted, temp files removed"
        why = f"left unfinished at {where}; recovered by a later command"
        if u.get("cause"):  # it was rolling back after a failure: that failure stays the recorded cause
            why = f"{u['cause']}; the automatic rollback was cut short at {where} and finished by a later command"
        ok, rep = self._restore(rid, rec, why, sd)
        self.restarts += 0
        return (f"unfinished transition {rid} (stopped at: {where}): rolled back to "
                f"{rec.get('previous') or PRISTINE}, files restored byte for byte, "
                + ("service healthy" if ok else f"service NOT healthy ({rep.reason})"))

    # -- push ----------------------------------------------------------------------------------------
    def push(self, build, *, force: bool = False, break_lock: bool = False) -> Outcome:
        """Lock, one facts read, one plan (plan.make_plan: what `plan` shows, its refusals, then its
        operations), the transition. `build`: a BuildInfo, or a BuildChoice (the host's pin)."""
        name = self.h.name
        notes: list[str] = []
        self.ev.step(name, "locking the host")
        with lock.taken(self.t, None, "push", break_lock=break_lock, notes=notes, warn=self._warn):
            self.recovered = notes
            self.ev.step(name, "reading host facts")
            facts = read_facts(self.t, build)
            if facts.unfinished:  # an earlier run's transition: finish it (we hold the lock), then read again
                self.recovered = notes + self._recover_all(facts)
                facts = read_facts(self.t, build)
            build = self.build = choose_build(build, facts, name)
            p = make_plan(self.t, build, facts, force=force)
            p.refuse("version", "launch")
            if p.noop:
                if not restart.alive(self.t):  # the files are there, the service is not: bring it back
                    self.expect = p.env.expect_after if p.env is not None else health.INVENTORY
                    out = self.restart_service(facts, f"already runs build {build.build_id}, but the service was stopped")
                    out.action, out.release = "push", (facts.current or {}).get("release")
                    return out
                return Outcome(name, "push", True, EXIT_OK, f"already runs build {build.build_id}: nothing to do",
                               release=(facts.current or {}).get("release"))
            p.refuse("drift", "space")
            rid = new_release_id(build.build_id[:8])
            env = p.env
            record, targets, uploads = p.release(rid, self._rdir(rid), _now())
            if env is not None:
                self.expect = env.expect_after
            try:
                out = self.transition(facts, rid, record, targets, uploads, new_state=rid)
            finally:
                if env is not None:
                    env.cleanup()
                self._prune(rid, record["previous"])
            if env is not None:
                out.extra["launch"] = env.to_json()
            return out

    # -- restart ---------------------------------------------------------------------------------------
    def restart_service(self, facts: HostFacts, reason: str) -> Outcome:
        """Restart the service and run the health gate, with the files as they are (the caller holds the
        lock). Journaled as a transition of its own (action `restart`, no files): restart-requested ->
        restarting -> restarted -> healthy | aborted. Not healthy after it: exit 1 with the log tail."""
        name = self.h.name
        rid = new_release_id("restart")
        self.open_rid = rid
        self._agent("record", {"release_id": rid, "journal": "restart-requested",
                               "updates": {"id": rid, "time": _now(), "action": "restart", "reason": reason,
                                           "files": {}, "outcome": "restarting",
                                           "state": (facts.current or {}).get("state") or PRISTINE}})
        ok, rep = self._restart_and_check(rid)
        if not ok:
            self._finish(rid, "aborted", {"outcome": "restart-failed", "error": rep.reason, "health": rep.to_json()},
                         facts.sglang_dir, [])
            raise DeployFailed(f"{name}: {reason}; restarted it, but it is not healthy ({rep.reason}); the files are "
                               "unchanged (`ddtree-deploy rollback` puts the previous state back)", detail=rep.log_tail)
        self._finish(rid, "healthy", {"outcome": "restarted", "health": rep.to_json()}, facts.sglang_dir, [])
        return Outcome(name, "restart", True, EXIT_OK, f"{reason}: restarted it, healthy", release=rid, restarted=True,
                       health=rep.to_json(), extra={"outcome": "restarted"})

    def restart(self, *, break_lock: bool = False) -> Outcome:
        """`ddtree-deploy restart HOST`: lock, facts (finishing an unfinished transition first), restart,
        health gate. The health gate expects the algorithm of the flags in place ([launch]) or the
        inventory's."""
        notes: list[str] = []
        with lock.taken(self.t, None, "restart", break_lock=break_lock, notes=notes, warn=self._warn):
            self.recovered = notes
            facts = read_facts(self.t)
            if facts.unfinished:
                self.recovered = notes + self._recover_all(facts)
                facts = read_facts(self.t)
            live = envfile.live(self.t, facts)
            if live is not None:
                self.expect = live["expect_algorithm"]
            state = (facts.current or {}).get("state") or "unmanaged"
            return self.restart_service(facts, f"restart requested (state {state})")

    def _prune(self, keep_id: str, previous: str | None) -> None:
        """Best effort: a prune that fails (connection lost) is retried by the next run."""
        protect = [p for p in (keep_id, previous) if p]
        try:
            self._agent("prune", {"keep": self.h.keep_releases, "protect": protect})
        except DDTreeDeployError as exc:
            self.ev.step(self.h.name, f"prune skipped ({without_host(exc.message, self.h.name)})")

    # -- rollback ------------------------------------------------------------------------------------
    def rollback(self, to: str | None, *, break_lock: bool = False) -> Outcome:
        name = self.h.name
        notes: list[str] = []
        with lock.taken(self.t, None, "rollback", break_lock=break_lock, notes=notes, warn=self._warn):
            self.recovered = notes
            facts = read_facts(self.t)
            if facts.unfinished:
                self.recovered = notes + self._recover_all(facts)
                facts = read_facts(self.t)
                if to is None and self.rolled_back:  # the recovery was the rollback asked for
                    cur = facts.current or {}
                    return Outcome(name, "rollback", True, EXIT_OK,
                                   f"rolled back the unfinished transition to {cur.get('state') or PRISTINE}",
                                   release=cur.get("release"), changed=True, restarted=self.restarts > 0)
            recs = {r["id"]: r for r in facts.releases if "id" in r}
            known = sorted({rel for r in recs.values() for rel in list(r.get("files") or {}) + list(r.get("backup") or {})})
            cur = facts.current or {}
            state = cur.get("state")
            pristine_sha: dict[str, str | None] = {}
            for r in sorted(recs.values(), key=lambda r: r["id"]):
                pristine_sha.update(r.get("pristine") or {})
            if not known:
                raise RemoteRefused(f"{name}: no releases recorded in {self.h.state_dir}; nothing to roll back")
            if to is None:
                if state in (None, PRISTINE) or state not in recs:
                    raise RemoteRefused(f"{name}: the host is in state {state or 'unknown'}; nothing to roll back "
                                        "(give --to <release> to restore a named release)")
                base = recs[state]
                new_state = base.get("previous") or PRISTINE
                targets = {rel: {"src": f"{self._rdir(state)}/backup/{store_rel(rel)}" if sha else None, "sha256": sha}
                           for rel, sha in (base.get("backup") or {}).items()}
            elif to == PRISTINE:
                new_state = PRISTINE
                targets = self._pristine_targets(known, pristine_sha)
            else:
                if to not in recs or recs[to].get("action") != "push" or recs[to].get("outcome") not in ("deployed", "rolled-back"):
                    pushes = [i for i, r in recs.items() if r.get("action") == "push" and r.get("outcome") == "deployed"]
                    raise RemoteRefused(f"{name}: no deployable release {to!r} on the host (known: {', '.join(sorted(pushes)) or 'none'})")
                new_state = to
                targets = self._pristine_targets([k for k in known if k not in recs[to]["files"]], pristine_sha)
                targets.update({rel: {"src": f"{self._rdir(to)}/files/{store_rel(rel)}", "sha256": sha}
                                for rel, sha in recs[to]["files"].items()})
            env = envfile.for_rollback(self.t, recs, targets, facts)  # [launch]: the flags it puts back (health gate)
            live = self._agent("hashes", {"sglang_dir": facts.sglang_dir, "files": sorted(targets)})["files"]
            if all(live.get(r) == t["sha256"] for r, t in targets.items()) and state == new_state:
                return Outcome(name, "rollback", True, EXIT_OK, f"already in state {new_state}: nothing to do")
            rid = new_release_id("rollback")
            record = {"id": rid, "time": _now(), "action": "rollback", "to": new_state,
                      "files": {r: t["sha256"] for r, t in targets.items()}, "previous": state if state != PRISTINE else None,
                      "pristine": {r: pristine_sha.get(r) for r in targets}}
            if env is not None:
                record["launch"] = env.record()
                self.expect = env.expect_after
            try:
                out = self.transition(facts, rid, record, targets, None, new_state=new_state)
            finally:
                self._prune(rid, new_state if new_state != PRISTINE else None)
            out.message = f"rolled back to {new_state}: healthy"
            if env is not None:
                out.extra["launch"] = env.to_json()
            return out

    def _pristine_targets(self, rels, pristine_sha: dict) -> dict[str, dict]:
        out = {}
        for rel in rels:
            sha = pristine_sha.get(rel)
            out[rel] = {"src": f"{self.h.state_dir}/pristine/{store_rel(rel)}" if sha else None, "sha256": sha}
        missing = [r for r, t in out.items() if t["src"]]
        if missing:
            store = self._agent("hashes", {"root": f"{self.h.state_dir}/pristine", "files": missing})["files"]
            bad = [r for r in missing if store.get(r) != out[r]["sha256"]]
            if bad:
                raise RemoteRefused(f"{self.h.name}: no pristine copy of {', '.join(bad)} on the host "
                                    "(it was drifted when first deployed); nothing changed")
        return out


def run_host(host: Host, inventory: Inventory, action: str, events: Events | None = None, **kw) -> Outcome:
    """Connect, run `action` ('push' or 'rollback'), close; every error becomes an Outcome with its exit code.
    The outcome tells what happened on the host (changed, restarted, rolled back, recovered), and is
    recorded locally (deploy-state/<host>.jsonl)."""
    t, build, r = None, kw.get("build"), None
    try:
        t = connect(host, inventory)
        r = Releaser(t, events)
        if action == "push":
            out = r.push(build, force=kw.get("force", False), break_lock=kw.get("break_lock", False))
            build = r.build
            out.extra.update(build_id=build.build_id, sglang_version=build.sglang_version)
        elif action == "restart":
            out = r.restart(break_lock=kw.get("break_lock", False))
        else:
            out = r.rollback(kw.get("to"), break_lock=kw.get("break_lock", False))
    except DDTreeDeployError as exc:
        code, msg = exc.exit_code, exc.message
        if r is not None and r.open_rid and code != EXIT_ROLLBACK_FAILED:
            code = EXIT_UNFINISHED
            msg += (f"; transition {r.open_rid} is UNFINISHED on the host (its journal records the step): the next "
                    f"push/status/rollback/plan of {host.name} finishes it")
        out = Outcome(host.name, action, False, code, msg, detail=exc.detail)
    except Exception as exc:  # a bug or an unmapped library error: report it in this host's row, keep the others going
        import traceback

        out = Outcome(host.name, action, False, EXIT_FAILED, f"{host.name}: unexpected error {type(exc).__name__}: {exc}",
                      detail=traceback.format_exc(limit=8))
    finally:
        if t is not None:
            t.close()
    if r is not None:  # what really happened on the host, whatever the error path
        out.changed = out.changed or r.changed
        out.restarted = out.restarted or r.restarts > 0
        out.extra.update(restarts=r.restarts, rolled_back=r.rolled_back, recovered=r.recovered)
        if r.recovered:
            out.message = "recovered: " + "; ".join(without_host(n, host.name) for n in r.recovered) + " | " + out.message
    out.message = host_once(out.message, host.name)
    if STOP.is_set():
        out.extra["interrupted"] = True
    build = r.build if r is not None and r.build is not None else (build if isinstance(build, BuildInfo) else None)
    outcome = ("done" if out.changed else "noop") if out.ok else OUTCOME_BY_CODE.get(out.code, "failed")
    if out.ok and out.extra.get("outcome"):  # e.g. `restarted`: nothing changed, but something was done
        outcome = out.extra["outcome"]
    if outcome == "failed-rolled-back" and not out.extra.get("rolled_back"):
        outcome = "failed"  # stopped before the swap (a check, an upload, a signal): nothing to roll back
    records.append(host.name, {"time": _now(), "host": host.name, "action": action, "ok": out.ok, "code": out.code,
                               "outcome": outcome, "rolled_back": out.extra.get("rolled_back", False),
                               "restarts": out.extra.get("restarts", 0), "interrupted": out.extra.get("interrupted", False),
                               "recovered": out.extra.get("recovered", []),
                               "release": out.release, "message": out.message, "changed": out.changed,
                               "build_id": build.build_id if build else None,
                               "series_sha256": build.series_sha256 if build else None,
                               "files": {r: f.sha256 for r, f in build.files.items()} if build else None})
    return out


def recover_host(t: Transport, events: Events | None = None, *, break_lock: bool = False,
                 facts: HostFacts | None = None) -> list[str]:
    """For status/plan: finish unfinished transitions of this host (`facts`: already read); notes,
    also recorded locally."""
    r = Releaser(t, events)
    notes = r.recover(break_lock=break_lock, facts=facts)
    if r.restarts or r.rolled_back or any("aborted" in n or "took over" in n for n in notes):
        records.append(t.host.name, {"time": _now(), "host": t.host.name, "action": "recover", "ok": True, "code": 0,
                                     "outcome": "recovered", "message": "; ".join(notes), "changed": r.rolled_back,
                                     "restarts": r.restarts})
    return notes
