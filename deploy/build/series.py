"""The patch series: `patches/series` (order), DEP-3 headers, and applying patches with zero fuzz.

`patches/series` lists one patch file name per line (`NNNN-name.patch`, numbers increasing);
`#` starts a comment, blank lines are ignored. Every `*.patch` in the directory must be listed.
Patches are unified diffs relative to the sglang package dir, `a/srt/...` `b/srt/...` (strip 1),
with a DEP-3 header before the first diff line: Description (or Subject), Origin, Forwarded and
Last-Update (YYYY-MM-DD) are required.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import unidiff

from ..errors import ConfigError, PatchApplyError

SERIES = "series"
NAME_RE = re.compile(r"^(\d{4})-[A-Za-z0-9][A-Za-z0-9._+-]*\.patch$")
FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):[ \t]*(.*)$")
DIFF_START_RE = re.compile(r"^(diff |--- |Index: |---$)")
REQUIRED = ("Description", "Origin", "Forwarded", "Last-Update")
SHIPPED_UTILS = "srt/speculative/ddtree_utils.py"
# The repository's top-level modules a build may ship into srt/speculative/: ddtree_utils.py
# always, each other one when the patched tree (or a shipped module) imports it (build.ship_modules;
# today both pins import ddtree_serving, ddtree_utils imports ddtree_triton, and the 0.5.16 worker
# imports ddtree_budget). The tests'
# oracles, ddtree_reference.py, are never shipped.
SHIPPED_MODULES = ("ddtree_utils.py", "ddtree_triton.py", "ddtree_serving.py", "ddtree_budget.py")
SHIPPED_FILES = tuple(f"srt/speculative/{m}" for m in SHIPPED_MODULES)


@dataclass(frozen=True)
class Entry:
    name: str
    path: Path
    line: int  # line number in the series file


@dataclass
class Series:
    patches_dir: Path
    entries: list[Entry] = field(default_factory=list)

    @property
    def series_path(self) -> Path:
        return self.patches_dir / SERIES

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def index_of(self, name: str) -> int:
        wanted = Path(name).name
        for i, e in enumerate(self.entries):
            if e.name == wanted or e.name == f"{wanted}.patch" or e.name.split("-", 1)[0] == wanted:
                return i
        raise ConfigError(f"{name}: not in {self.series_path}")

    def sha256(self) -> str:
        """Hash of the series file plus every patch, in series order."""
        h = hashlib.sha256(self.series_path.read_bytes())
        for e in self.entries:
            h.update(b"\0" + e.name.encode() + b"\0")
            h.update(e.path.read_bytes())
        return h.hexdigest()


def load_series(patches_dir: Path) -> Series:
    """Parse and validate the series file: entries exist, are named NNNN-*.patch, are in
    increasing order, appear once, and every patch file in the directory is listed."""
    patches_dir = Path(patches_dir)
    spath = patches_dir / SERIES
    if not spath.is_file():
        raise ConfigError(f"{spath}: series file missing")
    series = Series(patches_dir)
    last_num, seen = -1, set()
    for lineno, raw in enumerate(spath.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{spath}:{lineno}"
        if len(text.split()) != 1:
            raise ConfigError(f"{where}: one patch file name per line expected, got {text!r}")
        m = NAME_RE.match(text)
        if not m or "/" in text:
            raise ConfigError(f"{where}: {text!r} is not a patch name of the form NNNN-name.patch")
        if text in seen:
            raise ConfigError(f"{where}: {text} is listed twice")
        num = int(m.group(1))
        if num <= last_num:
            raise ConfigError(f"{where}: {text} is out of order (its number must be greater than the previous entry's)")
        path = patches_dir / text
        if not path.is_file():
            raise ConfigError(f"{where}: patch file {path} does not exist")
        seen.add(text)
        last_num = num
        series.entries.append(Entry(text, path, lineno))
    unlisted = sorted(p.name for p in patches_dir.glob("*.patch") if p.name not in seen)
    if unlisted:
        raise ConfigError(f"{patches_dir / unlisted[0]}: not listed in {spath} (add it there or delete it)")
    return series


# ---------------------------------------------------------------------------------------------
# Headers and patch contents


def split_header(text: str) -> tuple[str, str]:
    """(header, diff) of a patch: the header is every line before the first diff line."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if DIFF_START_RE.match(line.rstrip("\n")):
            return "".join(lines[:i]), "".join(lines[i:])
    return text, ""


