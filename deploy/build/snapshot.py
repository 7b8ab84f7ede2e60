"""The vendored upstream snapshot: pristine SGLang files plus a manifest of their hashes.

Layout: `snapshot/sglang-<version>/` holds files at paths relative to the `sglang/` package
(e.g. `srt/server_args.py`) and `MANIFEST.json` at its top (not part of the file set):
    {"sglang_version": V, "wheel": {"name": N, "sha256": H}, "files": {relpath: sha256}}
Files come from the registry wheel (`pip download --no-deps sglang==V`) or from an installed
SGLang (a host's site-packages); both are checked against the distribution's RECORD hashes.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, SnapshotError, UsageError
from .buildinfo import sha256_bytes, sha256_file

PINNED_VERSION = "0.5.13.post1"
MANIFEST = "MANIFEST.json"
REPO_ROOT = Path(__file__).resolve().parents[2]  # deploy/build/snapshot.py -> the repository
SNAPSHOT_ROOT = REPO_ROOT / "snapshot"
WHEEL_CACHE = REPO_ROOT / ".cache" / "wheels"

# The files the DDTree series touches (hook plan, sglang_internals.md section 7).
DEFAULT_FILES = (
    "srt/speculative/spec_info.py",
    "srt/speculative/spec_registry.py",
    "srt/server_args.py",
    "srt/arg_groups/speculative_hook.py",
    "srt/speculative/dflash_info.py",
    "srt/speculative/dflash_utils.py",
    "srt/speculative/dflash_worker.py",
    "srt/model_executor/cuda_graph_runner.py",
    "srt/model_executor/model_runner.py",
)


def snapshot_dir_for(version: str, root: Path = SNAPSHOT_ROOT) -> Path:
    return Path(root) / f"sglang-{version}"


def check_relpath(relpath: str) -> str:
    """Normalise a package-relative path and refuse anything that escapes the package."""
    rel = relpath.strip().replace("\\", "/")
    rel = rel.removeprefix("sglang/")
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise UsageError(
            f"bad snapshot path {relpath!r}: give a path inside the sglang package, e.g. srt/server_args.py"
        )
    return rel


@dataclass
class Manifest:
    sglang_version: str
    wheel_name: str | None = None
    wheel_sha256: str | None = None
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "sglang_version": self.sglang_version,
            "wheel": {"name": self.wheel_name, "sha256": self.wheel_sha256},
            "files": dict(sorted(self.files.items())),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"


def load_manifest(snap_dir: Path) -> Manifest:
    path = Path(snap_dir) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{path}: snapshot manifest missing (run `ddtree-deploy snapshot import`)")
    try:
        data = json.loads(path.read_text())
        wheel = data.get("wheel") or {}
        files = data["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not an object")
        return Manifest(
            str(data["sglang_version"]),
            wheel.get("name"),
            wheel.get("sha256"),
            {check_relpath(k): str(v) for k, v in files.items()},
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: malformed snapshot manifest ({exc})") from exc


def manifest_sha256(snap_dir: Path) -> str:
    return sha256_file(Path(snap_dir) / MANIFEST)


def write_manifest(snap_dir: Path, manifest: Manifest) -> None:
    path = Path(snap_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(manifest.dumps())
    os.replace(tmp, path)


@dataclass(frozen=True)
class Problem:
    relpath: str
    kind: str  # "modified" | "missing" | "unlisted"

    def describe(self, snap_dir: Path) -> str:
        where = Path(snap_dir) / self.relpath
        return {
            "modified": f"{where}: differs from {MANIFEST} (edited by hand?)",
            "missing": f"{where}: listed in {MANIFEST} but missing",
            "unlisted": f"{where}: not listed in {MANIFEST}",
        }[self.kind]


def find_problems(snap_dir: Path, manifest: Manifest | None = None) -> list[Problem]:
    """Compare the snapshot's files with its manifest; [] when they match exactly."""
    snap_dir = Path(snap_dir)
    manifest = manifest or load_manifest(snap_dir)
    problems = []
    for rel, digest in sorted(manifest.files.items()):
        path = snap_dir / rel
        if not path.is_file():
            problems.append(Problem(rel, "missing"))
        elif sha256_file(path) != digest:
            problems.append(Problem(rel, "modified"))
    on_disk = {p.relative_to(snap_dir).as_posix() for p in snap_dir.rglob("*") if p.is_file()}
    for rel in sorted(on_disk - set(manifest.files) - {MANIFEST}):
        problems.append(Problem(rel, "unlisted"))
    return problems


