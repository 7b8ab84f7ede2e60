"""What `push` does to a host, decided once: facts + build -> a Plan (refusals, and the ordered list
of operations with the files each touches). `plan` prints it (read-only, with per-file unified
diffs); `push` (releases.Releaser.push) refuses with its refusals and puts in place the files its
operations name."""

from __future__ import annotations

import base64
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from ..build.buildinfo import BuildInfo
from ..config import launch
from ..config.launch import store_rel
from ..errors import RemoteRefused
from . import envfile
from .agent_client import call_agent
from .facts import CURRENT, HostFacts, version_mismatch
from .restart import commands
from .transport import Transport

PRISTINE = "pristine"  # the state of a host before any release (current.json), also releases.PRISTINE


@dataclass
class Op:
    """One operation of a push, in order. kind: lock, backup, upload, verify, swap, launch, restart,
    health, algorithm, smoke, on-failure, record, unlock (or nothing); files: the files it reads or
    writes on the host (package-relative; the [launch] env file by its absolute path)."""

    kind: str
    text: str
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"kind": self.kind, "text": self.text, "files": self.files}


@dataclass
class Refusal:
    """Why push would refuse (kind: version, launch, drift, space, lock); `message` is push's error."""

    kind: str
    message: str


@dataclass
class Plan:
    host: str
    facts: HostFacts
    build: BuildInfo
    ops: list[Op] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    diffs: dict[str, str] = field(default_factory=dict)
    env: launch.EnvChange | None = None  # [launch]: what push does to the env file

    @property
    def noop(self) -> bool:
        return self.facts.up_to_date and launch.unchanged(self.env)

    @property
    def steps(self) -> list[str]:
        return [op.text for op in self.ops]

    def op(self, kind: str) -> Op | None:
        return next((o for o in self.ops if o.kind == kind), None)

    def refuse(self, *kinds: str) -> None:
        """push: raise the first refusal of these kinds (in the order they were found)."""
        for r in self.refusals:
            if r.kind in kinds:
                raise RemoteRefused(r.message)

    def release(self, rid: str, release_dir: str, now: str) -> tuple[dict, dict[str, dict], dict[str, Path]]:
        """push: the release record, the swap targets ({rel: {"src", "sha256"}}) and the uploads
        ({rel: local file}) of the files the upload and launch operations name."""
        b, cur = self.build, self.facts.current or {}
        files = self.op("upload").files
        record = {"id": rid, "time": now, "action": "push", "build_id": b.build_id,
                  "series_sha256": b.series_sha256, "patches": b.patches,
                  "files": {r: b.files[r].sha256 for r in files},
                  "pristine": {r: b.files[r].pristine_sha256 for r in files},
                  "previous": cur.get("state") if cur.get("state") != PRISTINE else None}
        targets = {r: {"src": f"{release_dir}/files/{store_rel(r)}", "sha256": b.files[r].sha256} for r in files}
        uploads = {r: b.path_of(r) for r in files}
        if self.op("launch") is not None:  # [launch]: the env file is one more file of this release
            self.env.add_to_push(record, targets, uploads, release_dir)
        return record, targets, uploads

    def to_json(self) -> dict:
        return {"host": self.host, "facts": self.facts.to_json(), "noop": self.noop, "steps": self.steps,
                "operations": [op.to_json() for op in self.ops], "refusals": [r.message for r in self.refusals],
                "diffs": self.diffs, "launch": self.env.to_json() if self.env else None}


