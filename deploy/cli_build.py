"""Build-side commands (no remote host): patch, check, series, refresh, snapshot verify/import.

Human output goes to stderr (deploy.ui.console); `--json` writes one document to stdout.
Errors are raised as deploy.errors.* and mapped to exit codes by deploy.cli.main.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from checks.base import FAIL, PASS, SKIP, Context, GateResult
from checks.registry import record_gates, run_gates, select
from deploy import snapshot as snap
from deploy.build import BUILD_ROOT, DDTREE_UTILS, PATCHES_DIR, Inputs, build
from deploy.cli import app
from deploy.errors import GateFailed, SnapshotError, UsageError
from deploy.refresh import refresh as refresh_patch
from deploy.series import (
    check_header,
    load_series,
    parse_header,
    patch_files,
    split_header,
)
from deploy.ui import console, emit_json, ok, warn

snapshot_app = typer.Typer(help="Check or re-import the vendored upstream SGLang files.", no_args_is_help=True)
app.add_typer(snapshot_app, name="snapshot")

SnapshotDir = Annotated[Path, typer.Option("--snapshot-dir", help="Snapshot directory (files + MANIFEST.json).")]
PatchesDir = Annotated[Path, typer.Option("--patches-dir", help="Directory with `series` and the patches.")]
BuildDir = Annotated[
    Path, typer.Option("--build-dir", help="Build root; the tree goes to <build-dir>/sglang-<version>/.")
]
UtilsPath = Annotated[Path, typer.Option("--ddtree-utils", help="The ddtree_utils.py to ship.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Write a JSON report to stdout.")]
Skip = Annotated[list[str] | None, typer.Option("--skip", help="Skip this gate (number or name; repeatable).")]
Pythons = Annotated[
    list[str] | None, typer.Option("--python", help="Also py_compile with this interpreter (repeatable).")
]

DEFAULT_SNAPSHOT = snap.snapshot_dir_for(snap.PINNED_VERSION)
STATUS_STYLE = {PASS: "[green]pass[/]", FAIL: "[bold red]FAIL[/]", SKIP: "[yellow]skipped[/]"}


def _progress(transient: bool = True) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
    )


def _build_json(result) -> dict:
    info = result.info
    return {
        "build_dir": str(info.root),
        "build_id": info.build_id,
        "sglang_version": info.sglang_version,
        "patches": info.patches,
        "files": len(info.files),
        "series_sha256": info.series_sha256,
        "warnings": result.warnings,
    }


def _run_gates_with_progress(ctx: Context, gates) -> list[GateResult]:
    with _progress() as progress:
        task = progress.add_task("quality gates", total=len(gates))
        started = []

        def on_start(gate) -> None:
            if started:
                progress.advance(task)
            started.append(gate)
            progress.update(task, description=f"gate {gate.NUMBER} {gate.NAME}")

        def step(msg: str) -> None:
            progress.update(task, description=f"gate {started[-1].NUMBER} {started[-1].NAME}: {msg}")

        results = run_gates(ctx, gates, on_start=on_start, step=step)
        progress.advance(task)
    return results


def _show_gates(results: list[GateResult]) -> None:
    table = Table(title="Quality gates", title_justify="left")
    for col, kw in (
        ("#", {"justify": "right"}),
        ("gate", {}),
        ("files", {"justify": "right"}),
        ("result", {}),
        ("seconds", {"justify": "right"}),
        ("notes", {"overflow": "fold"}),
    ):
        table.add_column(col, **kw)
    for r in results:
        table.add_row(
            str(r.number), Text(r.name), str(r.files), STATUS_STYLE[r.status], f"{r.seconds:.1f}", Text(r.summary)
        )
    console.print(table)
    for r in results:
        if r.status == FAIL and r.details:
            console.print(f"[bold red]gate {r.number} {escape(r.name)}:[/]")
            for line in r.details:
                console.print(f"  {line}", markup=False, highlight=False)


def _gates_outcome(results: list[GateResult]) -> None:
    failed = [r for r in results if r.status == FAIL]
    if failed:
        names = ", ".join(f"{r.number} ({r.name})" for r in failed)
        raise GateFailed(f"quality gate(s) failed: {names}")


@app.command()
def patch(
    snapshot_dir: SnapshotDir = DEFAULT_SNAPSHOT,
    patches_dir: PatchesDir = PATCHES_DIR,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    no_check: Annotated[bool, typer.Option("--no-check", help="Build only; skip the quality gates.")] = False,
    skip: Skip = None,
    python: Pythons = None,
    json_out: JsonOut = False,
) -> None:
    """Build build/sglang-<version>/ from the snapshot, the series and ddtree_utils.py, then run the gates."""
    inputs = Inputs(snapshot_dir, patches_dir, build_dir, ddtree_utils)
    gates = [] if no_check else select(None, skip)
    with _progress() as progress:
        task = progress.add_task("applying patches", total=None)
        result = build(inputs, on_patch=lambda e: progress.update(task, description=f"applying {e.name}"))
    for w in result.warnings:
        warn(escape(w))
    info = result.info
    counts = f"{len(info.files)} files, {len(info.patches)} patch(es)"
    ok(f"built {escape(str(info.root))} (build {info.build_id}: {counts})")
    results: list[GateResult] = []
    if gates:
        results = _run_gates_with_progress(Context(inputs=inputs, extra_pythons=python or []), gates)
        record_gates(info.root, results)
        _show_gates(results)
    if json_out:
        emit_json(
            {
                "build": _build_json(result),
                "gates": [r.to_json() for r in results],
                "ok": all(r.status != FAIL for r in results),
            }
        )
    _gates_outcome(results)


@app.command()
def check(
    snapshot_dir: SnapshotDir = DEFAULT_SNAPSHOT,
    patches_dir: PatchesDir = PATCHES_DIR,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    gate: Annotated[
        list[str] | None, typer.Option("--gate", "-g", help="Run only this gate (number or name; repeatable).")
    ] = None,
    skip: Skip = None,
    python: Pythons = None,
    json_out: JsonOut = False,
) -> None:
    """Run the quality gates on the current build (non-zero exit when any gate fails)."""
    ctx = Context(inputs=Inputs(snapshot_dir, patches_dir, build_dir, ddtree_utils), extra_pythons=python or [])
    results = _run_gates_with_progress(ctx, select(gate, skip))
    record_gates(ctx.build_dir, results)
    _show_gates(results)
    if json_out:
        emit_json(
            {
                "build_dir": str(ctx.build_dir),
                "gates": [r.to_json() for r in results],
                "ok": all(r.status != FAIL for r in results),
            }
        )
    _gates_outcome(results)


@app.command("series")
def series_cmd(patches_dir: PatchesDir = PATCHES_DIR, json_out: JsonOut = False) -> None:
    """List the patches in order, with the files each touches and +/- line counts."""
    s = load_series(patches_dir)
    rows = []
    for e in s.entries:
        check_header(e.path)
        desc = parse_header(split_header(e.path.read_text())[0]).get("Description", "").splitlines()[0]
        changes = patch_files(e.path)
        rows.append(
            {
                "patch": e.name,
                "description": desc,
                "files": [{"path": c.path, "added": c.added, "removed": c.removed, "new": c.new} for c in changes],
            }
        )
    if json_out:
        emit_json({"series": str(s.series_path), "patches": rows})
        return
    table = Table(title=Text(f"{s.series_path} ({len(rows)} patches)"), title_justify="left")
    for col in ("patch", "description", "file", "+", "-"):
        table.add_column(col, justify="right" if col in "+-" else "left", overflow="fold")
    for row in rows:
        for i, f in enumerate(row["files"]):
            table.add_row(
                Text(row["patch"] if i == 0 else ""),
                Text(row["description"] if i == 0 else ""),
                Text(f["path"] + (" (new)" if f["new"] else "")),
                f"[green]+{f['added']}[/]",
                f"[red]-{f['removed']}[/]",
            )
    console.print(table)


@app.command("refresh")
def refresh_cmd(
    patch_name: Annotated[str, typer.Argument(metavar="PATCH", help="Patch name (or its NNNN number) in the series.")],
    add_file: Annotated[
        list[str] | None, typer.Option("--add-file", help="Also put this build file into the patch (repeatable).")
    ] = None,
    snapshot_dir: SnapshotDir = DEFAULT_SNAPSHOT,
    patches_dir: PatchesDir = PATCHES_DIR,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    json_out: JsonOut = False,
) -> None:
    """Regenerate one patch from the edited build tree (quilt refresh); then rebuild with `patch`."""
    inputs = Inputs(snapshot_dir, patches_dir, build_dir, ddtree_utils)
    with console.status(f"refreshing {patch_name}"):
        r = refresh_patch(inputs, patch_name, add_files=add_file or [])
    if r.changed:
        ok(f"refreshed {escape(str(r.patch))} ({len(r.files)} file(s))")
    else:
        ok(f"{escape(r.patch.name)}: already up to date")
    if r.broken:
        warn(f"a later patch no longer applies exactly: {escape(r.broken)}")
    for rel in r.uncaptured:
        warn(
            f"{rel}: your build differs from what the series now produces "
            "(an edit in another patch's file? use --add-file or refresh that patch)"
        )
    if json_out:
        emit_json(
            {
                "patch": str(r.patch),
                "changed": r.changed,
                "files": r.files,
                "broken": r.broken,
                "uncaptured": r.uncaptured,
            }
        )
    if r.broken:
        raise UsageError(f"after refreshing {r.patch.name}: {r.broken}")


@snapshot_app.command("verify")
def snapshot_verify(snapshot_dir: SnapshotDir = DEFAULT_SNAPSHOT, json_out: JsonOut = False) -> None:
    """Check every snapshot file against MANIFEST.json (exit 4 on any difference)."""
    manifest = snap.load_manifest(snapshot_dir)
    problems = snap.find_problems(snapshot_dir, manifest)
    if json_out:
        emit_json(
            {
                "snapshot_dir": str(snapshot_dir),
                "sglang_version": manifest.sglang_version,
                "files": len(manifest.files),
                "problems": [{"path": p.relpath, "kind": p.kind} for p in problems],
            }
        )
    if problems:
        for p in problems[1:]:
            console.print(f"  {p.describe(snapshot_dir)}", markup=False)
        snap.verify(snapshot_dir)  # raises SnapshotError naming the first problem
    ok(f"{escape(str(snapshot_dir))}: {len(manifest.files)} files match sglang {manifest.sglang_version}")


@snapshot_app.command("import")
def snapshot_import(
    version: Annotated[str, typer.Option("--version", help="SGLang version to import.")] = snap.PINNED_VERSION,
    file: Annotated[
        list[str] | None,
        typer.Option(
            "--file", help="Package-relative file, e.g. srt/server_args.py (repeatable; default: the manifest's files)."
        ),
    ] = None,
    from_site_packages: Annotated[
        Path | None,
        typer.Option(
            "--from-site-packages", help="Read from an installed SGLang (site-packages dir) instead of the registry."
        ),
    ] = None,
    wheel: Annotated[
        Path | None, typer.Option("--wheel", help="Read from this local wheel file instead of downloading.")
    ] = None,
    snapshot_root: Annotated[
        Path, typer.Option("--snapshot-root", help="Where snapshot dirs live.")
    ] = snap.SNAPSHOT_ROOT,
    snapshot_dir: Annotated[
        Path | None, typer.Option("--snapshot-dir", help="Exact target dir (default <snapshot-root>/sglang-<version>).")
    ] = None,
    drift_check: Annotated[
        bool,
        typer.Option("--check", help="Only compare the source with the snapshot (exit 4 on drift); write nothing."),
    ] = False,
    json_out: JsonOut = False,
) -> None:
    """(Re-)derive snapshot files from the registry wheel or an installed SGLang, updating MANIFEST.json."""
    if from_site_packages and wheel:
        raise UsageError("give --from-site-packages or --wheel, not both")
    if from_site_packages:
        source = snap.site_packages_source(from_site_packages)
    else:
        with console.status(f"fetching sglang=={version} (pip download --no-deps)"):
            source = snap.wheel_source(wheel or snap.download_wheel(version))
    if source.version != version:
        raise UsageError(f"{source.label} is sglang {source.version}, not {version}: pass --version {source.version}")
    target = snapshot_dir or snap.snapshot_dir_for(version, snapshot_root)
    if drift_check:
        drifted = snap.compare_with_source(source, target)
        if json_out:
            emit_json({"source": source.label, "snapshot_dir": str(target), "drifted": drifted})
        if drifted:
            raise SnapshotError(f"{source.label}: {len(drifted)} file(s) differ from {target}: {', '.join(drifted)}")
        ok(escape(f"{source.label} matches {target}"))
        return
    files = file or None
    if not files and not (target / snap.MANIFEST).is_file() and (DEFAULT_SNAPSHOT / snap.MANIFEST).is_file():
        files = sorted(snap.load_manifest(DEFAULT_SNAPSHOT).files)  # a new pin: the files the series touches now
    r = snap.import_files(source, target, files)
    if json_out:
        emit_json(
            {
                "source": source.label,
                "snapshot_dir": str(target),
                "sglang_version": r.version,
                "added": r.added,
                "updated": r.updated,
                "unchanged": r.unchanged,
            }
        )
    for label, items in (("added", r.added), ("updated", r.updated), ("unchanged", r.unchanged)):
        if items:
            console.print(f"{label}: {', '.join(items)}", markup=False)
    ok(escape(f"{target}: manifest updated from {source.label}"))
