"""Local release records: one JSON line per action per host under `deploy-state/` (or
$DDTREE_DEPLOY_STATE): id, time, host, action, build id, series hash, files, outcome."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

_LOCK = threading.Lock()


def state_dir() -> Path:
    return Path(os.environ.get("DDTREE_DEPLOY_STATE", "deploy-state"))


def append(host: str, record: dict) -> Path:
    path = state_dir() / f"{host}.jsonl"
    with _LOCK:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    return path


def read(host: str) -> list[dict]:
    path = state_dir() / f"{host}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
