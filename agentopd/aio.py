"""asyncio helpers shared by the parts that run many coroutines at once (the rollout's episodes, the players' sources,
a server teacher's scoring requests): they sit below every part, so the teacher need not import the rollout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(coros: Sequence[Awaitable[T]]) -> list[T]:
    """asyncio.gather's results; on the first error the others are cancelled and every one's end is awaited before the
    error propagates. Plain gather left them running: one that failed too before asyncio.run shut down was printed
    there with its traceback ("unhandled exception during asyncio.run() shutdown") under the run's one-line error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each task's end retrieved: none is reported at shutdown
        raise
