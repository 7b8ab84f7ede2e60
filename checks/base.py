"""What every quality gate shares: the context it inspects and the result it returns."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..deploy.build import snapshot as snap
from ..deploy.build.build import REPO_ROOT, Inputs
from ..deploy.build.buildinfo import BuildInfo, load_build

PASS, FAIL, SKIP = "pass", "fail", "skip"
Step = Callable[[str], None]  # a gate reports what it is doing now (progress output)


@dataclass
class Context:
    """The inputs of a check run: the repository's directories unless told otherwise."""

    inputs: Inputs = field(default_factory=Inputs)
    repo_root: Path = REPO_ROOT
    tests_dir: Path | None = None
    extra_pythons: list[str] = field(default_factory=list)
    python: str = sys.executable
    timeout_s: float = 1800

    @property
    def version(self) -> str:
        try:
            return snap.load_manifest(self.inputs.snapshot_dir).sglang_version
        except Exception:  # a broken manifest is gate 1's finding; fall back to the dir name
            return Path(self.inputs.snapshot_dir).name.removeprefix("sglang-")

    @property
    def build_dir(self) -> Path:
        return self.inputs.build_dir(self.version)

    @property
    def tests(self) -> Path:
        return self.tests_dir or (self.repo_root / "tests")

    def build(self) -> BuildInfo:
        """The current build, checked against its manifest (ConfigError when missing or edited)."""
        return load_build(self.build_dir)

    def run_python(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess | None:
        """`<python> ARGS` in the repository root with the gate timeout; None when it timed out."""
        try:
            return subprocess.run(
                [self.python, *args],
                cwd=self.repo_root,
                env=env,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None


@dataclass
class GateResult:
    number: int
    name: str
    status: str  # pass | fail | skip
    files: int = 0
    summary: str = ""
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reused_from: str = ""  # when a passing result was reused: the time the gate last ran

    @property
    def reused(self) -> bool:
        return bool(self.reused_from)

    def to_json(self) -> dict:
        return {
            "gate": self.number,
            "name": self.name,
            "status": self.status,
            "files": self.files,
            "summary": self.summary,
            "details": self.details,
            "seconds": round(self.seconds, 3),
            "reused": self.reused,
            **({"reused_from": self.reused_from} if self.reused else {}),
        }
