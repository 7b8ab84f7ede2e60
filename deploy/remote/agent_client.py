"""The client side of the host agent (deploy/remote/agent.py): one call = one command on the host,
`<python> <agent> <op> <json>`, answered by one line `@@ddtree-agent@@ <json>`.

The operations and their payload keys are the table `agent.OPS`, shared with the agent: a call that
does not fit it is a bug here, refused before anything is sent. The agent's source goes over the
wire with the first call of a connection only (`python -c <source> ... --save <path>`: the agent
stores itself under the host's state_dir); later calls run the stored file. When it could not be
stored (a full disk) or has gone (a reboot that cleaned the state dir), the source is sent again.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from functools import lru_cache
from pathlib import Path

from ..errors import ConfigError, DDTreeDeployError
from . import agent
from .transport import Transport

MARK = agent.MARK


class AgentError(DDTreeDeployError):
    """The host-side helper failed (exit 1)."""


@lru_cache(maxsize=1)
def agent_source() -> str:
    return Path(agent.__file__).read_text()


def agent_path(t: Transport) -> str:
    """Where the agent stores itself on the host: content-addressed, under the host's state_dir."""
    digest = hashlib.sha256(agent_source().encode()).hexdigest()[:16]
    return f"{t.host.state_dir.rstrip('/')}/ddtree-agent-{digest}.py"


def _command(t: Transport, op: str, payload: dict) -> tuple[str, bool]:
    """The command line of one call, and whether it carries the source (and asks the agent to store it)."""
    stored = getattr(t, "agent_stored", False)
    args = [t.host.python, agent_path(t)] if stored else [t.host.python, "-c", agent_source()]
    args += [op, json.dumps(payload)]
    if not stored:
        args += ["--save", agent_path(t)]
    return " ".join(shlex.quote(a) for a in args), not stored


def call_agent(t: Transport, op: str, payload: dict, timeout_s: int | None = None) -> dict:
    """Run one agent op with the service's python on the host and return its JSON answer."""
    why = agent.check_call(op, payload)
    if why is not None:
        raise TypeError(f"agent protocol: {why}")
    script, sends_source = _command(t, op, payload)
    r = t.run(script, timeout_s)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith(MARK)), None)
    if line is None and not sends_source and r.rc == 2 and "can't open file" in r.stderr:
        t.agent_stored = False  # the stored agent has gone (nothing ran): send the source again
        script, sends_source = _command(t, op, payload)
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
    if sends_source:
        t.agent_stored = bool(out.pop("_saved", False))
    if out.get("config_error"):
        raise ConfigError(f"{t.label}: {out['agent_error']}")
    if "agent_error" in out:
        raise AgentError(f"{t.label}: remote {op} failed: {out['agent_error']}")
    return out
