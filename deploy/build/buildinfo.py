"""The build manifest: the contract between `ddtree-deploy patch` (writer) and the deploy
machinery (reader). One JSON file, `BUILD-MANIFEST.json`, at the top of `build/sglang-<ver>/`.

Paths are relative to the installed `sglang/` package directory (e.g. `srt/server_args.py`).

Schema (version 1):
{
  "schema": 1,
  "sglang_version": "0.5.13.post1",
  "build_id": "<first 16 hex of sha256 over the pin's version and the sorted (path, sha256) list>",
  "series_sha256": "<sha256 of patches/series plus every patch file, in series order>",
  "snapshot_manifest_sha256": "<sha256 of the snapshot manifest file>",
  "patches": ["0001-....patch", ...],
  "files": {
     "<relpath>": {"sha256": "<hex>", "size": N, "pristine_sha256": "<hex>" | null}
  }
}
`pristine_sha256` is the upstream file's hash (from the snapshot manifest); null means the file
is added by the build (e.g. srt/speculative/ddtree_utils.py) and is absent upstream.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

MANIFEST_NAME = "BUILD-MANIFEST.json"
SCHEMA = 1
# Written next to the manifest by the quality gates (`ddtree-deploy patch` / `check`):
# {"build_id": ..., "gates": {"<n>": {"name", "status": pass|fail|skip, "summary"}}, "ok": bool}
# `ok` is true only when every gate has a result for this build_id and none failed.
GATES_RECORD = "GATES.json"
ALL_GATES = (1, 2, 3, 4, 5, 6, 7)
# Files at the top of a build that describe it and are never shipped.
METADATA_NAMES = frozenset({MANIFEST_NAME, GATES_RECORD})


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class BuildFile:
    relpath: str
    sha256: str
    size: int
    pristine_sha256: str | None  # None: added by the build, absent upstream


@dataclass
class BuildInfo:
    root: Path
    sglang_version: str
    build_id: str
    series_sha256: str
    snapshot_manifest_sha256: str
    patches: list[str]
    files: dict[str, BuildFile] = field(default_factory=dict)

    def path_of(self, relpath: str) -> Path:
        return self.root / relpath

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "sglang_version": self.sglang_version,
            "build_id": self.build_id,
            "series_sha256": self.series_sha256,
            "snapshot_manifest_sha256": self.snapshot_manifest_sha256,
            "patches": list(self.patches),
            "files": {
                p: {"sha256": f.sha256, "size": f.size, "pristine_sha256": f.pristine_sha256}
                for p, f in sorted(self.files.items())
            },
        }


def compute_build_id(files: dict[str, str], sglang_version: str) -> str:
    """files: relpath -> sha256. Stable over ordering; the pin's version is part of the id, so
    builds of two pins never share one."""
    h = hashlib.sha256(f"sglang {sglang_version}\n".encode())
    for p in sorted(files):
        h.update(f"{p}\0{files[p]}\n".encode())
    return h.hexdigest()[:16]


def load_build(root: Path) -> BuildInfo:
    """Load and verify a build directory: every listed file exists with its recorded hash."""
    root = Path(root)
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        raise ConfigError(f"no build at {root} ({MANIFEST_NAME} missing): run `ddtree-deploy patch` first")
    try:
        data = json.loads(mpath.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{mpath}: not valid JSON ({exc})") from exc
    if data.get("schema") != SCHEMA:
        raise ConfigError(f"{mpath}: unsupported schema {data.get('schema')!r} (expected {SCHEMA})")
    files = {
        p: BuildFile(p, d["sha256"], int(d["size"]), d.get("pristine_sha256"))
        for p, d in data["files"].items()
    }
    info = BuildInfo(
        root=root,
        sglang_version=data["sglang_version"],
        build_id=data["build_id"],
        series_sha256=data["series_sha256"],
        snapshot_manifest_sha256=data["snapshot_manifest_sha256"],
        patches=list(data.get("patches", [])),
        files=files,
    )
    for f in files.values():
        fp = root / f.relpath
        if not fp.is_file():
            raise ConfigError(f"build {root} is incomplete: {f.relpath} missing")
        if sha256_file(fp) != f.sha256:
            raise ConfigError(f"build {root} was modified after it was made: {f.relpath} differs from {MANIFEST_NAME}")
    return info


def record_verdict(rec: dict, build_id: str) -> tuple[bool, str]:
    """Judge a gates record (the parsed GATES.json) for the build `build_id`."""
    if rec.get("build_id") != build_id:
        return False, f"the gates record is for build {rec.get('build_id')}, not {build_id}: run `ddtree-deploy check`"
    gates = rec.get("gates", {})
    failed = [n for n, g in sorted(gates.items()) if g.get("status") == "fail"]
    if failed:
        return False, f"build {build_id} failed quality gate(s) {', '.join(failed)}: run `ddtree-deploy check`"
    missing = [str(n) for n in ALL_GATES if str(n) not in gates]
    if missing:
        return False, f"build {build_id} has no result for gate(s) {', '.join(missing)}: run `ddtree-deploy check`"
    return True, "all quality gates passed"


def gates_verdict(build: BuildInfo) -> tuple[bool, str]:
    """Whether the build passed all its quality gates (its GATES.json), and why not."""
    path = build.root / GATES_RECORD
    if not path.is_file():
        return False, f"build {build.root} has not been through the quality gates (no {GATES_RECORD}): run `ddtree-deploy check`"
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False, f"{path}: not valid JSON: run `ddtree-deploy check`"
    return record_verdict(rec, build.build_id)
