"""tests/wait.py: the bounded waits the other tests use instead of sleeps."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.wait import async_wait_until, wait_until


def test_wait_until_returns_the_first_truthy_value():
    n = itertools.count()
    assert wait_until(lambda: next(n) >= 3 and "done", 5, "the counter") == "done"


def test_wait_until_names_what_it_waited_for_and_the_last_value():
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the answer \(last value \[\]\)"):
        wait_until(lambda: [], 0.05, "the answer")


def test_async_wait_until_lets_the_loop_run_and_times_out_clearly():
    async def main():
        box: list[int] = []
        asyncio.get_running_loop().call_soon(box.append, 1)
        assert await async_wait_until(lambda: box, 5, "the callback") == [1]
        with pytest.raises(AssertionError, match="waiting for nothing"):
            await async_wait_until(lambda: 0, 0.05, "nothing")

    asyncio.run(main())
