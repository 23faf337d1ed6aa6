"""The CLI's two rich consoles: messages, progress and errors on stderr; results on stdout."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

# NOTE: CI logs are not terminals; rich would wrap tables at 80 columns and split the paths. The
# width is fixed here, once, rather than read from COLUMNS by whichever console a command made.
_WIDTH = None if sys.stdout.isatty() else 200
console = Console(stderr=True, width=_WIDTH)
out = Console(width=_WIDTH)


def error(message: str, code: int = 1) -> typer.Exit:
    """Prints `error: message` on stderr and returns the Exit to raise. The message is shown as
    text, never read as rich markup: recipe problems quote patterns like `^[a-z0-9]`."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)
