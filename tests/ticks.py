"""Whether an event loop kept running while something awaited: an asyncio task counting its ticks."""

import asyncio
import contextlib


@contextlib.asynccontextmanager
async def ticking(period_s: float):
    """Yields a one-item list holding the ticks counted so far (every `period_s` while the loop runs)."""
    ticks = [0]

    async def tick():
        while True:
            await asyncio.sleep(period_s)
            ticks[0] += 1

    task = asyncio.create_task(tick())
    try:
        yield ticks
    finally:
        task.cancel()
