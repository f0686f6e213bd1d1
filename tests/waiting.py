"""Waiting for something a server does on its own, when no reply tells the test when."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

WAIT_S = 5.0


async def wait_until(
    what: str, condition: Callable[[], Awaitable[bool] | bool], timeout_s: float = WAIT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if callable(result):  # a factory of the check passed where the check was meant
            raise TypeError(f"the condition for {what} returned a function, not a truth value")
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
