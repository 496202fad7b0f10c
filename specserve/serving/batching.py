"""A batcher: gathers work items submitted from many threads and processes them together.

Each service runs its model from one worker, which keeps per-session caches single-threaded
and lets concurrent calls from different sessions share a forward pass or a kernel call.
The services run the worker on the main thread (run()): torch's OpenMP thread team, driven
from another thread and idle between calls, made a decode step more than twice as slow.
Items already queued when a batch starts join it; max_wait_s bounds how long a
lone item waits for company. An item whose process() result is Again goes on in the next
batch, ahead of new items (but leaving them up to half of it), under the same future: a
decode makes one token per batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


@dataclass(frozen=True)
class Again(Generic[ItemT]):
    """A result that is not final: item (the work left) runs in the next batch."""

    item: ItemT


# process() returns, per item, its result, the exception to raise in its caller, or Again.
ProcessFn = Callable[[Sequence[ItemT]], Sequence["ResultT | BaseException | Again[ItemT]"]]


class Batcher(Generic[ItemT, ResultT]):
    def __init__(self, process: ProcessFn, max_batch: int, max_wait_s: float, name: str, own_thread: bool = True):
        """own_thread starts a worker thread; otherwise the caller runs run() itself."""
        self._process = process
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._queue: queue.Queue[tuple[ItemT, Future] | None] = queue.Queue()
        self._carried: list[tuple[ItemT, Future]] = []  # Again items: the worker's own
        self._thread = threading.Thread(target=self.run, name=name, daemon=True) if own_thread else None
        if self._thread is not None:
            self._thread.start()

    @property
    def pending(self) -> int:
        """Items waiting for a batch."""
        return self._queue.qsize()

    def submit(self, item: ItemT) -> ResultT:
        """Blocks until the item has been processed; raises the item's own exception."""
        return self.submit_async(item).result()

    def submit_async(self, item: ItemT) -> Future:
        """Queues the item; the future holds its result (or exception) once processed."""
        future: Future = Future()
        self._queue.put((item, future))
        return future

    def close(self) -> None:
        """Stops the worker once the items already queued are done."""
        self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def run(self) -> None:
        """The worker loop: processes batches until close()."""
        while True:
            batch = self._gather()
            if batch is None:
                return
            self._run_batch(batch)

    def _gather(self) -> list[tuple[ItemT, Future]] | None:
        if self._carried:  # work under way waits for no one; what is queued joins it
            # Carried items leave up to half the batch to queued ones (the rest of the carried
            # go first next time): a full house of long decodes must not starve new calls.
            queued = self._queue.qsize()
            room = self._max_batch - min(queued, max(1, self._max_batch // 2))
            batch, self._carried = self._carried[:room], self._carried[room:]
            deadline = time.monotonic()
        else:
            first = self._queue.get()
            if first is None:
                return None
            batch = [first]
            deadline = time.monotonic() + self._max_wait_s
        while len(batch) < self._max_batch:
            try:
                timeout = max(0.0, deadline - time.monotonic())
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # stop after this batch
                break
            batch.append(item)
        if not batch:  # the place left was for the stop marker: carry on with the carried
            batch, self._carried = self._carried[:1], self._carried[1:]
        return batch

    def _run_batch(self, batch: list[tuple[ItemT, Future]]) -> None:
        try:
            results = self._process([item for item, _ in batch])
        except BaseException as error:  # noqa: BLE001 - a failed batch fails its callers, not the thread
            log.exception("batch of %d failed", len(batch))
            results = [error] * len(batch)
        for (_, future), result in zip(batch, results):
            if isinstance(result, Again):
                self._carried.append((result.item, future))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
