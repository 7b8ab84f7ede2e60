"""Build-side commands (no remote host): patch, check, series, refresh, snapshot verify/import.

Every command works per pin (deploy/build/pins.py): `--pin V`, default every pin (`refresh`: the pin
whose series holds the patch). `--snapshot-dir` / `--patches-dir` name one pin's inputs directly.

Human output goes to stderr (deploy.cli.ui.console); `--json` writes one document to stdout.
Errors are raised as deploy.errors.* and mapped to exit codes by deploy.cli.main.
"""

from __future__ import annotations

from dataclasses import replace
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

from ...checks import gate_unit
from ...checks.base import FAIL, PASS, SKIP, Context, GateResult
from ...checks.registry import record_gates, run_gates, select
from ..build import pins as pins_mod
from ..build import snapshot as snap
from ..build.build import BUILD_ROOT, DDTREE_UTILS, PATCHES_ROOT, build
from ..build.pins import Pin
from ..build.refresh import refresh as refresh_patch
from ..build.series import (
    check_header,
    load_series,
    parse_header,
    patch_files,
    split_header,
)
from ..errors import DDTreeDeployError, GateFailed, SnapshotError, UsageError
from .ui import console, emit_json, error, ok, warn

PinOpt = Annotated[
    str | None, typer.Option("--pin", help="Only this pin (an SGLang version with snapshot/sglang-<V>/); default: every pin.")
]
SnapshotDir = Annotated[
    Path | None, typer.Option("--snapshot-dir", help="One pin's snapshot directory (files + MANIFEST.json), instead of the pins.")
]
PatchesDir = Annotated[
    Path | None, typer.Option("--patches-dir", help="The directory with `series` and the patches (default: <patches-root>/<version>).")
]
SnapshotRoot = Annotated[Path, typer.Option("--snapshot-root", help="Where the pins' snapshot/sglang-<V>/ dirs live.")]
PatchesRoot = Annotated[Path, typer.Option("--patches-root", help="Where the pins' series dirs <V>/ live.")]
BuildDir = Annotated[
    Path, typer.Option("--build-dir", help="Build root; the tree goes to <build-dir>/sglang-<version>/.")
]
UtilsPath = Annotated[Path, typer.Option("--ddtree-utils", help="The ddtree_utils.py to ship (the sibling modules the build imports come from its folder).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Write a JSON report to stdout.")]
Skip = Annotated[list[str] | None, typer.Option("--skip", help="Skip this gate (number or name; repeatable).")]
Fresh = Annotated[bool, typer.Option("--fresh", help="Run every gate, even one whose inputs are unchanged since its last pass.")]
Pythons = Annotated[
    list[str] | None, typer.Option("--python", help="Also py_compile with this interpreter (repeatable).")
]

DEFAULT_SNAPSHOT = snap.snapshot_dir_for(snap.PINNED_VERSION)  # `snapshot import`: a new pin copies its file list
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


def _run_gates_with_progress(ctx: Context, gates, label: str = "", reuse: bool = True) -> list[GateResult]:
    lead = f"{label}: " if label else ""
    with _progress() as progress:
        task = progress.add_task(f"{lead}quality gates", total=len(gates))
        started = []

        def on_start(gate) -> None:
            if started:
                progress.advance(task)
            started.append(gate)
            progress.update(task, description=f"{lead}gate {gate.NUMBER} {gate.NAME}")

        def step(msg: str) -> None:
            progress.update(task, description=f"{lead}gate {started[-1].NUMBER} {started[-1].NAME}: {msg}")

        results = run_gates(ctx, gates, on_start=on_start, step=step, reuse=reuse)
        progress.advance(task)
    return results


def _show_gates(results: list[GateResult], title: str = "Quality gates") -> None:
    table = Table(title=Text(title), title_justify="left")
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
            str(r.number), Text(r.name), str(r.files), STATUS_STYLE[r.status] + (" [dim](reused)[/]" if r.reused else ""),
            f"{r.seconds:.1f}", Text(f"inputs unchanged since the pass at {r.reused_from}: {r.summary}" if r.reused else r.summary),
        )
    console.print(table)
    for r in results:
        if r.status == FAIL and r.details:
            console.print(f"[bold red]gate {r.number} {escape(r.name)}:[/]")
            for line in r.details:
                console.print(f"  {line}", markup=False, highlight=False)


