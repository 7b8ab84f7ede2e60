"""Layer 4 of deploy/, the top: the Typer app and its commands (human output through rich to
stderr, `--json` to stdout). It may import every layer below and the quality gates (checks/)."""

from .app import COMMANDS, _register, app, main

__all__ = ["COMMANDS", "_register", "app", "main"]
