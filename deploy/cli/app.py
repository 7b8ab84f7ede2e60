"""The `ddtree-deploy` command line (Typer + rich): the app, the one table of its commands, and the
mapping of errors to exit codes (see deploy.errors).

The commands are plain functions in three modules, registered here and nowhere else (importing a
command module adds nothing to the app):
  deploy.cli.build_cmds   patch, check, series, refresh, snapshot verify/import   (no remote host)
  deploy.cli.remote_cmds  plan, push, status, rollback, restart, unlock            (SSH / local)
  deploy.cli.bench_cmds   bench                                                    (serving benchmark)
"""

from __future__ import annotations

import sys

import typer

from ..errors import DDTreeDeployError
from . import bench_cmds, build_cmds, remote_cmds, ui
from .ui import emit_json, error

app = typer.Typer(
    name="ddtree-deploy",
    help="Build the DDTree-patched SGLang, gate it, and ship it safely to GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
snapshot_app = typer.Typer(help="Check or re-import the vendored upstream SGLang files.", no_args_is_help=True)

# (typer app, command name, function): the whole command line, in `--help` order
COMMANDS = [
    (app, "patch", build_cmds.patch),
    (app, "check", build_cmds.check),
    (app, "series", build_cmds.series_cmd),
    (app, "refresh", build_cmds.refresh_cmd),
    (snapshot_app, "verify", build_cmds.snapshot_verify),
    (snapshot_app, "import", build_cmds.snapshot_import),
    (app, "bench", bench_cmds.bench),
    (app, "push", remote_cmds.push),
    (app, "rollback", remote_cmds.rollback),
    (app, "restart", remote_cmds.restart_cmd),
    (app, "plan", remote_cmds.plan),
    (app, "status", remote_cmds.status),
    (app, "unlock", remote_cmds.unlock),
]
_registered = False


def _register() -> None:
    """Add COMMANDS to the app (once)."""
    global _registered
    if _registered:
        return
    for target, name, fn in COMMANDS:
        target.command(name)(fn)
    app.add_typer(snapshot_app, name="snapshot")
    _registered = True


_register()


def main() -> None:
    try:
        rc = app(standalone_mode=False)
    except DDTreeDeployError as exc:
        error(exc.message)
        if exc.detail:
            ui.console.print(exc.detail, markup=False, highlight=False)
        if "--json" in sys.argv[1:] and not ui.json_written:
            # Scripts reading --json always get one document, failures included.
            emit_json({"ok": False, "exit_code": exc.exit_code, "error": exc.message})
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        error("aborted")
        sys.exit(1)
    except Exception as exc:  # click usage errors arrive here in standalone_mode=False
        from typer._click.exceptions import ClickException  # typer 0.29 vendors click

        if isinstance(exc, ClickException):
            exc.show()
            if "--json" in sys.argv[1:] and not ui.json_written:  # a usage error is a failure too
                emit_json({"ok": False, "exit_code": exc.exit_code, "error": exc.format_message()})
            sys.exit(exc.exit_code)
        raise
    # With standalone_mode=False a command's `raise typer.Exit(n)` comes back as the return value.
    sys.exit(rc if isinstance(rc, int) else 0)
