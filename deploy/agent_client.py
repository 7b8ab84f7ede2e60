"""The client side of the host agent RPC: `deploy/remote_agent.py` is sent as
`python -c <source> <op> <json>` with the service's python, and answers one line `@@ddtree-agent@@ <json>`."""

from __future__ import annotations

import json
import shlex
from functools import lru_cache
from pathlib import Path

from .errors import ConfigError, DDTreeDeployError
from .transport import Transport

MARK = "@@ddtree-agent@@"


class AgentError(DDTreeDeployError):
    """The host-side helper failed (exit 1)."""


@lru_cache(maxsize=1)
def agent_source() -> str:
    return (Path(__file__).with_name("remote_agent.py")).read_text()


def call_agent(t: Transport, op: str, payload: dict, timeout_s: int | None = None) -> dict:
    """Run one agent op with the service's python on the host and return its JSON answer."""
    script = " ".join(shlex.quote(a) for a in (t.host.python, "-c", agent_source(), op, json.dumps(payload)))
    r = t.run(script, timeout_s)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith(MARK)), None)
    if line is None and r.rc in (126, 127):
        raise ConfigError(f"{t.label}: cannot run {t.host.python} on the host (exit {r.rc}); check `python` in the inventory",
                          detail=(r.stderr or r.stdout).strip()[-500:] or None)
    if line is None:
        why = "timed out on the host" if r.rc == 124 else f"exit {r.rc}"
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise AgentError(f"{t.label}: remote {op} failed ({why}) with {t.host.python}", detail="\n".join(tail) or None)
    out = json.loads(line[len(MARK):])
    if "agent_error" in out:
        raise AgentError(f"{t.label}: remote {op} failed: {out['agent_error']}")
    return out
