"""Read-only facts about a host, gathered in one round trip by the host-side agent, and the
classification of every target file against the build: pristine / deployed / drifted / missing."""

from __future__ import annotations

from dataclasses import dataclass, field

from .agent_client import call_agent
from .buildinfo import BuildInfo
from .transport import Transport

PRISTINE, DEPLOYED, CURRENT, DRIFTED, MISSING = "pristine", "deployed", "current", "drifted", "missing"


@dataclass
class FileState:
    relpath: str
    status: str  # pristine | current (this build) | deployed (an older release) | drifted | missing
    remote_sha256: str | None
    build_sha256: str
    pristine_sha256: str | None
    release: str | None = None  # which release deployed it, for `deployed`
    remote_size: int = 0


@dataclass
class HostFacts:
    python: str
    sglang_dir: str
    version: str
    free_mb: dict
    current: dict | None
    lock: dict | None
    releases: list[dict]
    pristine_store: dict
    files: list[FileState] = field(default_factory=list)

    @property
    def up_to_date(self) -> bool:
        return all(f.status == CURRENT for f in self.files)

    @property
    def drifted(self) -> list[FileState]:
        return [f for f in self.files if f.status in (DRIFTED, MISSING)]

    def to_json(self) -> dict:
        return {
            "python": self.python, "sglang_dir": self.sglang_dir, "sglang_version": self.version,
            "free_mb": self.free_mb, "current": self.current, "lock": self.lock,
            "releases": [r.get("id") for r in self.releases],
            "files": [f.__dict__ for f in self.files],
        }


def classify(build: BuildInfo, remote: dict, releases: list[dict]) -> list[FileState]:
    released: dict[tuple[str, str], str] = {}
    for rec in releases:
        if rec.get("outcome") in (None, "staging", "aborted"):  # never swapped in
            continue
        for rel, sha in (rec.get("files") or {}).items():
            released[(rel, sha)] = rec.get("id", "?")
    out = []
    for rel, bf in sorted(build.files.items()):
        got = remote.get(rel)
        sha = got["sha256"] if got else None
        rid = None
        if sha == bf.sha256:
            status = CURRENT
        elif sha == bf.pristine_sha256:  # also covers an added file that is absent (both None)
            status = PRISTINE
        elif sha is not None and (rel, sha) in released:
            status, rid = DEPLOYED, released[(rel, sha)]
        elif sha is None:
            status = MISSING
        else:
            status = DRIFTED
        out.append(FileState(rel, status, sha, bf.sha256, bf.pristine_sha256, rid, (got or {}).get("size") or 0))
    return out


def gather(t: Transport, build: BuildInfo) -> HostFacts:
    """One round trip: version, sglang location, hashes of every target file, disk, state, lock."""
    raw = _agent_facts(t, sorted(build.files))
    facts = HostFacts(raw["python"], raw["sglang_dir"], raw["version"], raw["free_mb"], raw["current"], raw["lock"],
                      raw["releases"], raw["pristine_store"])
    facts.files = classify(build, raw["files"], raw["releases"])
    return facts


def host_state(t: Transport) -> dict:
    """Version, sglang location, release state and lock of the host, without a build to compare."""
    return _agent_facts(t, [])


def _agent_facts(t: Transport, files: list[str]) -> dict:
    h = t.host
    return call_agent(t, "facts", {"sglang_dir": h.sglang_dir, "files": files, "state_dir": h.state_dir}, 120)


def version_mismatch(t: Transport, facts: HostFacts, build: BuildInfo) -> str | None:
    """Why push refuses the host's SGLang version for this build, or None."""
    if facts.version == build.sglang_version:
        return None
    return (f"{t.label}: remote SGLang is {facts.version} at {facts.sglang_dir}, the build is for "
            f"{build.sglang_version}; refusing (install sglang=={build.sglang_version} there first)")
