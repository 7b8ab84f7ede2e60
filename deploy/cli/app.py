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
from . import ui
from .ui import emit_json, error

app = typer.Typer(
    name="ddtree-deploy",
    help="Build the DDTree-patched SGLang, gate it, and ship it safely to GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _group() -> None:
    # A callback keeps the app a group of commands even while only one is registered (Typer runs
    # a lone command as the app itself): `ddtree-deploy bench ...` registers bench alone.
    pass


snapshot_app = typer.Typer(help="Check or re-import the vendored upstream SGLang files.", no_args_is_help=True)

# (typer app, command name, module of deploy.cli, function): the whole command line, in `--help`
# order. The command modules are imported when their commands are registered: a `push` or
# `status` registers (and imports) remote_cmds only, not the build and bench commands with the
# quality gates behind them (about a third of the tool's start-up).
COMMANDS = [
    (app, "patch", "build_cmds", "patch"),
    (app, "check", "build_cmds", "check"),
    (app, "series", "build_cmds", "series_cmd"),
    (app, "refresh", "build_cmds", "refresh_cmd"),
    (snapshot_app, "verify", "build_cmds", "snapshot_verify"),
    (snapshot_app, "import", "build_cmds", "snapshot_import"),
    (app, "bench", "bench_cmds", "bench"),
    (app, "push", "remote_cmds", "push"),
    (app, "rollback", "remote_cmds", "rollback"),
    (app, "restart", "remote_cmds", "restart_cmd"),
    (app, "plan", "remote_cmds", "plan"),
    (app, "status", "remote_cmds", "status"),
    (app, "unlock", "remote_cmds", "unlock"),
]
_loaded: set[str] = set()  # the command modules whose commands are on the app


def _register(only: str | None = None) -> None:
    """Add COMMANDS to the app: every one, or (`only`: a top-level command name, `snapshot` for its
    group) the commands of the module that holds it. Safe to call again."""
    import importlib

    owner = {name: mod for target, name, mod, _ in COMMANDS if target is app} | {"snapshot": "build_cmds"}
    new = ({owner[only]} if only in owner else {mod for _, _, mod, _ in COMMANDS}) - _loaded
    for target, name, mod, attr in COMMANDS:
        if mod in new:
            target.command(name)(getattr(importlib.import_module(f"{__package__}.{mod}"), attr))
    if "build_cmds" in new:
        app.add_typer(snapshot_app, name="snapshot")
    _loaded.update(new)


def _command_in(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option (the app itself
    takes no option but --help)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main() -> None:
    _register(_command_in(sys.argv[1:]))
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
