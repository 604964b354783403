"""Dynamic batching: requests that arrive together share one forward pass.

The first request of a batch waits at most `window_s` for company (none when the batch is
already full); requests that arrive while a batch runs form the next one. The batch function
runs in the model's worker thread and returns one result or exception per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


class DynamicBatcher:
    def __init__(
        self,
        run_batch: Callable[[list[Any]], list[Any]],
        executor: Executor,
        max_batch_size: int,
        window_s: float,
    ):
        self._run = run_batch
        self._executor = executor
        self.max_batch_size = max(1, max_batch_size)
        self.window_s = max(0.0, window_s)
        self._queue: asyncio.Queue[tuple[Any, int, asyncio.Future]] | None = None
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.requests = 0
        self.inputs = 0
        self.max_requests_in_batch = 0

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, payload: Any, n_inputs: int) -> Any:
        """Queue one request; returns its result or raises its exception."""
        assert self._queue is not None, "batcher not started"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((payload, n_inputs, fut))
        return await fut

    async def _loop(self) -> None:
        q = self._queue
        assert q is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await q.get()]
            n = batch[0][1]
            if n < self.max_batch_size and self.window_s > 0 and q.empty():
                await asyncio.sleep(self.window_s)
            while n < self.max_batch_size and not q.empty():
                item = q.get_nowait()
                batch.append(item)
                n += item[1]
            live = [b for b in batch if not b[2].done()]  # drop requests whose client left
            if not live:
                continue
            self.batches += 1
            self.requests += len(live)
            self.inputs += sum(b[1] for b in live)
            self.max_requests_in_batch = max(self.max_requests_in_batch, len(live))
            try:
                results = await loop.run_in_executor(
                    self._executor, self._run, [b[0] for b in live]
                )
            except Exception as err:  # the whole batch failed (e.g. out of memory)
                results = [err] * len(live)
            for (_, _, fut), res in zip(live, results, strict=True):
                if fut.done():
                    continue
                if isinstance(res, BaseException):
                    fut.set_exception(res)
                else:
                    fut.set_result(res)

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "inputs": self.inputs,
            "max_requests_in_batch": self.max_requests_in_batch,
            "max_batch_size": self.max_batch_size,
            "batch_window_ms": self.window_s * 1000,
        }
