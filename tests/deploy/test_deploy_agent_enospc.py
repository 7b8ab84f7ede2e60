"""The host agent's own writes on a full state filesystem (a 1 MiB tmpfs in a private mount
namespace, filled to the last byte), without sshd: a record write leaves no temp file and the old
record intact, a journal line that does not fit is cut off again (the journal stays parseable and
takes the next step cleanly once there is space), and a lock whose owner.json cannot be written is
not left behind ownerless. Needs root (unshare, mount)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "deploy" / "remote" / "agent.py"

SCRIPT = r'''
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("agent", sys.argv[1])
ag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ag)
state = sys.argv[2]
out = {}
ag._journal(state, "r1", "staging")
ag._write_json(os.path.join(state, "current.json"), {"state": "before"})
fd = os.open(os.path.join(state, "filler"), os.O_WRONLY | os.O_CREAT)
for size in (1 << 20, 4096, 1):  # until not even one more byte fits
    try:
        while True:
            os.write(fd, b"\0" * size)
    except OSError:
        pass
os.close(fd)
pad = "x" * 16384  # more than any page's slack: the write needs new pages
def err(f, *a, **k):
    try:
        f(*a, **k)
        return "ok"
    except OSError as exc:
        return exc.strerror
out["record"] = err(ag._write_json, os.path.join(state, "current.json"), {"state": "after", "pad": pad})
out["current"] = json.load(open(os.path.join(state, "current.json")))["state"]
out["journal_full"] = err(ag._journal, state, "r1", "swapping", pad=pad)
out["lock"] = err(ag.op_lock, {"state_dir": state, "owner": {"owner": "t", "pad": pad}})
out["lock_dir_left"] = os.path.exists(os.path.join(state, "lock"))
out["tmp"] = sorted(n for _, _, fs in os.walk(state) for n in fs if ".tmp-" in n)
jpath = os.path.join(state, "releases", "r1", "journal.jsonl")
out["journal_size_full"] = os.path.getsize(jpath)
os.unlink(os.path.join(state, "filler"))
ag._journal(state, "r1", "aborted")
out["steps"] = [json.loads(ln)["step"] for ln in open(jpath)]
out["lock_after"] = ag.op_lock({"state_dir": state, "owner": {"owner": "t"}})
print(json.dumps(out))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare, mount)")
def test_agent_writes_on_a_full_state_fs(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    sh = f"mount -t tmpfs -o size=1m ddtree-agent-enospc {state} && exec {sys.executable} -c \"$0\" {AGENT} {state}"
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", sh, SCRIPT],
                       check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["record"] == "No space left on device" and out["current"] == "before", out
    assert out["journal_full"] == "No space left on device", out
    assert out["lock"] == "No space left on device" and not out["lock_dir_left"], out
    assert out["tmp"] == [], out
    assert out["steps"] == ["staging", "aborted"], out  # the torn `swapping` line was cut off
    assert out["lock_after"] == {"acquired": True}, out
