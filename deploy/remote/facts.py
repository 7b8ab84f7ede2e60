"""Read-only facts about a host, gathered in one round trip by the host-side agent, and the
classification of every target file against the build: pristine / deployed / drifted / missing."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from ..build.buildinfo import BuildInfo
from ..build.pins import BuildChoice
from ..errors import ConfigError, RemoteRefused
from .agent_client import call_agent
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
    unfinished: list[dict] = field(default_factory=list)
    remote_files: dict = field(default_factory=dict)  # {rel: {"sha256", "size"} | None}, as read
    reads: dict[str, bytes | None] = field(default_factory=dict)  # files read with the facts (env file)
    current_files: dict[str, str | None] | None = None  # live sha256 of the files current.json names
    free_bytes: dict = field(default_factory=dict)

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
    """Each build file by what is on disk: `deployed` only for bytes that a push of this tool put
    there (a rollback or an automatic rollback puts back whatever was there before, a hand edit
    included: those bytes stay `drifted`)."""
    released: dict[tuple[str, str], str] = {}
    for rec in releases:
        if rec.get("outcome") in (None, "staging", "aborted") or rec.get("action", "push") != "push":
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


def unexplained(facts: HostFacts) -> list[str]:
    """The files current.json names whose bytes on disk neither a push of this tool put there nor
    were the pristine ones: hand edits, whatever put them back (needs `current_files`)."""
    known: dict[str, set] = {}
    for rec in facts.releases:
        for rel, sha in (rec.get("pristine") or {}).items():
            known.setdefault(rel, set()).add(sha)
        if rec.get("action", "push") == "push" and rec.get("outcome") not in (None, "staging", "aborted"):
            for rel, sha in (rec.get("files") or {}).items():
                known.setdefault(rel, set()).add(sha)
    return sorted(rel for rel, sha in (facts.current_files or {}).items() if sha not in known.get(rel, set()))


def read_facts(t: Transport, build=None, *, read: list[str] | None = None, current_files: bool = False) -> HostFacts:
    """The host's facts in one agent call. `build`: a BuildInfo (hash its files), a BuildChoice (the
    agent hashes the files of the pin of the version it finds: every pin's file list goes along),
    or None (no files). `read`: absolute paths whose bytes come back too (the [launch] env file;
    by default the inventory's). `current_files`: also hash the live files current.json names."""
    h = t.host
    payload: dict = {"sglang_dir": h.sglang_dir, "state_dir": h.state_dir,
                     "read": read if read is not None else ([h.launch.env_file] if h.launch is not None else []),
                     "current_files": current_files}
    if isinstance(build, BuildChoice):
        payload["files_by_version"] = build.file_lists()
    else:
        payload["files"] = sorted(build.files) if build is not None else []
    raw = call_agent(t, "facts", payload, 120)
    facts = HostFacts(raw["python"], raw["sglang_dir"], raw["version"], raw["free_mb"], raw["current"], raw["lock"],
                      raw["releases"], raw["pristine_store"], unfinished=raw.get("unfinished") or [],
                      remote_files=raw["files"], current_files=raw.get("current_files"),
                      reads={p: (base64.b64decode(v) if v is not None else None) for p, v in (raw.get("read") or {}).items()},
                      free_bytes=raw.get("free_bytes") or {})
    if isinstance(build, BuildInfo):
        facts.files = classify(build, facts.remote_files, facts.releases)
    return facts


def with_build(facts: HostFacts, build: BuildInfo) -> HostFacts:
    """Classify the facts' files against `build` (the one BuildChoice picked for the host's version)."""
    missing = sorted(set(build.files) - set(facts.remote_files))
    if missing:  # the pin's build changed between the manifest read and its load: cannot happen in one run
        raise ValueError(f"facts lack {len(missing)} files of build {build.build_id}: {missing[:3]}")
    facts.files = classify(build, facts.remote_files, facts.releases)
    return facts


def choose_build(build, facts: HostFacts, where: str, *, missing_ok: bool = False) -> BuildInfo | None:
    """`build` itself when it is a BuildInfo (an explicit --build); for a BuildChoice, the build of
    the pin of the host's SGLang version (RemoteRefused, exit 6, when it has none), its files
    classified. `missing_ok`: None instead of an error (status)."""
    if not isinstance(build, BuildChoice):
        return build
    try:
        chosen = build.for_version(facts.version, where)
    except (RemoteRefused, ConfigError):
        if missing_ok:
            return None
        raise
    with_build(facts, chosen)
    return chosen


def gather(t: Transport, build: BuildInfo) -> HostFacts:
    """One round trip: version, sglang location, hashes of every target file, disk, state, lock."""
    return read_facts(t, build)


def version_mismatch(t: Transport, facts: HostFacts, build: BuildInfo) -> str | None:
    """Why push refuses the host's SGLang version for this build, or None."""
    if facts.version == build.sglang_version:
        return None
    return (f"{t.label}: remote SGLang is {facts.version} at {facts.sglang_dir}, the build is for "
            f"{build.sglang_version}; refusing (install sglang=={build.sglang_version} there first)")
