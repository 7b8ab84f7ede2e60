"""Pins: the SGLang releases this project patches, each built and gated on its own.

A pin is a directory `snapshot/sglang-<V>/` (the exact upstream bytes of the files its series
touches, with MANIFEST.json). Its ordered series is `patches/<V>/series`, the patches beside it;
its build is `build/sglang-<V>/`; its real SGLang for the CPU tests and gate 6 is the venv's own
(0.5.13.post1) or a `--target` site in `<venv>/sglang-sites/<V>/` (scripts/install_sglang_env.sh).

The build-side commands take `--pin V` (default: every pin). A pin whose series is empty
(comment-only) is in preparation: run over every pin, `patch` and `check` skip it with a message;
named with `--pin V` it is built (the snapshot plus ddtree_utils.py, a tree to edit) and gated.
`plan`/`push`/`status` without `--build` read each host's installed SGLang version and use the
build of the pin of that version (BuildChoice); a version without a pin is refused (exit 6).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DDTreeDeployError, RemoteRefused, UsageError
from .build import BUILD_ROOT, DDTREE_UTILS, PATCHES_ROOT, Inputs
from .buildinfo import MANIFEST_NAME, BuildInfo
from .series import load_series
from .snapshot import SNAPSHOT_ROOT, load_manifest

PREFIX = "sglang-"
SITES_ENV = "DDTREE_SGLANG_SITES"


@dataclass(frozen=True)
class Pin:
    version: str
    snapshot_dir: Path
    patches_dir: Path

    def inputs(self, build_root: Path = BUILD_ROOT, ddtree_utils: Path = DDTREE_UTILS) -> Inputs:
        return Inputs(Path(self.snapshot_dir), Path(self.patches_dir), Path(build_root), Path(ddtree_utils))

    def build_dir(self, build_root: Path = BUILD_ROOT) -> Path:
        return build_dir(self.version, build_root)

    def series_empty(self) -> bool:
        """The series lists no patch (ConfigError, exit 2, when it is missing or invalid)."""
        return not load_series(self.patches_dir).entries


def version_key(version: str) -> tuple:
    """Order versions numerically: 0.5.9 < 0.5.13.post1 < 0.5.16."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", version))


def build_dir(version: str, build_root: Path = BUILD_ROOT) -> Path:
    return Path(build_root) / f"{PREFIX}{version}"


def list_pins(snapshot_root: Path = SNAPSHOT_ROOT, patches_root: Path = PATCHES_ROOT) -> list[Pin]:
    """Every `<snapshot_root>/sglang-<V>/` directory, oldest version first."""
    root = Path(snapshot_root)
    dirs = [d for d in root.glob(f"{PREFIX}*") if d.is_dir()] if root.is_dir() else []
    pins = [Pin(d.name[len(PREFIX):], d, Path(patches_root) / d.name[len(PREFIX):]) for d in dirs]
    return sorted(pins, key=lambda p: version_key(p.version))


def names(pins: list[Pin]) -> str:
    return ", ".join(p.version for p in pins) or "none"


def select(
    pin: str | None = None, snapshot_root: Path = SNAPSHOT_ROOT, patches_root: Path = PATCHES_ROOT
) -> list[Pin]:
    """All pins, or the one named `pin` (UsageError listing the pins when there is none such)."""
    pins = list_pins(snapshot_root, patches_root)
    if not pins:
        raise ConfigError(
            f"no pins: {snapshot_root} has no {PREFIX}<version>/ directory "
            "(create one with `ddtree-deploy snapshot import --version V --file srt/...`)"
        )
    if pin is None:
        return pins
    chosen = [p for p in pins if p.version == pin.removeprefix(PREFIX)]
    if not chosen:
        raise UsageError(f"no pin {pin!r} (pins: {names(pins)})")
    return chosen


def resolve(
    pin: str | None,
    snapshot_dir: Path | None = None,
    patches_dir: Path | None = None,
    snapshot_root: Path = SNAPSHOT_ROOT,
    patches_root: Path = PATCHES_ROOT,
) -> list[Pin]:
    """The pins a build-side command works on. `--snapshot-dir` names one pin outside the
    snapshot root (its version from its manifest); `--patches-dir` replaces the series of the one
    pin chosen (so it needs `--pin` when there are several)."""
    if snapshot_dir is not None:
        try:
            version = load_manifest(snapshot_dir).sglang_version
        except DDTreeDeployError:  # a broken manifest is gate 1's / verify's finding
            version = Path(snapshot_dir).name.removeprefix(PREFIX)
        if pin is not None and pin.removeprefix(PREFIX) != version:
            raise UsageError(f"--pin {pin} but --snapshot-dir {snapshot_dir} holds sglang {version}")
        return [Pin(version, Path(snapshot_dir), Path(patches_dir) if patches_dir else Path(patches_root) / version)]
    pins = select(pin, snapshot_root, patches_root)
    if patches_dir is not None:
        if len(pins) > 1:
            raise UsageError(f"--patches-dir names one series: give --pin too (pins: {names(pins)})")
        pins = [Pin(pins[0].version, pins[0].snapshot_dir, Path(patches_dir))]
    return pins


