"""Requests made in one turn of the event loop leave as one call, each caller gets its own results,
a refused merged call fails only the caller whose items it refused, and no request waits for
company."""

from __future__ import annotations

import asyncio

import pytest

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.coalesce import Coalescer


class Callee:
    """Doubles each item; refuses a call holding a negative item, as a service refuses a bad batch."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[list[int]] = []
        self.delay_s = delay_s

    async def __call__(self, items: list[int], timeout_s: float) -> list[int]:
        self.calls.append(items)
        await asyncio.sleep(self.delay_s)
        if any(item < 0 for item in items):
            raise InvalidArgument.field("items", "holds a negative item")
        return [2 * item for item in items]


async def test_requests_of_one_turn_share_a_call_and_get_their_own_results_in_order() -> None:
    callee = Callee()
    coalescer = Coalescer(callee, max_items=100)

    results = await asyncio.gather(coalescer([1, 2], 5), coalescer([3], 5), coalescer([4, 5, 6], 5))

    assert results == [[2, 4], [6], [8, 10, 12]]
    assert callee.calls == [[1, 2, 3, 4, 5, 6]]
    assert coalescer.calls == 1


async def test_a_request_alone_leaves_on_the_next_turn() -> None:
    callee = Callee(delay_s=10)
    coalescer = Coalescer(callee, max_items=100)

    request = asyncio.ensure_future(coalescer([7], 5))
    for _ in range(3):  # the request's task, the send, the call's task
        await asyncio.sleep(0)

    assert callee.calls == [[7]]
    request.cancel()


async def test_a_request_made_while_a_call_is_in_flight_does_not_wait_for_it() -> None:
    callee = Callee(delay_s=0.2)
    coalescer = Coalescer(callee, max_items=100)

    first = asyncio.ensure_future(coalescer([1], 5))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(coalescer([2], 5))
    await asyncio.sleep(0.05)

    assert callee.calls == [[1], [2]] and not first.done()  # sent while the first is in flight
    assert await first == [2]
    assert await second == [4]


async def test_calls_hold_at_most_max_items_and_spread_over_the_callees_up() -> None:
    callee = Callee()
    coalescer = Coalescer(callee, max_items=4)

    results = await asyncio.gather(*(coalescer([i, i], 5) for i in range(5)))

    assert results == [[2 * i, 2 * i] for i in range(5)]
    assert sorted(map(len, callee.calls)) == [2, 4, 4]

    spread = Callee()
    over_three = Coalescer(spread, max_items=100, parallel=lambda: 3)
    await asyncio.gather(*(over_three([i], 5) for i in range(6)))
    assert sorted(map(len, spread.calls)) == [2, 2, 2]


async def test_a_refused_merged_call_fails_only_the_caller_whose_items_it_refused() -> None:
    callee = Callee()
    coalescer = Coalescer(callee, max_items=100)

    good, bad, other = await asyncio.gather(
        coalescer([1], 5), coalescer([-1], 5), coalescer([3], 5), return_exceptions=True
    )

    assert (good, other) == ([2], [6])
    assert isinstance(bad, InvalidArgument)
    assert callee.calls == [[1, -1, 3], [1], [-1], [3]]  # refused together, then one by one


async def test_a_caller_cancelled_before_its_call_leaves_is_not_in_it() -> None:
    callee = Callee()
    coalescer = Coalescer(callee, max_items=100)

    cancelled = asyncio.ensure_future(coalescer([1], 5))
    kept = asyncio.ensure_future(coalescer([2], 5))
    await asyncio.sleep(0)  # both requests are pending, the send is the next turn's
    cancelled.cancel()

    assert await kept == [4]
    assert callee.calls == [[2]]
    with pytest.raises(asyncio.CancelledError):
        await cancelled


async def test_closing_cancels_the_calls_in_flight() -> None:
    coalescer = Coalescer(Callee(delay_s=10), max_items=100)
    request = asyncio.ensure_future(coalescer([1], 5))
    await asyncio.sleep(0.05)

    coalescer.close()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(request, 1)
