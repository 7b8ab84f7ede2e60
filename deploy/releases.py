"""Releases on a host: push a build, roll back, and the automatic rollback after a failed swap.

Remote layout under the host's `state_dir`:
  releases/<id>/files/<rel>    the files this release puts in place (uploaded, for a push)
  releases/<id>/backup/<rel>   what was there before (byte for byte), absent files recorded as null
  releases/<id>/release.json   id, time, action, build id, series hash, files, backup, previous, outcome
  pristine/<rel>               the first pristine copy of each file seen (for `rollback --to pristine`)
  current.json                 the state in effect: {"state": <release id> | "pristine", ...}
  lock/owner.json              the deploy lock (deploy.lock)
One transition = stage (backup) -> upload -> verify (hash, compile, import with the service python)
-> atomic per-file swap -> restart -> health gate; a failure after the swap restores the backup,
restarts and checks health again.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy import health, lock, pins, records, restart
from deploy.buildinfo import BuildInfo
from deploy.errors import (
    EXIT_FAILED,
    EXIT_OK,
    DDTreeDeployError,
    DeployFailed,
    RemoteRefused,
    RollbackFailed,
)
from deploy.agent_client import call_agent
from deploy.facts import HostFacts, gather, require_version
from deploy.inventory import Host, Inventory
from deploy.transport import Transport, TransportLost, connect

PRISTINE = "pristine"
OUTCOME_BY_CODE = {1: "failed-rolled-back", 2: "config-error", 5: "unreachable", 6: "refused", 7: "rollback-failed"}


class Events:
    """Progress hooks; the CLI renders them with rich. The default does nothing."""

    def step(self, host: str, message: str) -> None: ...

    def upload(self, host: str, nbytes: int, total: int) -> None: ...

    def waiting(self, host: str, elapsed: float, deadline: float) -> None: ...


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


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Releaser:
    """Runs one host's transitions over an open transport."""

    def __init__(self, t: Transport, events: Events | None = None):
        self.t = t
        self.h: Host = t.host
        self.ev = events or Events()

    def _agent(self, op: str, payload: dict, timeout_s: int | None = None) -> dict:
        return call_agent(self.t, op, dict(payload, state_dir=self.h.state_dir), timeout_s)

    def _record(self, rid: str, updates: dict, current: dict | None = None) -> None:
        self._agent("record", {"release_id": rid, "updates": updates, "current": current})

    def _rdir(self, rid: str) -> str:
        return f"{self.h.state_dir}/releases/{rid}"

    # -- the transition shared by push and rollback ------------------------------------------------
    def transition(self, facts: HostFacts, rid: str, record: dict, targets: dict[str, dict],
                   uploads: dict[str, Path] | None, new_state: str) -> Outcome:
        """Make the host's files equal `targets` ({rel: {"src": remote path|None, "sha256": hex|None}})."""
        name, sd = self.h.name, facts.sglang_dir
        swapped = False
        try:
            self.ev.step(name, "backing up the current files")
            staged = self._agent("stage", {"release_id": rid, "sglang_dir": sd, "files": sorted(targets),
                                           "pristine": record.get("pristine", {}), "record": record})
            backup = staged["backup"]
            if uploads:
                total = sum(p.stat().st_size for p in uploads.values())
                self.ev.step(name, f"uploading {len(uploads)} files")
                for rel, local in sorted(uploads.items()):
                    self.t.put(local, f"{self._rdir(rid)}/files/{rel}", lambda n: self.ev.upload(name, n, total))
                self.ev.step(name, "verifying on the host (hash, compile, import with the service python)")
                v = self._agent("verify", {"release_id": rid, "sglang_dir": sd, "import_check": self.h.import_check,
                                           "files": {r: targets[r]["sha256"] for r in uploads}, "timeout": 900}, 960)
                if not v["ok"]:
                    self._record(rid, {"outcome": "aborted", "error": v["error"]})
                    raise DeployFailed(f"{name}: {v['stage']} check failed before the swap: {v['error']} "
                                       "(nothing changed, nothing restarted)", detail=v.get("log"))
            self.ev.step(name, "swapping files (atomic per file)")
            swapped = True
            a = self._agent("apply", {"sglang_dir": sd, "targets": targets, "tag": rid})
            if not a["ok"]:
                raise DeployFailed(f"{name}: swap failed: {a['error']}")
            current = {"state": new_state, "release": rid, "action": record["action"], "time": _now(),
                       "build_id": record.get("build_id"), "files": a["files"]}
            self._record(rid, {"outcome": "swapped"}, current=current)
            self.t.test_hook("after-swap")
            ok, report = self._restart_and_check()
            if ok:
                self._record(rid, {"outcome": "deployed" if record["action"] == "push" else "done",
                                   "health": report.to_json()})
                return Outcome(name, record["action"], True, EXIT_OK, f"{record['action']} {rid}: healthy",
                               release=rid, changed=True, restarted=True, health=report.to_json())
            return self._auto_rollback(facts, rid, backup, record, report)
        except KeyboardInterrupt:
            if not swapped:
                self._record(rid, {"outcome": "aborted", "error": "interrupted"})
                raise
            return self._auto_rollback(facts, rid, self._backup_of(rid), record, None, why="interrupted (Ctrl-C)")
        except TransportLost as exc:
            self.ev.step(name, "connection lost; reconnecting")
            self.t.reconnect()
            if swapped:
                return self._auto_rollback(facts, rid, self._backup_of(rid), record, None, why=exc.message)
            self._record(rid, {"outcome": "aborted", "error": exc.message})
            raise DeployFailed(f"{name}: {exc.message} before the swap; the host is unchanged "
                               f"(release {rid} marked aborted)") from None

    def _backup_of(self, rid: str) -> dict:
        rec = next((r for r in self._agent("facts", {"sglang_dir": self.h.sglang_dir, "files": []})["releases"]
                    if r.get("id") == rid), None)
        if rec is None or "backup" not in rec:
            raise RollbackFailed(f"{self.h.name}: release {rid} has no backup record; restore by hand from {self._rdir(rid)}/backup")
        return rec["backup"]

    def _restart_and_check(self) -> tuple[bool, health.HealthReport]:
        name = self.h.name
        self.ev.step(name, f"restarting ({self.h.restart.strategy})")
        ok, out = restart.restart(self.t)
        if not ok:
            return False, health.HealthReport(False, f"restart command failed: {out[-300:]}", 0.0,
                                              log_tail=restart.log_tail(self.t))
        self.ev.step(name, "waiting for the health gate")
        rep = health.wait_healthy(self.t, lambda e: self.ev.waiting(name, e, self.h.health.deadline_s))
        return rep.ok, rep

    def _auto_rollback(self, facts: HostFacts, rid: str, backup: dict, record: dict,
                       report: health.HealthReport | None, why: str | None = None) -> Outcome:
        name = self.h.name
        reason = why or (report.reason if report else "unknown failure")
        self.ev.step(name, f"FAILED ({reason}); rolling back automatically")
        targets = {rel: {"src": f"{self._rdir(rid)}/backup/{rel}" if sha else None, "sha256": sha}
                   for rel, sha in backup.items()}
        a = self._agent("apply", {"sglang_dir": facts.sglang_dir, "targets": targets, "tag": rid + "-undo"})
        if not a["ok"]:
            raise RollbackFailed(f"{name}: automatic rollback could not restore the files: {a['error']}; "
                                 f"originals are in {self._rdir(rid)}/backup")
        prev = record.get("previous")
        current = {"state": prev or PRISTINE, "release": prev, "action": "auto-rollback", "time": _now(),
                   "files": a["files"]}
        self._record(rid, {"outcome": "rolled-back", "error": reason,
                           "health": report.to_json() if report else None}, current=current)
        ok, rep2 = self._restart_and_check()
        detail = report.log_tail if report and report.log_tail else None
        if not ok:
            raise RollbackFailed(f"{name}: {reason}; files were restored byte for byte but the service is not healthy "
                                 f"after the rollback either ({rep2.reason})", detail=rep2.log_tail or detail)
        raise DeployFailed(f"{name}: {reason}; rolled back automatically (files restored byte for byte, "
                           "service healthy again)", detail=detail)

    # -- push ----------------------------------------------------------------------------------------
    def push(self, build: BuildInfo, *, force: bool = False, break_lock: bool = False) -> Outcome:
        name = self.h.name
        self.ev.step(name, "reading host facts")
        facts = gather(self.t, build)
        require_version(self.t, facts, build)
        if facts.up_to_date:
            return Outcome(name, "push", True, EXIT_OK, f"already runs build {build.build_id}: nothing to do",
                           release=(facts.current or {}).get("release"))
        if facts.drifted and not force:
            lst = ", ".join(f"{f.relpath} ({f.status})" for f in facts.drifted)
            raise RemoteRefused(f"{name}: files changed outside this tool: {lst}; refusing "
                                "(inspect with `ddtree-deploy plan --diff`, or --force to overwrite; the originals are backed up)")
        need = 2 * sum(f.size for f in build.files.values()) // (1 << 20) + self.h.min_free_mb
        low = {k: v for k, v in facts.free_mb.items() if v < need}
        if low:
            raise RemoteRefused(f"{name}: not enough disk ({low} MB free, need {need} MB)")
        if break_lock and facts.lock:
            holder = lock.break_lock(self.t)
            self.ev.step(name, f"broke the lock held by {lock.describe(holder or {})}")
        rid = new_release_id(build.build_id[:8])
        with lock.held(self.t, rid, "push"):
            facts = gather(self.t, build)  # again, under the lock
            if facts.up_to_date:
                return Outcome(name, "push", True, EXIT_OK, f"already runs build {build.build_id}: nothing to do")
            cur = facts.current or {}
            record = {"id": rid, "time": _now(), "action": "push", "build_id": build.build_id,
                      "series_sha256": build.series_sha256, "patches": build.patches,
                      "files": {r: f.sha256 for r, f in build.files.items()},
                      "pristine": {r: f.pristine_sha256 for r, f in build.files.items()},
                      "previous": cur.get("state") if cur.get("state") != PRISTINE else None}
            targets = {r: {"src": f"{self._rdir(rid)}/files/{r}", "sha256": f.sha256} for r, f in build.files.items()}
            uploads = {r: build.path_of(r) for r in build.files}
            out = self.transition(facts, rid, record, targets, uploads, new_state=rid)
            self._prune(rid, record["previous"])
            return out

    def _prune(self, keep_id: str, previous: str | None) -> None:
        protect = [p for p in (keep_id, previous) if p]
        self._agent("prune", {"keep": self.h.keep_releases, "protect": protect})

    # -- rollback ------------------------------------------------------------------------------------
    def rollback(self, to: str | None, *, break_lock: bool = False) -> Outcome:
        name = self.h.name
        raw = self._agent("facts", {"sglang_dir": self.h.sglang_dir, "files": []})
        recs = {r["id"]: r for r in raw["releases"] if "id" in r}
        known = sorted({rel for r in recs.values() for rel in list(r.get("files") or {}) + list(r.get("backup") or {})})
        cur = raw["current"] or {}
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
            targets = {rel: {"src": f"{self._rdir(state)}/backup/{rel}" if sha else None, "sha256": sha}
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
            targets.update({rel: {"src": f"{self._rdir(to)}/files/{rel}", "sha256": sha}
                            for rel, sha in recs[to]["files"].items()})
        f2 = self._agent("facts", {"sglang_dir": self.h.sglang_dir, "files": sorted(targets)})
        if all((f2["files"][r] or {}).get("sha256") == t["sha256"] for r, t in targets.items()) and state == new_state:
            return Outcome(name, "rollback", True, EXIT_OK, f"already in state {new_state}: nothing to do")
        facts = HostFacts(f2["python"], f2["sglang_dir"], f2["version"], f2["free_mb"], f2["current"], f2["lock"], [], {})
        if break_lock and f2["lock"]:
            lock.break_lock(self.t)
        rid = new_release_id("rollback")
        with lock.held(self.t, rid, "rollback"):
            record = {"id": rid, "time": _now(), "action": "rollback", "to": new_state,
                      "files": {r: t["sha256"] for r, t in targets.items()}, "previous": state if state != PRISTINE else None,
                      "pristine": {r: pristine_sha.get(r) for r in targets}}
            out = self.transition(facts, rid, record, targets, None, new_state=new_state)
            out.message = f"rolled back to {new_state}: healthy"
            self._prune(rid, new_state if new_state != PRISTINE else None)
            return out

    def _pristine_targets(self, rels, pristine_sha: dict) -> dict[str, dict]:
        out = {}
        for rel in rels:
            sha = pristine_sha.get(rel)
            out[rel] = {"src": f"{self.h.state_dir}/pristine/{rel}" if sha else None, "sha256": sha}
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
    Records the outcome locally (deploy-state/<host>.jsonl)."""
    t, build = None, kw.get("build")
    try:
        t = connect(host, inventory)
        r = Releaser(t, events)
        if action == "push":
            build = pins.build_for_host(t, build)  # the build of the host's pin (exit 6 when its SGLang has none)
            out = r.push(build, force=kw.get("force", False), break_lock=kw.get("break_lock", False))
            out.extra.update(build_id=build.build_id, sglang_version=build.sglang_version)
        else:
            out = r.rollback(kw.get("to"), break_lock=kw.get("break_lock", False))
    except DDTreeDeployError as exc:
        out = Outcome(host.name, action, False, exc.exit_code, exc.message, detail=exc.detail)
    except Exception as exc:  # a bug or an unmapped library error: report it in this host's row, keep the others going
        import traceback

        out = Outcome(host.name, action, False, EXIT_FAILED, f"{host.name}: unexpected error {type(exc).__name__}: {exc}",
                      detail=traceback.format_exc(limit=8))
    finally:
        if t is not None:
            t.close()
    build = build if isinstance(build, BuildInfo) else None
    outcome = ("done" if out.changed else "noop") if out.ok else OUTCOME_BY_CODE.get(out.code, "failed")
    records.append(host.name, {"time": _now(), "host": host.name, "action": action, "ok": out.ok, "code": out.code,
                               "outcome": outcome,
                               "release": out.release, "message": out.message, "changed": out.changed,
                               "build_id": build.build_id if build else None,
                               "series_sha256": build.series_sha256 if build else None,
                               "files": {r: f.sha256 for r, f in build.files.items()} if build else None})
    return out
