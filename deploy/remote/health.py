"""The health gate, run on the host itself (a GPU host's port is rarely reachable from here):
poll `/health` until the deadline, fail fast when the service process has died or its supervisor
restarts it over and over (a crash loop: deploy.remote.restart.CrashWatch), then require the
expected speculative algorithm in `/get_server_info` and one successful smoke generation. Each poll
is one agent call: the liveness command, the supervisor's facts and the request together."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import restart
from .agent_client import call_agent
from .transport import Transport

TickFn = Callable[[float], None]  # called with the elapsed seconds while waiting
INVENTORY = object()  # `expect` default: the inventory's health.expect_algorithm


@dataclass
class HealthReport:
    ok: bool
    reason: str
    elapsed_s: float
    algorithm: str | None = None
    metrics: dict = field(default_factory=dict)
    smoke: str | None = None
    log_tail: str | None = None

    def to_json(self) -> dict:
        return self.__dict__.copy()


def http(t: Transport, path: str, payload: dict | None = None, **shell: str | None) -> dict:
    """One request from the host; `alive=`/`probe=` (restart strategy commands) run first in the same call."""
    h = t.host.health
    timeout = h.request_timeout_s
    extra = {k: v for k, v in shell.items() if v}
    return call_agent(t, "http", dict({"url": h.url + path, "json": payload, "timeout": timeout}, **extra),
                      int(timeout) + 20 + 30 * len(extra))


def server_info(t: Transport) -> dict | None:
    r = http(t, "/get_server_info")
    if r.get("status") != 200:
        return None
    try:
        return json.loads(r["body"])
    except ValueError:
        return None


def algorithm_and_metrics(info: dict) -> tuple[str | None, dict]:
    """speculative_algorithm and acceptance metrics, shaped like SGLang's /get_server_info."""
    algo = info.get("speculative_algorithm")
    metrics: dict = {}
    for i, st in enumerate(info.get("internal_states") or []):
        for k, v in (st or {}).items():
            if "accept" in k or k.startswith("spec_"):
                metrics[f"{k}[{i}]" if i else k] = v
    return algo, metrics


def wait_healthy(t: Transport, tick: TickFn | None = None, expect=INVENTORY) -> HealthReport:
    """`expect`: the speculative algorithm required (None: no check); by default the inventory's.
    With [launch], each transition passes the algorithm of the flags it puts in place."""
    h = t.host.health
    cmds = restart.commands(t.host.restart)
    watch = restart.CrashWatch(t.host.restart)
    start = time.monotonic()
    last = "no answer yet"
    while True:
        elapsed = time.monotonic() - start
        if tick:
            tick(elapsed)
        r = http(t, "/health", alive=cmds["alive"], probe=cmds["probe"])
        loop = watch.check(restart.probe_facts(t.host.restart, r.get("probe")))
        if loop:
            return HealthReport(False, loop, elapsed, log_tail=restart.log_tail(t))
        if r.get("alive") is False:
            return HealthReport(False, "the service process is not running (died during start)", elapsed,
                                log_tail=restart.log_tail(t))
        if r.get("status") == 200:
            break
        last = f"HTTP {r['status']}" if r.get("status") else r.get("error", "no answer")
        if elapsed >= h.deadline_s:
            return HealthReport(False, f"not healthy within the {h.deadline_s:g}s deadline (last: {last})", elapsed,
                                log_tail=restart.log_tail(t))
        time.sleep(min(h.interval_s, max(0.0, h.deadline_s - elapsed) + 0.05))
    return check_service(t, start, expect)


def check_service(t: Transport, start: float | None = None, expect=INVENTORY) -> HealthReport:
    """The checks after /health answers: speculative algorithm, then a smoke generation."""
    h = t.host.health
    want = h.expect_algorithm if expect is INVENTORY else expect
    start = time.monotonic() if start is None else start
    info = server_info(t)

    def since() -> float:
        return time.monotonic() - start

    if info is None:
        return HealthReport(False, "/get_server_info did not answer with JSON", since())
    algo, metrics = algorithm_and_metrics(info)
    if want and str(algo).upper() != want.upper():
        return HealthReport(False, f"speculative_algorithm is {algo!r}, expected {want!r}", since(),
                            algorithm=algo, metrics=metrics)
    smoke = None
    if h.smoke is not None:
        r = http(t, "/generate", {"text": h.smoke.text,
                                  "sampling_params": {"max_new_tokens": h.smoke.max_new_tokens, "temperature": 0}})
        try:
            body = json.loads(r.get("body") or "")
        except ValueError:
            body = None
        text = body.get("text") if isinstance(body, dict) else None
        if r.get("status") != 200 or not isinstance(text, str) or not text:
            return HealthReport(False, f"smoke generation failed (HTTP {r.get('status')}: {str(r.get('body') or r.get('error'))[:200]})",
                                since(), algorithm=algo, metrics=metrics)
        smoke = text
    return HealthReport(True, "healthy", since(), algorithm=algo, metrics=metrics, smoke=smoke)
