"""Remote commands: plan, push, status, rollback (SSH through Fabric, or `local`).

Human output goes to stderr (deploy.cli.ui.console), `--json` to stdout. Exit codes: 0 ok, 1 deploy
failed (nothing changed, or rolled back), 2 bad inventory/usage, 5 unreachable/host key, 6 refused
(version, drift, lock, disk), 7 automatic rollback failed, 8 transition left unfinished on the host
(the next command finishes it), 130/143 stopped by SIGINT/SIGTERM (host put back). With several
hosts the worst code wins (7 > 8 > 1 > 6 > 5 > 2); a signal's 130/143 replaces 0, 1, 5, 6.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from ..build.buildinfo import MANIFEST_NAME, BuildInfo, gates_verdict, load_build
from ..build.pins import BuildChoice
from ..config.inventory import Host, Inventory, load_inventory
from ..config.launch import restart_pending
from ..errors import (
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    ConfigError,
    DDTreeDeployError,
    RemoteRefused,
    RemoteUnreachable,
    UsageError,
    without_host,
)
from ..remote import envfile, health, restart
from ..remote import lock as host_lock
from ..remote.facts import (
    CURRENT,
    DEPLOYED,
    DRIFTED,
    MISSING,
    PRISTINE,
    choose_build,
    read_facts,
    unexplained,
)
from ..remote.plan import add_diffs, make_plan
from ..remote.releases import STOP, Events, Outcome, recover_host, run_host
from ..remote.transport import connect
from .ui import console, emit_json, ok, warn

# No --build: each host gets the build of the pin matching its SGLang (deploy.build.pins), from here.
BUILD_ROOT = Path(os.environ.get("DDTREE_DEPLOY_BUILD_ROOT") or Path(__file__).resolve().parents[2] / "build")

InventoryOpt = Annotated[Path | None, typer.Option("--inventory", "-i", help="hosts.toml (default: $DDTREE_DEPLOY_HOSTS or ./hosts.toml).")]
BuildOpt = Annotated[Path | None, typer.Option("--build", help="The build directory (with BUILD-MANIFEST.json) for every host; default $DDTREE_DEPLOY_BUILD, else build/sglang-<V> of each host's SGLang version V.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write a JSON report to stdout.")]
BreakLock = Annotated[bool, typer.Option("--break-lock", help="Remove a lock left by a dead run (check the host first).")]
SEVERITY = [7, 8, 1, 6, 5, 2]
STATUS_STYLE = {CURRENT: "[green]current[/]", PRISTINE: "[cyan]pristine[/]", DEPLOYED: "[blue]deployed[/]",
                DRIFTED: "[bold red]drifted[/]", MISSING: "[bold red]missing[/]"}


def _fail(exc: DDTreeDeployError) -> DDTreeDeployError:
    """Re-raise as is: deploy.cli.main prints it and exits with its code."""
    return exc


def _exit(code: int, message: str) -> DDTreeDeployError:
    """A failure whose exit code is that of the worst host (the per-host table is already printed)."""
    exc = DDTreeDeployError(message)
    exc.exit_code = code
    return exc


def _load_build(path: Path, *, require_gates: bool) -> BuildInfo:
    """The build, verified against its manifest; `push` also requires its quality gates to have
    passed (GATES.json for this build id). DDTREE_DEPLOY_ALLOW_UNGATED=1 lifts that requirement
    (test beds; an emergency): the pre-swap checks on the host still run."""
    build = load_build(path)
    passed, why = gates_verdict(build)
    if not passed:
        if require_gates and os.environ.get("DDTREE_DEPLOY_ALLOW_UNGATED") != "1":
            raise ConfigError(why)
        warn(why)
    return build


def _build_arg(build: Path | None, load) -> BuildInfo | BuildChoice:
    """--build (or $DDTREE_DEPLOY_BUILD): that build for every host; else the pin of each host."""
    path = build or os.environ.get("DDTREE_DEPLOY_BUILD")
    return load(Path(path)) if path else BuildChoice(load, BUILD_ROOT)


def _hosts(inv: Inventory, names: list[str]) -> list[Host]:
    if len(set(names)) != len(names):
        raise ConfigError("a host is named twice")
    return [inv.get(n) for n in names]


def worst(codes: list[int]) -> int:
    bad = [c for c in codes if c != EXIT_OK]
    if not bad:
        return EXIT_OK
    return min(bad, key=lambda c: SEVERITY.index(c) if c in SEVERITY else len(SEVERITY))


class RichEvents(Events):
    """One progress line per host: the current step, upload bytes, the health wait."""

    def __init__(self, progress: Progress, hosts: list[str]):
        self.p = progress
        self.lock = threading.Lock()
        self.tasks = {h: progress.add_task(f"{h}: waiting", total=None) for h in hosts}
        self.sent = dict.fromkeys(hosts, 0)

    def step(self, host: str, message: str) -> None:
        self.p.update(self.tasks[host], description=f"{host}: {message}")
        if not console.is_terminal:  # no live display: keep a log of the steps instead
            console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {escape(host)}: {escape(message)}")

    def upload(self, host: str, nbytes: int, total: int) -> None:
        with self.lock:
            self.sent[host] += nbytes
            self.p.update(self.tasks[host], total=total, completed=self.sent[host],
                          description=f"{host}: uploading {self.sent[host] / 1e3:.0f}/{total / 1e3:.0f} kB")

    def warn(self, host: str, message: str) -> None:
        warn(message)

    def waiting(self, host: str, elapsed: float, deadline: float) -> None:
        self.p.update(self.tasks[host], description=f"{host}: health gate {elapsed:.0f}/{deadline:.0f}s",
                      total=deadline, completed=min(elapsed, deadline))


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


class Signals:
    """SIGINT/SIGTERM during push/rollback: the first asks every host to stop at its next safe point
    (rolling back if its files were swapped); later ones are reported and ignored, so a rollback in
    progress is never cut short (a SIGKILL is covered by the host's journal). `code` is 130/143."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.saved: dict = {}

    def __enter__(self) -> "Signals":
        STOP.clear()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.code is None:
            self.code = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM
            STOP.set()
            warn(f"{signal.Signals(signum).name}: stopping at the next safe point (files already swapped are rolled back)")
        else:
            warn(f"{signal.Signals(signum).name} again: still stopping; a rollback in progress is not interrupted")

    def __exit__(self, *exc) -> None:
        for sig, h in self.saved.items():
            signal.signal(sig, h)

    def exit_code(self, code: int) -> int:
        return self.code if self.code is not None and code not in (7, 8) else code

    def mark(self, outs: list[Outcome]) -> None:
        """After a signal, each row shows the code the process exits with for it (130/143 unless 7 or 8)."""
        for o in outs:
            if not o.ok:
                o.code = self.exit_code(o.code)


def _run_many(hosts: list[Host], inv: Inventory, action: str, serial: int | None, max_failures: int | None = None,
              **kw) -> tuple[list[Outcome], list[str]]:
    """Run `action` on the hosts, `serial` at a time (default: all at once). A rollout in batches stops
    once more than `max_failures` hosts failed (or on a signal): the outcomes, and the hosts not touched."""
    results: dict[str, Outcome] = {}
    size = serial or len(hosts)
    untouched: list[str] = []
    with _progress() as progress:
        ev = RichEvents(progress, [h.name for h in hosts])
        for i in range(0, len(hosts), size):
            failed = sum(not o.ok for o in results.values())
            if i and ((max_failures is not None and failed > max_failures) or STOP.is_set()):
                untouched = [h.name for h in hosts[i:]]
                for name in untouched:
                    progress.update(ev.tasks[name], description=f"{name}: not touched (rollout stopped)")
                break
            batch = hosts[i:i + size]
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                futs = {h.name: pool.submit(run_host, h, inv, action, ev, **kw) for h in batch}
                for name, fut in futs.items():
                    results[name] = fut.result()
                    progress.update(ev.tasks[name], description=f"{name}: {'done' if results[name].ok else 'FAILED'}")
    return [results[h.name] for h in hosts if h.name in results], untouched


def _table(title: str, outs: list[Outcome], untouched: list[str] = ()) -> None:
    """changed: the host's files differ from before the run; restarted: how many restarts the run
    caused; rolled back: an automatic rollback (or the recovery of an earlier run) ran."""
    t = Table(title=title)
    for col in ("host", "result", "exit", "release", "changed", "restarted", "rolled back", "message"):
        t.add_column(col, overflow="fold")
    for o in outs:
        n = o.extra.get("restarts", 1 if o.restarted else 0)
        t.add_row(o.host, "[green]ok[/]" if o.ok else "[bold red]FAILED[/]", str(o.code), o.release or "-",
                  "yes" if o.changed else "no", f"yes ({n}x)" if n else "no",
                  "yes" if o.extra.get("rolled_back") else "no", without_host(o.message, o.host))
    for name in untouched:
        t.add_row(name, "[yellow]not touched[/]", "-", "-", "no", "no", "no", "the rollout stopped before this host")
    console.print(t)
    for o in outs:
        if o.detail:
            console.rule(f"{o.host}: log tail")
            console.print(o.detail, markup=False, highlight=False)


def push(
    hosts: Annotated[list[str], typer.Argument(help="Inventory host names (`local` = this machine).")],
    inventory: InventoryOpt = None,
    build: BuildOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite drifted files (they are backed up).")] = False,
    serial: Annotated[int | None, typer.Option("--serial", min=1, help="Deploy N hosts at a time (default: all at once); the rollout stops at the first failed host.")] = None,
    max_failures: Annotated[int | None, typer.Option("--max-failures", min=0, help="With --serial: go on until more than K hosts failed (default 0).")] = None,
    break_lock: BreakLock = False,
    json_out: JsonOpt = False,
) -> None:
    """Deploy the build: preflight, upload, verify, atomic swap, restart, health gate, auto-rollback.
    With --serial N, hosts go N at a time and the rollout stops after the first batch with a failure
    (--max-failures K: once more than K hosts failed); the hosts it did not reach are listed."""
    try:
        inv = load_inventory(inventory)
        targets = _hosts(inv, hosts)
        b = _build_arg(build, lambda p: _load_build(p, require_gates=True))
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    what = (f"build [bold]{b.build_id}[/] (sglang {b.sglang_version}, {len(b.patches)} patches, {len(b.files)} files)"
            if isinstance(b, BuildInfo) else escape(b.describe()))
    console.print(f"push {what} to {', '.join(hosts)}")
    if max_failures is not None and serial is None:
        raise UsageError("--max-failures needs --serial N (without it every host is deployed at once)")
    with Signals() as sigs:
        outs, untouched = _run_many(targets, inv, "push", serial, (max_failures or 0) if serial else None,
                                    build=b, force=force, break_lock=break_lock)
    sigs.mark(outs)
    _table("push", outs, untouched)
    code = sigs.exit_code(worst([o.code for o in outs]))
    if json_out:
        emit_json({"action": "push", "build_id": getattr(b, "build_id", None), "ok": code == EXIT_OK, "exit_code": code,
                   "results": [o.to_json() for o in outs], "untouched": untouched})
    if code:
        failed = [o.host for o in outs if not o.ok]
        raise _exit(code, f"push failed on {', '.join(failed)} (exit {code})"
                    + (f"; not touched: {', '.join(untouched)}" if untouched else "") + "; see the table above")


def rollback(
    host: Annotated[str, typer.Argument(help="Inventory host name.")],
    to: Annotated[str | None, typer.Option("--to", help="A release id, or `pristine` (default: the state before the current release).")] = None,
    inventory: InventoryOpt = None,
    break_lock: BreakLock = False,
    json_out: JsonOpt = False,
) -> None:
    """Restore the previous (or a named, or the pristine) state, restart, health-check."""
    try:
        inv = load_inventory(inventory)
        h = inv.get(host)
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    with Signals() as sigs:
        outs, _ = _run_many([h], inv, "rollback", None, to=to, break_lock=break_lock)
    sigs.mark(outs)
    _table("rollback", outs)
    code = sigs.exit_code(outs[0].code)
    if json_out:
        emit_json({"action": "rollback", "ok": code == EXIT_OK, "exit_code": code, "results": [o.to_json() for o in outs]})
    if code:
        raise _exit(code, f"rollback of {host} failed (exit {code}): {without_host(outs[0].message, host)}")


def restart_cmd(
    host: Annotated[str, typer.Argument(help="Inventory host name.")],
    inventory: InventoryOpt = None,
    break_lock: BreakLock = False,
    json_out: JsonOpt = False,
) -> None:
    """Restart the service with the files as they are, then the health gate (journaled on the host).
    For a stopped or failed service: after an exit 7, or a crash. Exit 1 when it is not healthy."""
    try:
        inv = load_inventory(inventory)
        h = inv.get(host)
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    with Signals() as sigs:
        outs, _ = _run_many([h], inv, "restart", None, break_lock=break_lock)
    sigs.mark(outs)
    _table("restart", outs)
    code = sigs.exit_code(outs[0].code)
    if json_out:
        emit_json({"action": "restart", "ok": code == EXIT_OK, "exit_code": code, "results": [o.to_json() for o in outs]})
    if code:
        raise _exit(code, f"restart of {host} failed (exit {code}): {without_host(outs[0].message, host)}")


def plan(
    host: Annotated[str, typer.Argument(help="Inventory host name.")],
    inventory: InventoryOpt = None,
    build: BuildOpt = None,
    diff: Annotated[bool, typer.Option("--diff", help="Show unified diffs remote -> build.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Plan as `push --force` would.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Dry run: read the host and show what `push` would do. Changes nothing (but finishes a transition
    an earlier run left unfinished: roll back and restart, as every command does first)."""
    t = None
    try:
        inv = load_inventory(inventory)
        h = inv.get(host)
        b = _build_arg(build, lambda p: _load_build(p, require_gates=False))
        t = connect(h, inv)
        facts = read_facts(t, b)  # one read: the files of the host's pin's build (BuildChoice) or of --build
        notes = _recover(t, facts)
        if notes:  # an earlier run's transition was finished: the host changed
            facts = read_facts(t, b)
        b = choose_build(b, facts, h.name)  # the build of the host's pin (exit 6 when its SGLang has none)
        p = make_plan(t, b, facts, force=force)
        if diff:
            add_diffs(t, b, p)
        pending = _plan_pending(t, p)
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    finally:
        if t is not None:
            t.close()
    console.print(f"[bold]{h.name}[/]: sglang {facts.version} at {facts.sglang_dir} (python {h.python}); "
                  f"state: {(facts.current or {}).get('state', 'unmanaged')}")
    tab = Table(title=f"{h.name}: files vs build {b.build_id}")
    for col in ("file", "status", "remote sha256", "build sha256"):
        tab.add_column(col)
    for f in facts.files:
        st = STATUS_STYLE[f.status] + (f" ({f.release})" if f.release else "")
        tab.add_row(f.relpath, st, (f.remote_sha256 or "absent")[:12], f.build_sha256[:12])
    if p.env is not None:  # [launch]: the env file, one more file of the release
        st = "[bold red]drifted[/]" if p.env.drifted else ("[green]current[/]" if p.env.unchanged else "[yellow]changes[/]")
        tab.add_row(p.env.path, st, (p.env.before_sha256 or "absent")[:12], (p.env.after_sha256 or "absent")[:12])
    console.print(tab)
    for rel, d in p.diffs.items():
        console.rule(rel)
        console.print(d or "(no textual difference)", markup=False, highlight=False)
    console.print("[bold]push would:[/]")
    for i, s in enumerate(p.steps, 1):
        console.print(f"  {i:2}. {s}", markup=False)
    for r in p.refusals:
        warn(f"push would be refused: {r.message}")
    if pending:
        warn(f"{h.name}: restart pending: the service does not run with the flags of {p.env.path} "
             f"({'; '.join(pending)}); `ddtree-deploy restart {h.name}` applies them"
             + (", a push changes nothing" if p.noop else ""))
    if json_out:
        emit_json(dict(p.to_json(), recovered=notes, restart_pending=pending))


def _plan_pending(t, p) -> list[str] | None:
    """[launch]: the env file's flags now vs the running service's (None: no [launch], or no answer)."""
    if p.env is None:
        return None
    try:
        info = health.server_info(t)
    except DDTreeDeployError:
        return None
    return restart_pending(p.env.before_args, info) if info else None


def _recover(t, facts) -> list[str]:
    """Finish what an earlier run left unfinished on the host (journal recovery), and say so."""
    notes = recover_host(t, facts=facts)
    for n in notes:
        warn(f"{t.label}: {without_host(n, t.label)}")
    return notes


def status(
    host: Annotated[str, typer.Argument(help="Inventory host name.")],
    inventory: InventoryOpt = None,
    build: BuildOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Current release, drift, service state, health, speculative algorithm and acceptance metrics."""
    t = None
    out: dict = {"host": host}
    try:
        inv = load_inventory(inventory)
        h = inv.get(host)
        path = build or os.environ.get("DDTREE_DEPLOY_BUILD")
        b = (load_build(path) if (Path(path) / MANIFEST_NAME).is_file() else None) if path else BuildChoice(load_build, BUILD_ROOT)
        t = connect(h, inv)
        facts = read_facts(t, b, current_files=True)  # the one read of the host's state
        out["recovered"] = _recover(t, facts)
        if out["recovered"]:  # an earlier run's transition was finished: the host changed
            facts = read_facts(t, b, current_files=True)
        b = choose_build(b, facts, h.name, missing_ok=True)  # no pin or no build for the host's SGLang: host state only
        out["unfinished"] = facts.unfinished
        rec_files = (facts.current or {}).get("files") or {}
        got = facts.current_files or {}
        out["verify"] = {rel: ("ok" if got.get(rel) == sha else ("missing" if got.get(rel) is None and sha else "changed"))
                         for rel, sha in sorted(rec_files.items())}
        out["lock_holder"] = (dict(facts.lock, alive=host_lock.holder_status(facts.lock)) if facts.lock else None)
        out.update(sglang_version=facts.version, sglang_dir=facts.sglang_dir, current=facts.current, lock=facts.lock)
        if b is not None:
            out.update(files={f.relpath: f.status for f in facts.files}, build_id=b.build_id)
        out["hand_edited"] = unexplained(facts)  # bytes neither a push nor upstream had, whoever put them back
        out["launch"] = envfile.live(t, facts)  # [launch]: the flags the service starts with
        out["service"] = restart.service_state(t)
        # /health first, then /get_server_info: a service that is still starting must not read as
        # healthy without its algorithm (it came up between the two requests)
        up = health.http(t, "/health").get("status") == 200 if out["service"] == "running" else False
        try:
            info = health.server_info(t) if up else None
        except DDTreeDeployError:
            info = None
        out["healthy"] = up
        if info:
            algo, metrics = health.algorithm_and_metrics(info)
            out.update(speculative_algorithm=algo, metrics=metrics, server_version=info.get("version"))
        if out["launch"] is not None:  # the flags in the file vs what the running service reports
            out["launch"]["restart_pending"] = restart_pending(out["launch"]["args"], info) if info else None
    except RemoteUnreachable as exc:
        raise _fail(exc) from None
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    finally:
        if t is not None:
            t.close()
    tab = Table(title=f"{host} status", show_header=False)
    tab.add_column("key")
    tab.add_column("value", overflow="fold")
    cur = out.get("current") or {}
    tab.add_row("state", str(cur.get("state", "unmanaged")) + (f" (since {cur.get('time')})" if cur else ""))
    tab.add_row("sglang", f"{out['sglang_version']} at {out['sglang_dir']}")
    drift = sorted(set(out["hand_edited"]) | {f for f, s in (out.get("files") or {}).items() if s in (DRIFTED, MISSING)})
    out["drift"] = drift
    if "files" in out:
        tab.add_row("files", ", ".join(f"{s}: {sum(1 for v in out['files'].values() if v == s)}"
                                       for s in sorted(set(out["files"].values()))) + f" (build {out['build_id']})")
    else:
        tab.add_row("files", "no local build to compare with (drift from the release records only)")
    tab.add_row("drift", f"[bold red]{escape(', '.join(drift))}[/] (changed outside this tool)" if drift else "none")
    bad = [f"{rel} ({v})" for rel, v in out["verify"].items() if v != "ok"]
    tab.add_row("verified", (f"[bold red]DRIFT from the release record: {', '.join(bad)}[/]" if bad else
                             f"{len(out['verify'])} files match the release record") if out["verify"] else "no release record")
    for u in out["unfinished"]:
        tab.add_row("UNFINISHED", f"{u['release']} ({u.get('action')}) stopped at {u['last'].get('step')}")
    if out.get("lock"):
        lh = out["lock_holder"] or {}
        tab.add_row("lock", f"held by {out['lock'].get('owner')} pid {out['lock'].get('pid')} "
                            f"({lh.get('action', '?')} {lh.get('release') or ''}; holder {lh.get('alive')})")
    tab.add_row("service", out["service"])
    tab.add_row("health", "healthy" if out["healthy"] else "not healthy")
    tab.add_row("speculative algorithm", str(out.get("speculative_algorithm", "-")))
    if out.get("launch"):
        lf = out["launch"]
        tab.add_row("launch flags", f"{lf['env_file']} {lf['variable']}={escape(lf['args'] or '(unset)')} "
                    f"(expects {lf['expect_algorithm']})")
        if lf.get("restart_pending"):
            tab.add_row("restart pending", f"[bold red]{escape('; '.join(lf['restart_pending']))}[/] "
                        f"(`ddtree-deploy restart {escape(host)}` starts the service with the file's flags)")
    for k, v in (out.get("metrics") or {}).items():
        tab.add_row(k, str(v))
    console.print(tab)
    if json_out:
        emit_json(out)
    if not out["healthy"]:
        raise _exit(1, f"{host}: the service is {out['service']} and not healthy")
    if bad or out["unfinished"] or drift:
        raise _exit(1, f"{host}: healthy, but " + (f"its files differ from the release record ({', '.join(bad)})" if bad
                                                   else "a transition is unfinished" if out["unfinished"]
                                                   else f"files were changed outside this tool ({', '.join(drift)})"))
    ok(f"{host} is healthy")


def unlock(
    host: Annotated[str, typer.Argument(help="Inventory host name.")],
    inventory: InventoryOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Remove the lock even if its holder cannot be checked or is alive.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Remove the host's deploy lock. Refused (exit 6) while the holder process is alive on this
    machine, or runs on another machine (cannot be checked from here), unless --force."""
    t = None
    try:
        inv = load_inventory(inventory)
        h = inv.get(host)
        t = connect(h, inv)
        raw = read_facts(t)
        holder = raw.lock
        if not holder:
            result = {"host": host, "released": False, "holder": None, "message": "no lock held"}
        else:
            st = host_lock.holder_status(holder)
            if st != host_lock.DEAD and not force:
                why = "is alive on this machine" if st == host_lock.ALIVE else "runs on another machine and cannot be checked from here"
                raise RemoteRefused(f"{host}: the lock holder {host_lock.describe(holder)} {why}; refusing (--force to remove it anyway)")
            host_lock.break_lock(t)
            result = {"host": host, "released": True, "holder": holder, "holder_status": st,
                      "message": f"removed the lock of {host_lock.describe(holder)} (holder {st})"}
        result["unfinished"] = [u["release"] for u in raw.unfinished]
    except DDTreeDeployError as exc:
        raise _fail(exc) from None
    finally:
        if t is not None:
            t.close()
    ok(f"{host}: {result['message']}")
    if result["unfinished"]:
        warn(f"{host}: unfinished transition(s) {', '.join(result['unfinished'])}: the next push/status/rollback/plan finishes them")
    if json_out:
        emit_json(result)
