"""The CLI's two rich consoles: messages, progress and errors on stderr; results on stdout."""

from __future__ import annotations

import sys

from rich.console import Console

# NOTE: CI logs are not terminals; rich would wrap tables at 80 columns and split the paths. The
# width is fixed here, once, rather than read from COLUMNS by whichever console a command made.
_WIDTH = None if sys.stdout.isatty() else 200
console = Console(stderr=True, width=_WIDTH)
out = Console(width=_WIDTH)
