"""The env file of `[hosts.<name>.launch]` on a host: what a push or a rollback does to it, and what
`status` shows. The rules (validation, parsing, rendering, EnvChange) are pure and live in
deploy.config.launch; this module reads the host's file through the agent."""

from __future__ import annotations

import base64
import re

from ..build.buildinfo import BuildInfo
from ..config.launch import (
    DEFAULT_VARIABLE,
    SPEC_INFO,
    EnvChange,
    algorithm_of,
    auto_budget_refusal,
    parse_env,
    render_env,
    sha256_of,
)
from ..errors import RemoteRefused
from .agent_client import call_agent
from .facts import HostFacts
from .transport import Transport


def build_has_ddtree(build: BuildInfo) -> bool:
    """The build adds the DDTREE algorithm (its spec_info.py defines the enum member)."""
    if SPEC_INFO not in build.files:
        return False
    text = build.path_of(SPEC_INFO).read_text(encoding="utf-8", errors="replace")
    return re.search(r"^\s+DDTREE\s*=", text, re.MULTILINE) is not None


def read_host_file(t: Transport, path: str, facts: HostFacts | None = None) -> bytes | None:
    """The bytes of a file on the host (None: absent); from `facts` when they were read with them."""
    if facts is not None and path in facts.reads:
        return facts.reads[path]
    r = call_agent(t, "read", {"path": path}, 60)
    return base64.b64decode(r["b64"]) if r["exists"] else None


def for_push(t: Transport, build: BuildInfo, facts: HostFacts) -> EnvChange | None:
    """What a push of `build` does to the host's env file; None without [hosts.<name>.launch]."""
    h = t.host
    lc = h.launch
    if lc is None:
        return None
    current, releases = facts.current, facts.releases
    before = read_host_file(t, lc.env_file, facts)
    after = before
    if build_has_ddtree(build):
        args = lc.args_for(build.sglang_version)
        refusal = auto_budget_refusal(args, build.sglang_version)
        if refusal is not None:
            raise RemoteRefused(f"{h.name}: {lc.env_file}: {refusal} (nothing changed)")
        try:
            after = render_env(before, lc.variable, args)
        except ValueError as exc:
            raise RemoteRefused(f"{h.name}: {lc.env_file}: {exc} (nothing changed)") from None
    elif algorithm_of(parse_env(before).get(lc.variable)) == "DDTREE":
        raise RemoteRefused(f"{h.name}: build {build.build_id} has no DDTREE but {lc.env_file} turns DDTREE on; "
                            f"refusing (roll back first: `ddtree-deploy rollback {h.name} --to pristine`)")
    files = (current or {}).get("files") or {}
    drifted = lc.env_file in files and files[lc.env_file] != sha256_of(before)
    pristine = sha256_of(before)  # first seen now: what the file was before the tool managed it
    for rec in sorted(releases, key=lambda r: r.get("id", "")):
        if lc.env_file in (rec.get("pristine") or {}):
            pristine = rec["pristine"][lc.env_file]
            break
    return EnvChange(lc.env_file, lc.variable, before, after, drifted=drifted, pristine_sha256=pristine)


def for_rollback(t: Transport, records: dict[str, dict], targets: dict[str, dict],
                 facts: HostFacts | None = None) -> EnvChange | None:
    """The env file a rollback puts back (an absolute target), read from its source on the host; when
    the rollback does not touch it but the inventory declares one, the live file (unchanged)."""
    h = t.host
    paths = sorted(r for r in targets if r.startswith("/"))
    if not paths:
        if h.launch is None:
            return None
        live = read_host_file(t, h.launch.env_file, facts)
        return EnvChange(h.launch.env_file, h.launch.variable, live, live)
    path = h.launch.env_file if h.launch is not None and h.launch.env_file in paths else paths[0]
    variable = h.launch.variable if h.launch is not None and h.launch.env_file == path else DEFAULT_VARIABLE
    for rec in sorted(records.values(), key=lambda r: r.get("id", ""), reverse=True):
        if (rec.get("launch") or {}).get("env_file") == path:
            variable = rec["launch"].get("variable") or variable
            break
    src = targets[path]["src"]
    after = read_host_file(t, src) if src else None
    return EnvChange(path, variable, read_host_file(t, path, facts), after)


def live(t: Transport, facts: HostFacts | None = None) -> dict | None:
    """`status`: the env file's flags now and the algorithm the service runs with at its next start."""
    lc = t.host.launch
    if lc is None:
        return None
    data = read_host_file(t, lc.env_file, facts)
    args = parse_env(data).get(lc.variable)
    return {"env_file": lc.env_file, "variable": lc.variable, "exists": data is not None, "args": args,
            "expect_algorithm": algorithm_of(args), "sha256": sha256_of(data)}