def with_patch(pins: list[Pin], patch: str, explicit: bool) -> Pin:
    """The pin whose series holds `patch` (for `refresh`): the only pin, the named one, or the only
    series that has it; several candidates need `--pin` (UsageError, exit 2)."""
    if explicit or len(pins) == 1:
        return pins[0]
    having = []
    for p in pins:
        try:
            load_series(p.patches_dir).index_of(patch)
        except ConfigError:
            continue
        having.append(p)
    if len(having) == 1:
        return having[0]
    if not having:
        raise UsageError(f"{patch}: in no pin's series (pins: {names(pins)})")
    raise UsageError(f"{patch}: in the series of several pins ({names(having)}): give --pin")


# ---------------------------------------------------------------------------------------------
# The real SGLang of a pin (CPU tests, gate 6)


def sites_root(python: str | os.PathLike = sys.executable) -> Path:
    """$DDTREE_SGLANG_SITES, else `<venv of python>/sglang-sites`."""
    env = os.environ.get(SITES_ENV)
    return Path(env) if env else Path(python).parent.parent / "sglang-sites"


def sglang_site(version: str, python: str | os.PathLike = sys.executable) -> Path | None:
    """The `--target` site holding sglang `version` for this venv, or None (then the venv's own
    sglang, if it is that version, is the pin's)."""
    site = sites_root(python) / version
    return site if (site / "sglang" / "__init__.py").is_file() else None


def sglang_env(version: str, python: str | os.PathLike = sys.executable, env: dict | None = None) -> dict:
    """An environment whose `python` imports the real sglang of `version`: its site first on
    PYTHONPATH when there is one (the venv's site-packages still supply the other packages)."""
    out = dict(os.environ if env is None else env)
    site = sglang_site(version, python)
    if site is not None:
        out["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [out.get("PYTHONPATH")])])
    return out


# ---------------------------------------------------------------------------------------------
# plan / push / status: the build of the host's pin


class BuildChoice:
    """No `--build` given: for each host, the build of the pin whose version is the host's
    installed SGLang. `load` turns a build directory into a BuildInfo (push also checks its gates
    there); each pin's build is loaded once, whatever the number of hosts (thread-safe)."""

    def __init__(
        self,
        load: Callable[[Path], BuildInfo],
        build_root: Path = BUILD_ROOT,
        snapshot_root: Path = SNAPSHOT_ROOT,
    ):
        self.load = load
        self.build_root = Path(build_root)
        self.snapshot_root = Path(snapshot_root)
        self._builds: dict[str, BuildInfo] = {}
        self._lock = threading.Lock()

    @property
    def versions(self) -> list[str]:
        return [p.version for p in list_pins(self.snapshot_root)]

    def file_lists(self) -> dict[str, list[str]]:
        """{version: the files of that pin's build}, from each build's manifest (not verified here:
        the build of the host's version is loaded, and verified, by for_version)."""
        out = {}
        for v in self.versions:
            try:
                out[v] = sorted(json.loads((build_dir(v, self.build_root) / MANIFEST_NAME).read_text())["files"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no build for this pin: for_version says so if a host needs it
        return out

    def describe(self) -> str:
        return f"the build of each host's pin (pins: {', '.join(self.versions) or 'none'})"

    def for_version(self, version: str, where: str = "host") -> BuildInfo:
        versions = self.versions
        if version not in versions:
            raise RemoteRefused(
                f"{where}: remote SGLang is {version}, which has no pin (pins: {', '.join(versions) or 'none'}); "
                f"refusing (install one of those versions there, or add a pin for {version})"
            )
        with self._lock:
            if version not in self._builds:
                path = build_dir(version, self.build_root)
                if not (path / MANIFEST_NAME).is_file():
                    raise ConfigError(f"no build for pin {version} at {path}: run `ddtree-deploy patch --pin {version}`")
                self._builds[version] = self.load(path)
            return self._builds[version]