# ---------------------------------------------------------------------------------------------
# Pins: which snapshot + series each command works on (see deploy/build/pins.py)


def _pins(pin, snapshot_dir, patches_dir, snapshot_root, patches_root) -> tuple[list[Pin], bool]:
    """(pins, chosen): chosen is False when the command runs over every pin by default."""
    chosen = pin is not None or snapshot_dir is not None
    return pins_mod.resolve(pin, snapshot_dir, patches_dir, snapshot_root, patches_root), chosen


def _skip_empty(pins: list[Pin], chosen: bool) -> tuple[list[Pin], list[dict]]:
    """Over every pin, a pin whose series is empty is in preparation: skipped, with a message."""
    if chosen:
        return pins, []
    keep, skipped = [], []
    for p in pins:
        if p.series_empty():
            reason = f"{p.patches_dir / 'series'} lists no patch yet (build it with --pin {p.version})"
            warn(f"sglang {p.version}: skipped: {reason}")
            skipped.append({"pin": p.version, "skipped": reason})
        else:
            keep.append(p)
    return keep, skipped


def _doc(per_pin: list[dict], **top) -> dict:
    """The --json document: one entry per pin under "pins"; with one pin its keys also at the top."""
    doc = {"pins": per_pin, **top}
    worked = [d for d in per_pin if "skipped" not in d]
    if len(worked) == 1 and len(per_pin) == 1:
        doc = {**worked[0], **doc}
    return doc


def _gate_pins(pins: list[Pin], gates, build_root, ddtree_utils, python, tests_dir=None, reuse: bool = True) -> dict[str, list[GateResult]]:
    """Run the gates of every pin; gate 7 (the ddtree_utils tests, the same for every pin) runs
    once and its result is recorded for each pin."""
    out: dict[str, list[GateResult]] = {}
    unit: GateResult | None = None
    for p in pins:
        ctx = Context(inputs=p.inputs(build_root, ddtree_utils), extra_pythons=python or [], tests_dir=tests_dir)
        todo = [g for g in gates if not (g is gate_unit and unit is not None)]
        results = _run_gates_with_progress(ctx, todo, f"sglang {p.version}", reuse)
        if any(g is gate_unit for g in gates):
            if unit is None:
                unit = next(r for r in results if r.number == gate_unit.NUMBER)
            else:
                results = sorted([*results, replace(unit, summary=f"{unit.summary} (run once for every pin)")],
                                 key=lambda r: r.number)
        record_gates(ctx.build_dir, results)
        _show_gates(results, f"Quality gates: sglang {p.version} ({ctx.build_dir})")
        out[p.version] = results
    return out


def _fail_first(errors: list[DDTreeDeployError], results: dict[str, list[GateResult]]) -> None:
    if errors:
        raise errors[0]
    failed = [f"sglang {v}: " + ", ".join(f"{r.number} ({r.name})" for r in rs if r.status == FAIL)
              for v, rs in results.items() if any(r.status == FAIL for r in rs)]
    if failed:
        raise GateFailed(f"quality gate(s) failed: {'; '.join(failed)}" if len(results) > 1 else
                         f"quality gate(s) failed: {failed[0].split(': ', 1)[1]}")


