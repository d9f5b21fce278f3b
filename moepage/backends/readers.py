"""``Readers``: the threads that read rows from disk into host rows, started up front and fed through one queue.

Why not a ``ThreadPoolExecutor``: its ``submit`` can be interrupted (Ctrl-C) after the read is queued and before its
future is returned, even while it starts a thread it then forgets; such a read cannot be waited for, and would land
in a host row the tier has given to another expert. Here every thread is known, and ``drain`` returns once every read
queued before it has ended, whether or not its future reached the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class Readers:
    """``workers`` threads running what ``submit`` queues, in order; ``drain`` and ``close`` wait for all of it."""

    def __init__(self, workers: int = 4, name: str = "moepage-disk"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # a C queue: a put is queued whole or not at all
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def drain(self) -> None:
        """Return once every read queued before this call has ended: each thread stops at one barrier in turn, after
        all that was queued before it (first in, first out)."""
        barrier = threading.Barrier(len(self._threads) + 1)
        try:
            for _ in self._threads:
                self._queue.put(barrier)
            barrier.wait()
        except BaseException:
            barrier.abort()  # interrupted: no thread may stay at a barrier nobody else will reach
            raise

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Barrier):
                try:
                    item.wait()
                except threading.BrokenBarrierError:
                    pass
                continue
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller raises it (an interrupt of the read included)
                    future.set_exception(exc)
            del item, future, fn, args  # waiting for the next, a thread holds nothing of this read (nor its store)
