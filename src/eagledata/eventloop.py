"""The event loop a job runs on: uvloop's when installed (it is a dependency on Linux and macOS),
else asyncio's. ``kind``: ``auto`` | ``uvloop`` | ``asyncio`` (``generation.event_loop``).

uvloop cuts the generation client's CPU per request by about a sixth
(benchmarks/generation_throughput.py)."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any, Coroutine


def uvloop_module(kind: str = "auto") -> ModuleType | None:
    """uvloop for ``kind`` ``uvloop`` or ``auto`` (when installed); ``None`` for asyncio's loop.
    Raises :class:`ImportError` when ``uvloop`` is asked for and not installed."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ImportError("generation.event_loop is uvloop, but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A new loop of ``kind`` (for a thread of its own)."""
    uvloop = uvloop_module(kind)
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any], kind: str = "auto") -> Any:
    """``asyncio.run`` on a loop of ``kind``."""
    uvloop = uvloop_module(kind)
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)
