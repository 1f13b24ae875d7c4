"""Ctrl-C handling for a run: the first one asks the loop to stop after the running step, a second one
stops at once — but never in the middle of writing a checkpoint.

A KeyboardInterrupt raised inside `torch.distributed.checkpoint.save` surfaces as a CheckpointException
and leaves a half-written step folder; `writes_uninterrupted()` holds a Ctrl-C that arrives while a
checkpoint is being written and hands it to the handler that was in place once the files are on disk.
Signal handlers can only be set from the main thread; elsewhere (a run started from a worker thread)
both are no-ops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def catch_ctrl_c(on_first: Callable[[], None]) -> Callable[[], None]:
    """Install the two-stage handler: the first Ctrl-C calls `on_first` (and arms the default handler, so the
    next one raises KeyboardInterrupt). Returns the undo."""
    if not _main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)

    def first(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        on_first()

    signal.signal(signal.SIGINT, first)
    return lambda: signal.signal(signal.SIGINT, previous)


@contextmanager
def writes_uninterrupted(on_held: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Run the block with Ctrl-C held back; a Ctrl-C that arrived meanwhile calls `on_held` at once and, after
    the block, is given to the handler that was in place (which may raise KeyboardInterrupt)."""
    if not _main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    held: list[object] = []

    def hold(signum, frame):
        if not held:
            on_held()
        held.append(frame)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    for _ in held[:2]:  # replayed one by one: the first may be the "stop after this step" handler, arming the next
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, None)
        elif handler == signal.SIG_DFL:
            raise KeyboardInterrupt
