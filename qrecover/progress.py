"""Progress bars: one rich style for every long step, on stderr so that ``--json`` stdout stays clean."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress(*middle: ProgressColumn, disable: bool = False) -> Progress:
    """A bar ``description [bar] done/total elapsed remaining``; ``middle`` replaces the ``done/total`` column
    (e.g. tokens, speed and loss for training)."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), *(middle or (MofNCompleteColumn(),)), TimeElapsedColumn(),
        TimeRemainingColumn(), transient=False, console=Console(stderr=True), disable=disable,
    )


@contextlib.contextmanager
def steps(show: bool, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """``with steps(show, "scan", n) as advance: ... advance(k)``: one bar for one loop, or nothing."""
    if not show:
        yield lambda k=1: None
        return
    with progress() as bar:
        task = bar.add_task(description, total=total)
        yield lambda k=1: bar.advance(task, k)


__all__ = ["progress", "steps"]
