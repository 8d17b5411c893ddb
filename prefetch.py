"""Micro-batches made ahead on a background thread, so the training thread only takes them.

On a GPU the thread that runs the training step also launches every kernel: whatever it
does between steps (lancedb's packer, re-forming worker batches, unpickling, pinning) is
time the GPU waits. `Prefetcher` runs the whole batch pipeline (`data.train_batches`:
loaders, epochs, the next epoch's start) on one thread of its own, pins each batch there,
and hands it over through a queue of `depth` batches: the training thread's part is one
`Queue.get`. Errors raised there (a user error, a storage fault) reach the training thread
at the batch where they happened, in order.
"""

from __future__ import annotations

import queue
import threading

import torch

# Micro-batches made ahead of the one training: enough to hide a slow batch, few enough
# that a stop or a checkpoint leaves little made for nothing (each is batch x seq_len ids).
DEFAULT_DEPTH = 4
_DONE = object()


class _Raised:
    """An exception of the producer, to be raised on the training thread."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterate `items` (a generator of (epoch, position, batch)) on a background thread,
    `depth` items ahead, each batch pinned when `device` is CUDA. close() stops it and the
    loaders under it, from any thread, and waits for them."""

    def __init__(self, items, device: torch.device, depth: int = DEFAULT_DEPTH):
        self._items = items
        self._device = device
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._finished = True
            error, item.error = item.error, None
            raise error
        return item

    def close(self) -> None:
        """Stop making batches, close the pipeline (its worker processes included) and join."""
        self._stop.set()
        self._finished = True
        while self._thread.is_alive():
            self._drain()
            self._thread.join(timeout=0.05)
        self._drain()

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _put(self, item) -> bool:
        """Queue `item` unless asked to stop first; False once stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        pin = self._device.type == "cuda"
        try:  # set_device too: whatever fails here must reach the consumer, which waits on the queue
            if pin:
                torch.cuda.set_device(self._device)
            for epoch, position, batch in self._items:
                if pin:
                    batch = {key: value.pin_memory() for key, value in batch.items()}
                if not self._put((epoch, position, batch)):
                    break
            else:
                self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - every error belongs to the training thread
            self._put(_Raised(e))
        finally:
            self._items.close()