def parse_header(header: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    current = None
    for line in header.splitlines():
        if line[:1] in (" ", "\t") and current:
            fields[current] += "\n" + line.strip()
            continue
        m = FIELD_RE.match(line)
        if m:
            current = m.group(1).title()
            fields[current] = m.group(2).strip()
        else:
            current = None
    if "Subject" in fields and "Description" not in fields:
        fields["Description"] = fields["Subject"]
    return fields


def check_header(path: Path) -> dict[str, str]:
    """Validate a patch's DEP-3 header; ConfigError (exit 2) naming the patch and field."""
    header, _ = split_header(Path(path).read_text())
    fields = parse_header(header)
    for name in REQUIRED:
        if not fields.get(name, "").strip():
            label = "Description (or Subject)" if name == "Description" else name
            raise ConfigError(
                f"{path}: header field {label} missing or empty (DEP-3 header before the first diff line)"
            )
    try:
        dt.date.fromisoformat(fields["Last-Update"])
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", fields["Last-Update"]):
            raise ValueError
    except ValueError:
        raise ConfigError(f"{path}: Last-Update {fields['Last-Update']!r} is not a date YYYY-MM-DD") from None
    return fields


@dataclass(frozen=True)
class FileChange:
    path: str
    added: int
    removed: int
    new: bool
    deleted: bool


def patch_files(path: Path) -> list[FileChange]:
    """The files a patch touches, with +/- line counts; checks the a/ b/ layout."""
    path = Path(path)
    _, diff = split_header(path.read_text())
    try:
        pset = unidiff.PatchSet(diff)
    except unidiff.UnidiffParseError as exc:
        raise PatchApplyError(f"{path}: not a valid unified diff ({exc})") from exc
    if not len(pset):
        raise PatchApplyError(f"{path}: contains no diff")
    changes = []
    for f in pset:
        for side, prefix in ((f.source_file, "a/"), (f.target_file, "b/")):
            if side != "/dev/null" and not side.startswith(prefix):
                raise ConfigError(
                    f"{path}: path {side!r} must start with {prefix} (paths relative to the sglang package, strip 1)"
                )
        rel = f.path
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ConfigError(f"{path}: path {rel!r} leaves the sglang package")
        if rel in SHIPPED_FILES:
            name = rel.rsplit("/", 1)[1]
            raise ConfigError(f"{path}: touches {rel}; it is shipped from {name}, not from a patch")
        changes.append(FileChange(rel, f.added, f.removed, f.is_added_file, f.is_removed_file))
    return changes


def hunk_of(path: Path, relpath: str, old_line: int) -> tuple[int, str] | None:
    """(1-based hunk number, '@@ ... @@' header) of the hunk of `relpath` starting at `old_line`."""
    try:
        pset = unidiff.PatchSet(split_header(Path(path).read_text())[1])
    except unidiff.UnidiffParseError:
        return None
    for f in pset:
        if f.path != relpath:
            continue
        hunks = list(f)
        for i, h in enumerate(hunks, 1):
            if h.source_start == old_line or h.target_start == old_line:
                return i, f"@@ -{h.source_start},{h.source_length} +{h.target_start},{h.target_length} @@"
    return None


# ---------------------------------------------------------------------------------------------
# Applying


def git_env(workdir: Path) -> dict[str, str]:
    """Environment for git commands on a plain directory: no repository discovery above it,
    no user or system configuration."""
    env = dict(os.environ)
    env.update(
        {
            "GIT_CEILING_DIRECTORIES": str(Path(workdir).resolve().parent),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "LC_ALL": "C",
        }
    )
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def run_git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run git on a plain directory (see git_env); a missing git is a clear usage error."""
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, env=git_env(Path(cwd)), capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise ConfigError("git not found: install git (patches are applied with `git apply`)") from None


_FAILED_RE = re.compile(r"^error: patch failed: (.+):(\d+)$", re.M)
_FILE_ERR_RE = re.compile(
    r"^error: (.+?): (No such file or directory|already exists in working directory|does not exist in index"
    r"|patch does not apply|does not match index)$",
    re.M,
)
_OFFSET_RE = re.compile(
    r"^Checking patch (.+?)\.\.\.$|^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.$", re.M
)


def _offsets(output: str) -> list[tuple[str, int, int]]:
    """[(file, hunk number, offset)] from `git apply -v` output."""
    found, current = [], None
    for m in _OFFSET_RE.finditer(output):
        if m.group(1):
            current = m.group(1)
        else:
            found.append((current or "?", int(m.group(2)), int(m.group(4))))
    return found


def _indent(title: str, text: str) -> str:
    return "\n".join([title] + [f"  | {ln}" for ln in text.strip().splitlines()])


def _explain(patch: Path, output: str, reverse: bool) -> str:
    verb = "reverse-apply" if reverse else "apply"
    m = _FAILED_RE.search(output)
    if m:
        rel, line = m.group(1), int(m.group(2))
        hunk = hunk_of(patch, rel, line)
        which = f"hunk #{hunk[0]} ({hunk[1]})" if hunk else f"the hunk at line {line}"
        return f"{patch.name}: {which} does not {verb} to {rel} with zero fuzz"
    m = _FILE_ERR_RE.search(output)
    if m:
        return f"{patch.name}: cannot {verb} to {m.group(1)}: {m.group(2)}"
    errors = [ln[len("error: ") :] for ln in output.splitlines() if ln.startswith("error: ")]
    return f"{patch.name}: does not {verb}: {errors[-1] if errors else output.strip() or 'git apply failed'}"


def apply_patch(
    tree: Path, patch: Path, *, reverse: bool = False, allow_offset: bool = False, check_only: bool = False
) -> list[str]:
    """Apply one patch to `tree` with `git apply` (never fuzz). `--check` runs first, so a failing
    patch leaves the tree untouched. Hunks that only apply at a line offset are an error unless
    `allow_offset`; then they are returned as warnings. PatchApplyError (exit 3) names the hunk."""
    tree, patch = Path(tree), Path(patch).resolve()
    base = ["apply", "-v", "-p1", "--whitespace=nowarn"] + (["-R"] if reverse else [])
    proc = run_git(base + ["--check", str(patch)], tree)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise PatchApplyError(_explain(patch, output, reverse), detail=_indent("git apply said:", output))
    warnings = [
        f"{patch.name}: hunk #{h} of {f} applies only at an offset of {o} lines "
        f"(run `ddtree-deploy refresh {patch.name}`)"
        for f, h, o in _offsets(output)
    ]
    if warnings and not allow_offset:
        raise PatchApplyError(warnings[0].replace("applies only", "does not apply exactly; it applies only"))
    if not check_only:
        proc = run_git(base + [str(patch)], tree)
        if proc.returncode != 0:  # pragma: no cover - --check passed just before
            raise PatchApplyError(_explain(patch, proc.stdout + proc.stderr, reverse))
    return warnings


def apply_series(
    tree: Path, entries: list[Entry], *, reverse: bool = False, allow_offset: bool = False, on_patch=None
) -> list[str]:
    """Apply `entries` in order (reverse: undo them in reverse order). Returns offset warnings."""
    warnings: list[str] = []
    for e in reversed(entries) if reverse else entries:
        if on_patch:
            on_patch(e)
        warnings += apply_patch(tree, e.path, reverse=reverse, allow_offset=allow_offset)
    return warnings


# ---------------------------------------------------------------------------------------------
# Producing diffs


def diff_file(old_root: Path, new_root: Path, relpath: str) -> str:
    """A git-style unified diff (3 lines of context, a/ b/ prefixes, no index line) of one file
    between two trees; '' when equal. Either side may be absent (new or deleted file)."""
    old, new = Path(old_root) / relpath, Path(new_root) / relpath
    if not old.exists() and not new.exists():
        return ""
    args = [str(old) if old.exists() else os.devnull, str(new) if new.exists() else os.devnull]
    proc = run_git(
        ["diff", "--no-index", "--no-color", "--no-ext-diff", "--no-renames", "-U3", "--", *args], Path(new_root)
    )
    if proc.returncode not in (0, 1):
        raise ConfigError(f"git diff failed on {relpath}: {proc.stderr.strip()}")
    out = []
    for line in proc.stdout.splitlines(keepends=True):
        if line.startswith("diff --git "):
            out.append(f"diff --git a/{relpath} b/{relpath}\n")
        elif line.startswith("index ") or line.startswith("old mode ") or line.startswith("new mode "):
            continue
        elif line.startswith("--- ") and not line.startswith("--- /dev/null"):
            out.append(f"--- a/{relpath}\n")
        elif line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
            out.append(f"+++ b/{relpath}\n")
        else:
            out.append(line)
    return "".join(out)
