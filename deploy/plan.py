"""`plan`: facts + build -> what push would do, step by step, with per-file unified diffs. Read-only."""

from __future__ import annotations

import base64
import difflib
from dataclasses import dataclass, field

from . import launch
from .agent_client import call_agent
from .buildinfo import BuildInfo
from .errors import RemoteRefused
from .facts import CURRENT, HostFacts
from .restart import commands
from .transport import Transport


@dataclass
class Plan:
    host: str
    facts: HostFacts
    steps: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    diffs: dict[str, str] = field(default_factory=dict)
    env: launch.EnvChange | None = None  # [launch]: what push does to the env file

    @property
    def noop(self) -> bool:
        return self.facts.up_to_date and launch.unchanged(self.env)

    def to_json(self) -> dict:
        return {"host": self.host, "facts": self.facts.to_json(), "noop": self.noop, "steps": self.steps,
                "refusals": self.refusals, "diffs": self.diffs, "launch": self.env.to_json() if self.env else None}


def make_plan(t: Transport, build: BuildInfo, facts: HostFacts, *, force: bool = False) -> Plan:
    h = t.host
    p = Plan(h.name, facts)
    try:
        p.env = launch.for_push(t, build, facts.current, facts.releases)
    except RemoteRefused as exc:  # e.g. the variable spans several lines: push would refuse
        p.refusals.append(exc.message)
    if facts.version != build.sglang_version:
        p.refusals.append(f"remote SGLang {facts.version} != build {build.sglang_version}")
    bad = [f.relpath for f in facts.drifted] + ([p.env.path] if p.env and p.env.drifted else [])
    if bad and not force:
        p.refusals.append("drifted/missing files (use --force): " + ", ".join(bad))
    if facts.lock:
        p.refusals.append(f"lock held by {facts.lock.get('owner', '?')} (pid {facts.lock.get('pid', '?')})")
    if p.noop:
        p.steps.append(f"nothing: the host already runs build {build.build_id} (no upload, no restart)")
        return p
    rel_dir = f"{h.state_dir}/releases/<new id>"
    change = [f for f in facts.files if f.status != CURRENT]
    cmds = commands(h.restart)
    p.steps += [
        f"lock {h.state_dir}/lock (atomic mkdir)",
        f"back up {len(build.files)} files from {facts.sglang_dir} into {rel_dir}/backup",
        f"upload {len(build.files)} files ({sum(f.size for f in build.files.values())} bytes) into {rel_dir}/files",
        f"verify with {h.python}: sha256, compile" + (", import of the staged modules" if h.import_check else ""),
        "swap (temp file in the same directory + rename): " + ", ".join(f"{f.relpath} [{f.status}]" for f in change),
        *([p.env.summary() + " (backed up, swapped and restored with the files)"] if p.env else []),
        f"restart: {cmds['restart']}",
        f"health gate on the host: {h.health.url}/health within {h.health.deadline_s:g}s (fail fast: {cmds['alive']})",
        f"require speculative_algorithm == {p.env.expect_after if p.env else h.health.expect_algorithm}"
        if p.env or h.health.expect_algorithm else "no algorithm check",
        "smoke generation via /generate" if h.health.smoke else "no smoke generation",
        "on any failure after the swap: restore the backup byte for byte, restart, health again",
        f"record the release on the host and in deploy-state/{h.name}.jsonl; keep {h.keep_releases} releases",
        "unlock",
    ]
    return p


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
