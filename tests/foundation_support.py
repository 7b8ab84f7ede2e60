"""Helpers for the foundation tests: a small synthetic project (snapshot, patch series,
ddtree_utils.py, build root) in tmp_path, and patches made by difflib (independent of the code
under test). Imported by tests/conftest.py and the test modules."""

from __future__ import annotations

import difflib
import hashlib
import json
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Two small "upstream" files. Line 1 of mod.py has an upstream pyflakes finding (unused import),
# which the lint gate must not blame on the series.
UPSTREAM = {
    "srt/speculative/mod.py": textwrap.dedent('''\
        import os


        def alpha(x):
            """First function."""
            return x + 1


        def beta(y):
            """Second function."""
            return y * 2


        def gamma(z):
            """Third function."""
            return z - 3
        '''),
    "srt/other.py": "".join(f"VALUE_{i} = {i}\n" for i in range(40)),
}

HEADER = textwrap.dedent("""\
    Description: {desc}
     A longer explanation on a continuation line.
    Origin: vendor, https://example.invalid/ddtree
    Forwarded: not-needed
    Last-Update: 2026-01-15
    ---
    """)


def udiff(rel: str, old: str | None, new: str) -> str:
    """A unified diff made by difflib (independent of the code under test), a/ b/ prefixes."""
    a = [] if old is None else old.splitlines(keepends=True)
    lines = list(
        difflib.unified_diff(
            a, new.splitlines(keepends=True), "/dev/null" if old is None else f"a/{rel}", f"b/{rel}", n=3
        )
    )
    return "".join(lines)


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


class Project:
    """A synthetic project: files under `root`, handles for the paths the machinery takes."""

    def __init__(self, root: Path, version: str = "9.9.9"):
        self.root = root
        self.version = version
        self.snapshot_dir = root / "snapshot" / f"sglang-{version}"
        self.patches_dir = root / "patches"
        self.build_root = root / "build"
        self.utils = root / "ddtree_utils.py"
        self.tests_dir = root / "tests"

    @property
    def build_dir(self) -> Path:
        return self.build_root / f"sglang-{self.version}"

    def inputs(self):
        from ddtree_deploy.deploy.build.build import Inputs

        return Inputs(self.snapshot_dir, self.patches_dir, self.build_root, self.utils)

    def cli_args(self) -> list[str]:
        return [
            "--snapshot-dir",
            str(self.snapshot_dir),
            "--patches-dir",
            str(self.patches_dir),
            "--build-dir",
            str(self.build_root),
            "--ddtree-utils",
            str(self.utils),
        ]

    def write_snapshot(self, files: dict[str, str]) -> None:
        for rel, text in files.items():
            p = self.snapshot_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        manifest = {
            "sglang_version": self.version,
            "wheel": {"name": None, "sha256": None},
            "files": {rel: sha(text) for rel, text in files.items()},
        }
        (self.snapshot_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    def add_patch(
        self, name: str, diff: str, desc: str = "A change.", header: str | None = None, listed: bool = True
    ) -> Path:
        self.patches_dir.mkdir(parents=True, exist_ok=True)
        path = self.patches_dir / name
        path.write_text((HEADER.format(desc=desc) if header is None else header) + diff)
        if listed:
            series = self.patches_dir / "series"
            text = series.read_text() if series.exists() else "# test series\n"
            series.write_text(text + name + "\n")
        return path

    def tree_bytes(self, root: Path | None = None) -> dict[str, bytes]:
        """Every file under `root` (default: the build root), for before/after comparisons."""
        root = root or self.build_root
        if not root.exists():
            return {}
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]