def make_plan(t: Transport, build: BuildInfo, facts: HostFacts, *, force: bool = False) -> Plan:
    h = t.host
    p = Plan(h.name, facts, build)
    bad_version = version_mismatch(t, facts, build)
    if bad_version:
        p.refusals.append(Refusal("version", bad_version))
    try:
        p.env = envfile.for_push(t, build, facts)
    except RemoteRefused as exc:  # e.g. the variable spans several lines: push would refuse
        p.refusals.append(Refusal("launch", exc.message))
    drifted = [f"{f.relpath} ({f.status})" for f in facts.drifted] + ([f"{p.env.path} (drifted)"] if p.env and p.env.drifted else [])
    if drifted and not force:
        p.refusals.append(Refusal("drift", f"{h.name}: files changed outside this tool: {', '.join(drifted)}; refusing "
                                           "(inspect with `ddtree-deploy plan --diff`, or --force to overwrite; the originals are backed up)"))
    low = space_shortfall(facts, build, h.min_free_mb)
    if low:
        p.refusals.append(Refusal("space", f"{h.name}: not enough disk: {low}; nothing changed"))
    if facts.lock:
        p.refusals.append(Refusal("lock", f"lock held by {facts.lock.get('owner', '?')} (pid {facts.lock.get('pid', '?')})"))
    if p.noop:
        p.ops.append(Op("nothing", f"nothing: the host already runs build {build.build_id} (no upload, no restart)"))
        return p
    rel_dir = f"{h.state_dir}/releases/<new id>"
    files = sorted(build.files)
    change = [f for f in facts.files if f.status != CURRENT]
    cmds = commands(h.restart)
    env = p.env
    p.ops += [
        Op("lock", f"lock {h.state_dir}/lock (atomic mkdir)"),
        Op("backup", f"back up {len(files)} files from {facts.sglang_dir} into {rel_dir}/backup", files),
        Op("upload", f"upload {len(files)} files ({sum(f.size for f in build.files.values())} bytes) into {rel_dir}/files", files),
        Op("verify", f"verify with {h.python}: sha256, compile" + (", import of the staged modules" if h.import_check else ""), files),
        Op("swap", "swap (temp file in the same directory + rename): " + ", ".join(f"{f.relpath} [{f.status}]" for f in change), files),
        *([Op("launch", env.summary() + " (backed up, swapped and restored with the files)", [env.path])] if env else []),
        Op("restart", f"restart: {cmds['restart']}"),
        Op("health", f"health gate on the host: {h.health.url}/health within {h.health.deadline_s:g}s (fail fast: {cmds['alive']}"
                     + (f"; crash loop: {cmds['probe']}" if cmds["probe"] else "") + ")"),
        Op("algorithm", f"require speculative_algorithm == {env.expect_after if env else h.health.expect_algorithm}")
        if env or h.health.expect_algorithm else Op("algorithm", "no algorithm check"),
        Op("smoke", "smoke generation via /generate" if h.health.smoke else "no smoke generation"),
        Op("on-failure", "on any failure after the swap: restore the backup byte for byte, restart, health again"),
        Op("record", f"record the release on the host and in deploy-state/{h.name}.jsonl; keep {h.keep_releases} releases"),
        Op("unlock", "unlock"),
    ]
    return p


def space_shortfall(facts: HostFacts, build: BuildInfo, margin_mb: int) -> str | None:
    """Free space a push needs, with `margin_mb` on top: the package filesystem holds the new files as
    temp files beside their destinations (plus room to copy the backups back if a rollback cannot use
    the hard links it keeps); the state filesystem holds the uploads and the backups."""
    new = sum(f.size for f in build.files.values())
    old = sum(f.remote_size for f in facts.files)
    need = {"sglang": (new + old) // (1 << 20) + 1 + margin_mb, "state": (new + old) // (1 << 20) + 1 + margin_mb}
    low = [f"{k} filesystem has {_size(facts, k)} free, needs {v} MB" for k, v in need.items()
           if facts.free_mb.get(k, 0) < v]
    return "; ".join(low) or None


def _size(facts: HostFacts, k: str) -> str:
    """Free space as read: MB, or kB below 10 MB (500 kB free is not `0 MB`)."""
    mb, b = facts.free_mb.get(k), (facts.free_bytes or {}).get(k)
    return f"{b // 1024} kB" if b is not None and b < 10 << 20 else f"{mb} MB"


def add_diffs(t: Transport, build: BuildInfo, p: Plan) -> None:
    """Unified diff remote -> build for every file push would change."""
    for f in p.facts.files:
        if f.status == CURRENT:
            continue
        r = call_agent(t, "read", {"path": f"{p.facts.sglang_dir}/{f.relpath}"}, 60)
        old = base64.b64decode(r["b64"]).decode("utf-8", "replace") if r["exists"] else ""
        new = build.path_of(f.relpath).read_text(encoding="utf-8", errors="replace")
        a = f"a/{f.relpath}" if r["exists"] else "/dev/null"
        p.diffs[f.relpath] = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), a, f"b/{f.relpath}"))
    if p.env is not None and not p.env.unchanged:  # [launch]: the env file's change
        p.diffs[p.env.path] = p.env.diff()
