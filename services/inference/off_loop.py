"""Request work that must not run on the event loop (shared by the gRPC and HTTP fronts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def off_loop(fn: Callable[[], T]) -> T:
    """Run CPU-heavy request work (tokenising, detokenising) in a worker thread, so the event
    loop — health checks, other streams — keeps answering while it runs."""
    return await asyncio.to_thread(fn)
