"""`ddtree-deploy bench`: serving benchmark against live SGLang servers (measurement in deploy.bench).

A TARGET is an http(s) URL, or an inventory host name: then the host's `health.url` (as seen from
the host) is reached through the host's SSH connection with a local port forward (the host
`local` is this machine: its URL is used as is).

Exit codes: 0 every request answered; 1 some requests failed (the report says which levels);
2 bad prompt file, option or inventory; 5 a server or host unreachable.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from ..errors import EXIT_FAILED, DDTreeDeployError, RemoteUnreachable, UsageError
from ..remote import bench as B
from .ui import console, emit_json, ok, warn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RemoteUnreachable(f"the local end of the SSH port forward (127.0.0.1:{port}) did not open") from None
            time.sleep(0.05)


@contextlib.contextmanager
def _reach(target: str, inventory: Path | None):
    """Yield the URL to use for `target`: the URL itself, or a local forward to an inventory host's health URL."""
    if target.startswith(("http://", "https://")):
        yield target.rstrip("/")
        return
    from ..config.inventory import load_inventory
    from ..remote.transport import connect

    inv = load_inventory(inventory)
    host = inv.get(target)
    url = urllib.parse.urlsplit(host.health.url)
    if host.is_local:
        yield host.health.url.rstrip("/")
        return
    if url.scheme != "http":
        raise UsageError(f"{target}: health url {host.health.url} is not plain http; a port forward carries http only")
    t = connect(host, inv)  # RemoteUnreachable (exit 5) when the host cannot be reached
    try:
        conn = getattr(t, "conn", None)
        if conn is None or not hasattr(conn, "forward_local"):
            raise RemoteUnreachable(f"{target}: the SSH transport offers no port forward")
        port = _free_port()
        forward = conn.forward_local(local_port=port, remote_port=url.port or 80,
                                     remote_host=url.hostname or "127.0.0.1", local_host="127.0.0.1")
        forward.__enter__()
        try:
            _wait_listening(port, host.connect_timeout_s)  # Fabric binds the local end in a thread
            yield f"http://127.0.0.1:{port}{url.path.rstrip('/')}"
        finally:
            try:
                forward.__exit__(None, None, None)
            except Exception:  # noqa: BLE001  a tunnel error (remote port closed) already failed the requests
                pass
    finally:
        t.close()


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _table(doc: dict) -> None:
    t = Table(title="bench: " + ", ".join(f"{k}={v}" for k, v in doc["sampling"].items() if k != "ignore_eos"))
    for col in ("server", "algorithm", "conc", "ok/req", "tok/s", "accept", "accept/round", "round ms", "fixed ms", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col in ("server", "algorithm") else "right", overflow="fold")
    for s in doc["servers"]:
        algo = (s.get("server") or {}).get("speculative_algorithm") or "-"
        name = s["label"] + (f" ({s['group']})" if s.get("group") else "")
        for lv in s["levels"]:
            t.add_row(name, str(algo), str(lv["concurrency"]), f"{lv.get('ok_requests', '-')}/{lv.get('requests', '-')}",
                      _fmt(lv.get("output_tokens_per_s"), ".1f"), _fmt(lv.get("accept_length")),
                      _fmt(lv.get("accept_per_round")), _fmt(lv.get("per_round_ms")),
                      _fmt(lv.get("fit_request_ms"), ".1f"), _fmt(lv.get("latency_p50_ms"), ".1f"), _fmt(lv.get("latency_p99_ms"), ".1f"))
    console.print(t)
    console.print("accept = completion_tokens / spec_verify_ct (SGLang's spec_accept_length); accept/round leaves out "
                  "the prefill's token; round ms = request latency / (prefill + verify rounds), i.e. one batched step; "
                  "fixed ms = what a request pays once (prefill, scheduling, HTTP): the intercept of latency against "
                  "verify rounds over the level's requests (- where it does not split: too few requests, rounds "
                  "that do not vary, or a negative intercept).",
                  style="dim")


def bench(
    targets: Annotated[list[str] | None, typer.Argument(help="Server URLs (http://host:port) or inventory host names.")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", help='jsonl: one {"text": ...} or {"input_ids": [...]} a line.')] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Comma-separated concurrency levels.")] = "1,4,16,32",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 128,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="-1 = off")] = -1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos/--stop-at-eos", help="Generate exactly --max-new-tokens.")] = True,
    label: Annotated[list[str] | None, typer.Option("--label", help="A name per TARGET, in order (default: the target).")] = None,
    requests: Annotated[int | None, typer.Option("--requests", min=1, help="Requests per level (default max(8, 2 x concurrency)).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds per request.")] = 600.0,
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="hosts.toml for host-name targets.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG: tokens/s and acceptance vs concurrency.")] = None,
    from_json: Annotated[Path | None, typer.Option("--from-json", help="Re-render a saved --json report (no servers).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Write the JSON report to stdout.")] = False,
) -> None:
    """Benchmark live SGLang servers: output tokens/s, mean acceptance length, per-round ms, latency p50/p99."""
    targets = targets or []
    if from_json is not None:
        if targets or prompts:
            raise UsageError("--from-json re-renders a saved report: give no TARGET or --prompts with it")
        try:
            doc = B.validate_report(json.loads(from_json.read_text()))
        except FileNotFoundError:
            raise UsageError(f"{from_json} does not exist") from None
        except (ValueError, B.BenchInputError) as exc:
            raise UsageError(f"{from_json}: {exc}") from None
    else:
        if not targets:
            raise UsageError("give at least one TARGET (a URL or an inventory host name)")
        if prompts is None:
            raise UsageError("--prompts FILE is required")
        if label and len(label) != len(targets):
            raise UsageError(f"--label given {len(label)} times for {len(targets)} targets")
        try:
            plist = B.load_prompts(prompts)
            levels = B.parse_concurrency(concurrency)
        except B.BenchInputError as exc:
            raise UsageError(str(exc)) from None
        sampling = B.Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              ignore_eos=ignore_eos)
        labels = label or list(targets)
        total = len(targets) * sum(B.requests_for(c, requests) for c in levels)
        results: list[B.ServerResult] = []
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False)
        with progress:
            task = progress.add_task("bench", total=total)
            for tgt, lab in zip(targets, labels):
                progress.update(task, description=f"{lab}: connecting")
                try:
                    with _reach(tgt, inventory) as url:
                        progress.update(task, description=f"{lab}: {url}")
                        res = B.bench_server(tgt, lab, url, plist, levels, requests, sampling, timeout,
                                             on_done=lambda: progress.advance(task))
                except B.ServerUnreachable as exc:
                    raise RemoteUnreachable(f"{lab}: server unreachable ({exc})") from None
                results.append(res)
            progress.update(task, description="done")
        doc = B.report(results, sampling)
    _table(doc)
    failed = [(s["label"], lv["concurrency"], lv.get("errors") or []) for s in doc["servers"] for lv in s["levels"]
              if lv.get("ok_requests") != lv.get("requests")]
    if plot is not None:
        try:
            B.plot(doc, plot)
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        ok(f"plot written to {plot}")
    for lab, c, errs in failed:
        warn(f"{lab} concurrency {c}: failed requests, e.g. {errs[0] if errs else '?'}")
    if json_out:
        emit_json(doc)
    if failed and from_json is None:
        exc = DDTreeDeployError(f"{len(failed)} level(s) had failed requests")
        exc.exit_code = EXIT_FAILED
        raise exc
