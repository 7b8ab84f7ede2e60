"""The `ddtree-deploy` command line (Typer + rich).

Commands are defined in two modules that register themselves on `app`:
  deploy.cli_build   patch, check, series, refresh, snapshot verify/import   (no remote host)
  deploy.cli_remote  plan, push, status, rollback                            (SSH / local)
This module owns the app object and the mapping of errors to exit codes (see deploy.errors).
"""

from __future__ import annotations

import sys

import typer

from .errors import DDTreeDeployError
from . import ui
from .ui import emit_json, error

app = typer.Typer(
    name="ddtree-deploy",
    help="Build the DDTree-patched SGLang, gate it, and ship it safely to GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register() -> None:
    # Imported for their side effect of adding commands to `app`.
    from . import cli_build  # noqa: F401
    from . import cli_bench  # noqa: F401
    try:
        from . import cli_remote  # noqa: F401
    except ModuleNotFoundError as exc:  # remote commands not built yet in this checkout
        if exc.name != f"{__package__}.cli_remote":
            raise


def main() -> None:
    _register()
    try:
        rc = app(standalone_mode=False)
    except DDTreeDeployError as exc:
        error(exc.message)
        if exc.detail:
            from .ui import console

            console.print(exc.detail, markup=False, highlight=False)
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
            sys.exit(exc.exit_code)
        raise
    # With standalone_mode=False a command's `raise typer.Exit(n)` comes back as the return value.
    sys.exit(rc if isinstance(rc, int) else 0)
