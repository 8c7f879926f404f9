"""A time limit for work that runs in this process and may hang: the GPU suite's end-to-end providers.

A lent GPU is held for minutes, once; a provider that hangs there (a kernel that never ends, a wait on work that never
comes) must not burn the rest of the lease in silence. ``Watchdog`` arms a timer around one piece of work; if the work
has not returned when it fires, the timer thread collects every thread's Python stack and calls ``on_hang(stacks)``,
which records what it can and ends the process (``os._exit``: the hung thread cannot be stopped from outside).

The timer thread needs the GIL. A thread that hangs holding it (inside a C call that never releases it) would keep
the timer from running, so ``backstop`` seconds later ``faulthandler``, whose own C thread needs no GIL, writes every
thread's stack to standard error and exits with status 1.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Watchdog", "thread_stacks"]


def thread_stacks() -> str:
    """Every live thread's Python stack, the way a hang is diagnosed: name, then the frames (innermost last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """``with Watchdog(on_hang).armed(seconds):`` runs its body under a time limit (see the module's docstring)."""

    def __init__(self, on_hang: Callable[[str], None], *, backstop: float | None = 30.0) -> None:
        self.on_hang, self.backstop = on_hang, backstop

    @staticmethod
    def _fire(on_hang: Callable[[str], None], lock: threading.Lock, done: list[bool]) -> None:
        # The body may return just as the timer fires: whichever takes the lock first wins, so a body that returned
        # is never reported as hung, and one reported as hung never goes on (its own exit waits for the lock).
        with lock:
            if done[0]:
                return
            try:
                on_hang(thread_stacks())
            finally:
                os._exit(3)  # on_hang normally exits itself; a broken one must not leave the hang running

    @contextmanager
    def armed(self, seconds: float) -> Iterator[None]:
        lock, done = threading.Lock(), [False]
        timer = threading.Timer(max(0.0, seconds), self._fire, (self.on_hang, lock, done))
        timer.daemon = True
        if self.backstop is not None:
            # The interpreter's own stderr: it has a file descriptor even where sys.stderr was replaced.
            faulthandler.dump_traceback_later(max(0.0, seconds) + self.backstop, exit=True,
                                              file=sys.__stderr__ or sys.stderr)
        timer.start()
        try:
            yield
        finally:
            with lock:
                done[0] = True
            timer.cancel()
            if self.backstop is not None:
                faulthandler.cancel_dump_traceback_later()
