"""`ddtree-deploy refresh PATCH`: regenerate one patch from an edited build tree (quilt-refresh style).

The new patch is the diff, restricted to the files the patch touches (plus `add_files`), between
  before: snapshot + the patches before PATCH (recomputed in a temporary directory), and
  after:  the build tree with the patches after PATCH reverse-applied (so their changes stay theirs).
Its DEP-3 header is kept, with Last-Update set to today. Afterwards the whole series is re-applied
from scratch to report any later patch that no longer applies exactly, and any edit in the build
that the series (as refreshed) does not reproduce.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, DDTreeDeployError, UsageError
from .build import Inputs, Prepared, assemble, prepare, tree_files
from .buildinfo import MANIFEST_NAME, sha256_file
from .series import (
    SHIPPED_FILES,
    apply_series,
    diff_file,
    patch_files,
    split_header,
)
from .snapshot import check_relpath

_LAST_UPDATE_RE = re.compile(r"^(Last-Update:[ \t]*).*$", re.M | re.I)


@dataclass
class RefreshResult:
    patch: Path
    changed: bool
    files: list[str]
    broken: str | None = None  # first later patch that no longer applies exactly, with the reason
    uncaptured: list[str] = field(default_factory=list)  # build files the refreshed series does not reproduce


def _new_header(header: str, today: dt.date) -> str:
    if _LAST_UPDATE_RE.search(header):
        return _LAST_UPDATE_RE.sub(lambda m: m.group(1) + today.isoformat(), header, count=1)
    return header + f"Last-Update: {today.isoformat()}\n"


def refresh(inputs: Inputs, patch: str, *, add_files: list[str] = (), today: dt.date | None = None) -> RefreshResult:
    p: Prepared = prepare(inputs)
    idx = p.series.index_of(patch)
    entry = p.series.entries[idx]
    build_dir = p.build_dir
    if not (build_dir / MANIFEST_NAME).is_file():  # edited files are expected: no hash check here
        raise ConfigError(f"no build at {build_dir}: run `ddtree-deploy patch` first, then edit its files")
    touched = [c.path for c in patch_files(entry.path)]
    extra = [check_relpath(f) for f in add_files]
    for rel in extra:
        if rel in SHIPPED_FILES:
            name = rel.rsplit("/", 1)[1]
            raise UsageError(f"{rel} is shipped from {name}; it cannot be added to a patch")
    for rel in extra:
        if not (build_dir / rel).is_file():
            raise UsageError(f"--add-file {rel}: not in the build tree {build_dir}")
    files = list(dict.fromkeys(touched + extra))
    work = Path(tempfile.mkdtemp(prefix="ddtree-refresh-"))
    try:
        before, after = work / "before", work / "after"
        before.mkdir()
        assemble(p, before, entries=p.series.entries[:idx], with_utils=False)
        shutil.copytree(build_dir, after)
        (after / MANIFEST_NAME).unlink(missing_ok=True)
        for rel in SHIPPED_FILES:
            (after / rel).unlink(missing_ok=True)
        try:
            apply_series(after, p.series.entries[idx + 1 :], reverse=True, allow_offset=True)
        except DDTreeDeployError as exc:
            raise ConfigError(f"cannot separate your edits from a later patch: {exc.message}") from exc
        body = "".join(diff_file(before, after, rel) for rel in files)
        if not body:
            raise ConfigError(
                f"{entry.name}: the refreshed patch would be empty (its changes were removed from the build)"
            )
        for rel in files:
            if (before / rel).is_file() and not (after / rel).is_file():
                raise ConfigError(f"{entry.name}: {rel} was deleted in the build; the series cannot delete files")
        header, _ = split_header(entry.path.read_text())
        old_text = entry.path.read_text()
        text = _new_header(header, today or dt.datetime.now(dt.timezone.utc).date()) + body
        _, old_body = split_header(old_text)
        changed = old_body != body
        if changed:
            tmp = entry.path.with_name(f".{entry.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, entry.path)
        result = RefreshResult(entry.path, changed, files)
        result.broken, result.uncaptured = _recheck(p, build_dir, work / "check")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _recheck(p: Prepared, build_dir: Path, dest: Path) -> tuple[str | None, list[str]]:
    """Re-apply the (refreshed) series strictly; report a patch that breaks, or build files that differ."""
    dest.mkdir()
    try:
        assemble(p, dest, allow_offset=False)
    except DDTreeDeployError as exc:
        return exc.message, []
    differ = []
    for rel in sorted(set(tree_files(dest)) | set(tree_files(build_dir))):
        a, b = dest / rel, build_dir / rel
        if not (a.is_file() and b.is_file()) or sha256_file(a) != sha256_file(b):
            differ.append(rel)
    return None, differ
