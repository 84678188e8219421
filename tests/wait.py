"""Wait on a condition with a bound, instead of sleeping and hoping.

``wait_until(pred, timeout_s, what)`` polls ``pred`` until it returns something truthy and returns
that value; after ``timeout_s`` seconds it raises AssertionError naming ``what`` and the last value
seen.  ``await async_wait_until(...)`` does the same on a running event loop (the loop keeps
running between polls, so tasks under test make progress).  The bound only limits how long a
broken test hangs: a passing test returns as soon as the condition holds, so the tests assert
states, never how long anything took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.005


def _timed_out(what: str, timeout_s: float, last: Any) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s} s waiting for {what} (last value {last!r})")


def wait_until(pred: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition", poll_s: float = POLL_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, last)
        time.sleep(poll_s)


async def async_wait_until(pred: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition",
                           poll_s: float = POLL_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, last)
        await asyncio.sleep(poll_s)