def verify(snap_dir: Path) -> Manifest:
    """Raise SnapshotError (exit 4) naming the first bad file; return the manifest when clean."""
    manifest = load_manifest(snap_dir)
    problems = find_problems(snap_dir, manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SnapshotError(
            problems[0].describe(snap_dir) + more, detail="\n".join(p.describe(snap_dir) for p in problems[1:]) or None
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# Sources of upstream bytes


def _record_hashes(record_text: str) -> dict[str, str]:
    """RECORD rows -> {path: sha256 hex} (wheel RECORD uses urlsafe base64 without padding)."""
    out = {}
    for row in csv.reader(io.StringIO(record_text)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256=") :]
            out[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return out


@dataclass
class Source:
    """Where upstream bytes come from: a wheel or an installed package."""

    version: str
    read: Callable[[str], bytes | None]  # relpath -> bytes, None when absent
    record: dict[str, str]
    wheel_name: str | None = None
    wheel_sha256: str | None = None
    label: str = ""


def download_wheel(version: str, cache_dir: Path = WHEEL_CACHE) -> Path:
    """The sglang wheel for `version`, from the cache or via `pip download --no-deps`."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"sglang-{version}-*.whl"
    found = sorted(cache_dir.glob(pattern))
    if not found:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(cache_dir),
            f"sglang=={version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ConfigError(f"pip download sglang=={version} failed: {last}")
        found = sorted(cache_dir.glob(pattern))
    if not found:
        raise ConfigError(f"pip download sglang=={version} produced no wheel in {cache_dir}")
    return found[-1]


def wheel_source(wheel: Path) -> Source:
    wheel = Path(wheel)
    m = re.match(r"sglang-([^-]+)-", wheel.name)
    if not m:
        raise UsageError(f"{wheel}: not an sglang wheel")
    version = m.group(1)
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())
    rec_name = f"sglang-{version}.dist-info/RECORD"
    record = _record_hashes(zf.read(rec_name).decode()) if rec_name in names else {}

    def read(rel: str) -> bytes | None:
        name = f"sglang/{rel}"
        return zf.read(name) if name in names else None

    return Source(version, read, record, wheel.name, sha256_file(wheel), label=str(wheel))


def site_packages_source(directory: Path) -> Source:
    """An installed SGLang: DIR is a site-packages dir (holding sglang/) or the sglang dir itself."""
    directory = Path(directory)
    if (directory / "sglang" / "__init__.py").is_file():
        site = directory
    elif (directory / "__init__.py").is_file() and directory.name == "sglang":
        site = directory.parent
    else:
        raise UsageError(f"{directory}: no installed sglang package there (expected DIR/sglang/__init__.py)")
    infos = sorted(site.glob("sglang-*.dist-info"))
    version, record = None, {}
    if infos:
        version = infos[-1].name[len("sglang-") : -len(".dist-info")]
        rec = infos[-1] / "RECORD"
        if rec.is_file():
            record = _record_hashes(rec.read_text())
    if version is None:
        version = _version_from_source(site / "sglang")
        if version is None:
            raise UsageError(f"{directory}: cannot tell the installed sglang version (no dist-info, no version file)")

    def read(rel: str) -> bytes | None:
        p = site / "sglang" / rel
        return p.read_bytes() if p.is_file() else None

    return Source(version, read, record, label=str(site / "sglang"))


_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)


def _version_from_source(pkg: Path) -> str | None:
    """A top-level `__version__ = '...'` in sglang/_version.py or sglang/version.py."""
    for name in ("_version.py", "version.py"):
        f = pkg / name
        m = _VERSION_RE.search(f.read_text()) if f.is_file() else None
        if m:
            return m.group(1)
    return None


@dataclass
class ImportResult:
    snapshot_dir: Path
    version: str
    added: list[str]
    updated: list[str]
    unchanged: list[str]


def import_files(source: Source, snap_dir: Path, files: list[str] | None = None) -> ImportResult:
    """Copy `files` (default: the manifest's, else DEFAULT_FILES) from `source` into `snap_dir`,
    adding them to its manifest. Every file is read and checked before anything is written."""
    snap_dir = Path(snap_dir)
    existing = load_manifest(snap_dir) if (snap_dir / MANIFEST).is_file() else None
    if existing and existing.sglang_version != source.version:
        raise UsageError(
            f"{snap_dir} holds sglang {existing.sglang_version}, the source is "
            f"{source.version}: import a new pin into its own snapshot directory"
        )
    if (
        existing
        and source.wheel_sha256
        and existing.wheel_sha256
        and existing.wheel_name == source.wheel_name
        and existing.wheel_sha256 != source.wheel_sha256
    ):
        raise SnapshotError(
            f"{source.label}: sha256 {source.wheel_sha256[:16]}… differs from the "
            f"manifest's {existing.wheel_sha256[:16]}… for {existing.wheel_name}"
        )
    wanted = [check_relpath(f) for f in (files or (list(existing.files) if existing else DEFAULT_FILES))]
    blobs: dict[str, bytes] = {}
    for rel in dict.fromkeys(wanted):
        data = source.read(rel)
        if data is None:
            raise UsageError(f"sglang/{rel}: not in {source.label}")
        expected = source.record.get(f"sglang/{rel}")
        if expected and expected != sha256_bytes(data):
            raise SnapshotError(
                f"{source.label}/{rel}: differs from the distribution's RECORD "
                "(the installed file was modified; it is not upstream)"
            )
        blobs[rel] = data
    manifest = existing or Manifest(source.version)
    if source.wheel_name:
        manifest.wheel_name, manifest.wheel_sha256 = source.wheel_name, source.wheel_sha256
    result = ImportResult(snap_dir, source.version, [], [], [])
    snap_dir.mkdir(parents=True, exist_ok=True)
    for rel, data in blobs.items():
        digest = sha256_bytes(data)
        bucket = (
            result.added
            if rel not in manifest.files
            else (result.unchanged if manifest.files[rel] == digest and (snap_dir / rel).is_file() else result.updated)
        )
        bucket.append(rel)
        dest = snap_dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        manifest.files[rel] = digest
    write_manifest(snap_dir, manifest)
    return result


def compare_with_source(source: Source, snap_dir: Path) -> list[str]:
    """Drift check: the manifest files whose bytes in `source` differ from the snapshot (or are absent)."""
    manifest = load_manifest(snap_dir)
    drifted = []
    for rel, digest in sorted(manifest.files.items()):
        data = source.read(rel)
        if data is None or sha256_bytes(data) != digest:
            drifted.append(rel)
    return drifted