def patch(
    pin: PinOpt = None,
    snapshot_dir: SnapshotDir = None,
    patches_dir: PatchesDir = None,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    snapshot_root: SnapshotRoot = snap.SNAPSHOT_ROOT,
    patches_root: PatchesRoot = PATCHES_ROOT,
    no_check: Annotated[bool, typer.Option("--no-check", help="Build only; skip the quality gates.")] = False,
    skip: Skip = None,
    fresh: Fresh = False,
    python: Pythons = None,
    json_out: JsonOut = False,
) -> None:
    """Build build/sglang-<version>/ of every pin (or --pin V) from its snapshot, its series and
    ddtree_utils.py, then run the gates."""
    pins, chosen = _pins(pin, snapshot_dir, patches_dir, snapshot_root, patches_root)
    pins, skipped = _skip_empty(pins, chosen)
    gates = [] if no_check else select(None, skip)
    built, errors, per_pin = [], [], {p["pin"]: p for p in skipped}
    for p in pins:
        try:
            with _progress() as progress:
                task = progress.add_task(f"sglang {p.version}: applying patches", total=None)
                result = build(p.inputs(build_dir, ddtree_utils), on_patch=lambda e, v=p.version: progress.update(
                    task, description=f"sglang {v}: applying {e.name}"))
        except DDTreeDeployError as exc:
            if len(pins) == 1:
                raise
            errors.append(exc)
            error(f"sglang {p.version}: {exc.message}")
            per_pin[p.version] = {"pin": p.version, "ok": False, "exit_code": exc.exit_code, "error": exc.message}
            continue
        for w in result.warnings:
            warn(escape(f"sglang {p.version}: {w}"))
        info = result.info
        counts = f"{len(info.files)} files, {len(info.patches)} patch(es)"
        ok(f"sglang {escape(p.version)}: built {escape(str(info.root))} (build {info.build_id}: {counts})")
        built.append(p)
        per_pin[p.version] = {"pin": p.version, "build": _build_json(result), "gates": [], "ok": True}
    results = _gate_pins(built, gates, build_dir, ddtree_utils, python, reuse=not fresh) if gates else {}
    for v, rs in results.items():
        per_pin[v].update(gates=[r.to_json() for r in rs], ok=all(r.status != FAIL for r in rs))
    rows = sorted(per_pin.values(), key=lambda d: pins_mod.version_key(d["pin"]))
    if json_out:
        emit_json(_doc(rows, ok=all(d.get("ok", True) for d in rows) and not errors,
                       **({"exit_code": errors[0].exit_code, "error": errors[0].message} if errors else {})))
    _fail_first(errors, results)


def check(
    pin: PinOpt = None,
    snapshot_dir: SnapshotDir = None,
    patches_dir: PatchesDir = None,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    snapshot_root: SnapshotRoot = snap.SNAPSHOT_ROOT,
    patches_root: PatchesRoot = PATCHES_ROOT,
    gate: Annotated[
        list[str] | None, typer.Option("--gate", "-g", help="Run only this gate (number or name; repeatable).")
    ] = None,
    skip: Skip = None,
    fresh: Fresh = False,
    python: Pythons = None,
    json_out: JsonOut = False,
) -> None:
    """Run the quality gates on the current build of every pin (or --pin V); non-zero exit when any gate fails."""
    pins, chosen = _pins(pin, snapshot_dir, patches_dir, snapshot_root, patches_root)
    pins, skipped = _skip_empty(pins, chosen)
    results = _gate_pins(pins, select(gate, skip), build_dir, ddtree_utils, python, reuse=not fresh)
    rows = skipped + [
        {"pin": p.version, "build_dir": str(pins_mod.build_dir(p.version, build_dir)),
         "gates": [r.to_json() for r in results[p.version]],
         "ok": all(r.status != FAIL for r in results[p.version])}
        for p in pins
    ]
    rows.sort(key=lambda d: pins_mod.version_key(d["pin"]))
    if json_out:
        emit_json(_doc(rows, ok=all(d.get("ok", True) for d in rows)))
    _fail_first([], results)


def _series_rows(patches_dir: Path) -> tuple[Path, list[dict]]:
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
    return s.series_path, rows


def series_cmd(
    pin: PinOpt = None,
    patches_dir: PatchesDir = None,
    snapshot_root: SnapshotRoot = snap.SNAPSHOT_ROOT,
    patches_root: PatchesRoot = PATCHES_ROOT,
    json_out: JsonOut = False,
) -> None:
    """List the patches of every pin's series (or --pin V) in order, with the files each touches and +/- counts."""
    if patches_dir is not None and pin is None:  # one series directory, whatever the pins
        series = [(Path(patches_dir).name, Path(patches_dir))]
    else:
        series = [(p.version, p.patches_dir) for p in pins_mod.resolve(pin, None, patches_dir, snapshot_root, patches_root)]
    docs = []
    for version, pdir in series:
        spath, rows = _series_rows(pdir)
        docs.append({"pin": version, "series": str(spath), "patches": rows})
    if json_out:
        emit_json(_doc(docs))
        return
    for d in docs:
        rows = d["patches"]
        if not rows:
            console.print(Text(f"sglang {d['pin']}: {d['series']}: empty series (no patches yet)"))
            continue
        table = Table(title=Text(f"sglang {d['pin']}: {d['series']} ({len(rows)} patches)"), title_justify="left")
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


