"""Waking the asyncio readers of a stream (§4.7), batched inside a producer's step (DECISIONS D57).

An asyncio reader waits on a future of its event loop (`wait_until`); a producer thread wakes it
with `wake`. A producer that writes many streams in one go (the Engine's step) opens
`batched_wakes()`: the readers it wakes are woken once per event loop when the batch closes, not
once per delta (a cross-thread wake-up per token had the event loop and the engine thread trade
the GIL at every token). A batch never delays a reader that a producer waits for: a producer
about to block calls `flush_wakes` first. Nothing here knows a stream: the stream hands over its
lock and its lists of waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]
T = TypeVar("T")
_BATCH = threading.local()  # .waiters: the asyncio readers woken inside this thread's open batch


@contextlib.contextmanager
def batched_wakes() -> Iterator[None]:
    """Inside the block, the asyncio readers this thread wakes are collected and woken when it
    ends, with one `call_soon_threadsafe` per event loop (D57). Nested blocks join the outer one;
    an exception still wakes everyone collected."""
    if getattr(_BATCH, "waiters", None) is not None:
        yield
        return
    _BATCH.waiters = []
    try:
        yield
    finally:
        flush_wakes()
        _BATCH.waiters = None


def flush_wakes() -> None:
    """Wake the readers collected by this thread's open batch (if any), one call per loop."""
    waiters = getattr(_BATCH, "waiters", None)
    if not waiters:
        return
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for loop, fut in waiters:
        by_loop.setdefault(loop, []).append(fut)
    waiters.clear()
    for loop, futs in by_loop.items():
        loop.call_soon_threadsafe(_resolve_all, futs)


def wake(waiters: list[Waiter]) -> None:
    """Wake every one of `waiters` and empty the list: into this thread's open batch if there is
    one, else one `call_soon_threadsafe` each."""
    batch = getattr(_BATCH, "waiters", None)
    if batch is not None:
        batch.extend(waiters)
    else:
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)
    waiters.clear()


async def wait_until(lock: threading.Condition, waiters: list[Waiter],
                     step: Callable[[], tuple[T | None, bool]]) -> T | None:
    """Call `step` (with `lock` held) until it gives something or says there is nothing more to
    wait for, waiting in `waiters` between calls without blocking the event loop; a cancelled
    wait leaves nothing behind in `waiters`."""
    loop = asyncio.get_running_loop()
    while True:
        with lock:
            got, done = step()
            if got is not None or done:
                return got
            fut: asyncio.Future[None] = loop.create_future()
            waiters.append((loop, fut))
        try:
            await fut
        finally:
            with lock:
                if (loop, fut) in waiters:
                    waiters.remove((loop, fut))


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _resolve_all(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        _resolve(fut)
