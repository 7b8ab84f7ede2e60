"""`ddtree-deploy patch`: snapshot + series + ddtree_utils.py -> build/sglang-<version>/.

The tree is assembled in a temporary sibling directory and renamed into place only when every
step succeeded, so `build/` never holds a half-applied tree. The output is byte-deterministic.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from . import snapshot as snap
from .buildinfo import (
    MANIFEST_NAME,
    METADATA_NAMES,
    BuildFile,
    BuildInfo,
    compute_build_id,
    sha256_file,
)
from .series import (
    SHIPPED_FILES,
    SHIPPED_MODULES,
    SHIPPED_UTILS,
    Entry,
    Series,
    apply_series,
    check_header,
    load_series,
    patch_files,
)

REPO_ROOT = snap.REPO_ROOT
PATCHES_ROOT = REPO_ROOT / "patches"  # one series per pin: patches/<version>/series
PATCHES_DIR = PATCHES_ROOT / snap.PINNED_VERSION
BUILD_ROOT = REPO_ROOT / "build"
DDTREE_UTILS = REPO_ROOT / "ddtree_utils.py"
LOCK_NAME = ".build.lock"


@dataclass
class Inputs:
    """Where a build reads from and writes to (the repository's directories by default)."""

    snapshot_dir: Path = field(default_factory=lambda: snap.snapshot_dir_for(snap.PINNED_VERSION))
    patches_dir: Path = PATCHES_DIR
    build_root: Path = BUILD_ROOT
    ddtree_utils: Path = DDTREE_UTILS

    def build_dir(self, version: str) -> Path:
        return Path(self.build_root) / f"sglang-{version}"


@dataclass
class Prepared:
    """Validated inputs: snapshot manifest, parsed series."""

    inputs: Inputs
    manifest: snap.Manifest
    series: Series

    @property
    def version(self) -> str:
        return self.manifest.sglang_version

    @property
    def build_dir(self) -> Path:
        return self.inputs.build_dir(self.version)


def prepare(inputs: Inputs) -> Prepared:
    """Verify the snapshot (exit 4), parse the series and check every header (exit 2)."""
    manifest = snap.verify(inputs.snapshot_dir)
    series = load_series(inputs.patches_dir)
    for e in series.entries:
        check_header(e.path)
        for change in patch_files(e.path):
            if change.deleted:
                raise ConfigError(
                    f"{e.path}: deletes {change.path}; the series may add or change files, not delete them"
                )
    if not Path(inputs.ddtree_utils).is_file():
        raise ConfigError(f"{inputs.ddtree_utils}: missing (it is shipped as {SHIPPED_UTILS})")
    return Prepared(inputs, manifest, series)


def shipped_sources(inputs: Inputs) -> list[tuple[Path, str]]:
    """(source, build path) of every module a build may ship: `inputs.ddtree_utils` and the
    other SHIPPED_MODULES next to it."""
    utils = Path(inputs.ddtree_utils)
    return [
        (utils if name == "ddtree_utils.py" else utils.parent / name, rel)
        for name, rel in zip(SHIPPED_MODULES, SHIPPED_FILES)
    ]


def imported_modules(path: Path) -> set[str]:
    """Top-level module names a Python file imports by name (`import m`, `from pkg import m`,
    `from pkg.m import x`, `from . import m`): what decides which SHIPPED_MODULES a build
    ships. An unparsable file imports nothing here (gate 4 reports it)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.rsplit(".", 1)[-1] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                names.add(node.module.rsplit(".", 1)[-1])
            names.update(a.name for a in node.names)
    return names


def ship_modules(inputs: Inputs, dest: Path) -> list[str]:
    """Copy ddtree_utils.py and exactly the other SHIPPED_MODULES that the assembled tree
    imports (the patched files, and the shipped modules themselves) into `dest`. Returns the
    build paths shipped."""
    sources = {rel: source for source, rel in shipped_sources(inputs)}
    stems = {rel: Path(rel).stem for rel in sources}
    shipped: list[str] = []
    todo = [SHIPPED_UTILS]
    while todo:
        rel = todo.pop(0)
        source, target = sources[rel], Path(dest) / rel
        if target.exists():
            raise ConfigError(f"{rel} already exists after the series; it must come only from {source}")
        if not source.is_file():
            raise ConfigError(f"{source}: missing (the build imports it; it is shipped as {rel})")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        shipped.append(rel)
        if len(shipped) == 1:  # after ddtree_utils.py: what the patched tree imports
            imported = set().union(*(imported_modules(q) for q in Path(dest).rglob("*.py")))
        else:
            imported = imported_modules(target)
        todo += [r for r, stem in stems.items() if stem in imported and r not in shipped and r not in todo]
    return shipped


def copy_snapshot(p: Prepared, dest: Path) -> None:
    for rel in sorted(p.manifest.files):
        target = Path(dest) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(p.inputs.snapshot_dir) / rel, target)


def assemble(
    p: Prepared,
    dest: Path,
    *,
    entries: list[Entry] | None = None,
    allow_offset: bool = True,
    with_utils: bool = True,
    on_patch: Callable[[Entry], None] | None = None,
) -> list[str]:
    """Write snapshot files into `dest` and apply `entries` (default: the whole series) in order.
    Returns offset warnings. `dest` must exist and be empty."""
    copy_snapshot(p, dest)
    warnings = apply_series(
        dest, p.series.entries if entries is None else entries, allow_offset=allow_offset, on_patch=on_patch
    )
    if with_utils:
        ship_modules(p.inputs, Path(dest))
    return warnings


def tree_files(root: Path) -> list[str]:
    root = Path(root)
    return sorted(q.relative_to(root).as_posix() for q in root.rglob("*") if q.is_file() and q.name not in METADATA_NAMES)


def describe(p: Prepared, root: Path) -> BuildInfo:
    """The BuildInfo of an assembled tree (hashes every file; modes normalised to 0644)."""
    files = {}
    for rel in tree_files(root):
        path = Path(root) / rel
        os.chmod(path, 0o644)
        files[rel] = BuildFile(rel, sha256_file(path), path.stat().st_size, p.manifest.files.get(rel))
    return BuildInfo(
        root=Path(root),
        sglang_version=p.version,
        build_id=compute_build_id({r: f.sha256 for r, f in files.items()}, p.version),
        series_sha256=p.series.sha256(),
        snapshot_manifest_sha256=snap.manifest_sha256(p.inputs.snapshot_dir),
        patches=p.series.names,
        files=files,
    )


def write_manifest(info: BuildInfo) -> None:
    (info.root / MANIFEST_NAME).write_text(json.dumps(info.to_json(), indent=2, sort_keys=True) + "\n")


@dataclass
class BuildResult:
    info: BuildInfo
    warnings: list[str]
    replaced: bool  # an older build was replaced


def build(inputs: Inputs, *, on_patch: Callable[[Entry], None] | None = None) -> BuildResult:
    """Build `build/sglang-<version>/` from scratch; on any error `build/` is left as it was."""
    p = prepare(inputs)
    Path(inputs.build_root).mkdir(parents=True, exist_ok=True)
    with _locked(Path(inputs.build_root) / LOCK_NAME):
        _remove_leftovers(Path(inputs.build_root), p.build_dir.name)
        return _build_locked(p, inputs, on_patch)


def _remove_leftovers(build_root: Path, name: str) -> None:
    """Temporary trees of a build that was killed (we hold the lock: no build is running)."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for path in build_root.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path):
    """One build at a time per build root (a second one waits)."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_locked(p: Prepared, inputs: Inputs, on_patch) -> BuildResult:
    final = p.build_dir
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=inputs.build_root))
    old = None
    try:
        warnings = assemble(p, tmp, on_patch=on_patch)
        info = describe(p, tmp)
        write_manifest(info)
        os.chmod(tmp, 0o755)
        replaced = final.exists()
        if replaced:
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=inputs.build_root))
            os.rename(final, old / final.name)
        os.rename(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.rename(old / final.name, final)  # put the previous build back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    info.root = final
    return BuildResult(info, warnings, replaced)