def refresh_cmd(
    patch_name: Annotated[str, typer.Argument(metavar="PATCH", help="Patch name (or its NNNN number) in the series.")],
    add_file: Annotated[
        list[str] | None, typer.Option("--add-file", help="Also put this build file into the patch (repeatable).")
    ] = None,
    pin: Annotated[
        str | None, typer.Option("--pin", help="The pin whose series holds PATCH (needed when several could).")
    ] = None,
    snapshot_dir: SnapshotDir = None,
    patches_dir: PatchesDir = None,
    build_dir: BuildDir = BUILD_ROOT,
    ddtree_utils: UtilsPath = DDTREE_UTILS,
    snapshot_root: SnapshotRoot = snap.SNAPSHOT_ROOT,
    patches_root: PatchesRoot = PATCHES_ROOT,
    json_out: JsonOut = False,
) -> None:
    """Regenerate one patch from the edited build tree of its pin (quilt refresh); then rebuild with `patch`."""
    pins, chosen = _pins(pin, snapshot_dir, patches_dir, snapshot_root, patches_root)
    p = pins_mod.with_patch(pins, patch_name, chosen)
    with console.status(f"refreshing {patch_name} (sglang {p.version})"):
        r = refresh_patch(p.inputs(build_dir, ddtree_utils), patch_name, add_files=add_file or [])
    if r.changed:
        ok(f"sglang {escape(p.version)}: refreshed {escape(str(r.patch))} ({len(r.files)} file(s))")
    else:
        ok(f"sglang {escape(p.version)}: {escape(r.patch.name)}: already up to date")
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
                "pin": p.version,
                "patch": str(r.patch),
                "changed": r.changed,
                "files": r.files,
                "broken": r.broken,
                "uncaptured": r.uncaptured,
            }
        )
    if r.broken:
        raise UsageError(f"after refreshing {r.patch.name}: {r.broken}")


def snapshot_verify(
    pin: PinOpt = None,
    snapshot_dir: SnapshotDir = None,
    snapshot_root: SnapshotRoot = snap.SNAPSHOT_ROOT,
    json_out: JsonOut = False,
) -> None:
    """Check every pin's (or --pin V's) snapshot files against its MANIFEST.json (exit 4 on any difference)."""
    pins, _ = _pins(pin, snapshot_dir, None, snapshot_root, PATCHES_ROOT)
    docs, bad = [], None
    for p in pins:
        try:
            manifest = snap.load_manifest(p.snapshot_dir)
        except DDTreeDeployError as exc:
            if len(pins) == 1:
                raise
            bad = bad or exc
            docs.append({"pin": p.version, "snapshot_dir": str(p.snapshot_dir), "error": exc.message})
            error(exc.message)
            continue
        problems = snap.find_problems(p.snapshot_dir, manifest)
        docs.append(
            {
                "pin": p.version,
                "snapshot_dir": str(p.snapshot_dir),
                "sglang_version": manifest.sglang_version,
                "files": len(manifest.files),
                "problems": [{"path": q.relpath, "kind": q.kind} for q in problems],
            }
        )
        if problems:
            for q in problems[1:]:
                console.print(f"  {q.describe(p.snapshot_dir)}", markup=False)
            try:
                snap.verify(p.snapshot_dir)
            except SnapshotError as exc:
                bad = bad or exc
        else:
            ok(f"{escape(str(p.snapshot_dir))}: {len(manifest.files)} files match sglang {manifest.sglang_version}")
    if json_out:
        emit_json(_doc(docs, ok=bad is None))
    if bad is not None:
        raise bad


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
