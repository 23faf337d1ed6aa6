"""A rich progress bar behind the `(label, done, total)` callback sensitivity reports through.

llm-compressor draws its own tqdm bars for calibration; this one covers qpipe's own long loops
(per-block sensitivity), which would otherwise run silently for minutes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stage_progress() -> Iterator[Callable[[str, int, int], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    tasks: dict[str, int] = {}
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        yield update
