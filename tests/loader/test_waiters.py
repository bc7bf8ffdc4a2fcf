"""The ledger holds an answer until what the rank asked for is settled (one reply, no polls)."""

import asyncio

import pytest

from raypipe.loader import waiters
from raypipe.loader.ledger import EpochLedger


def test_an_answer_is_held_until_every_rank_reported_the_rows_asked_for():
    async def run():
        ledger = EpochLedger(3)
        first = asyncio.create_task(ledger.settle("a", 0, 0, 40, False, 32))
        second = asyncio.create_task(ledger.settle("a", 0, 1, 36, False, 32))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()  # rank 2 has sent nothing
        third = await ledger.settle("a", 0, 2, 44, False, 32)  # the round's last report
        assert third == (36, float("inf"), None)  # settled at once, fresh
        assert await first == await second == (36, float("inf"), None)

    asyncio.run(run())


def test_a_held_answer_ends_with_a_finished_rank_a_failure_or_the_wait():
    async def run():
        ledger = EpochLedger(2)
        short = asyncio.create_task(ledger.settle("a", 0, 0, 40, False, 32))
        await asyncio.sleep(0.01)
        assert await ledger.settle("a", 0, 1, 20, True, 20) == (20, 20, None)
        assert await short == (20, 20, None)  # the epoch ends below 32: said at once
        failing = asyncio.create_task(ledger.settle("b", 0, 0, 8, False, 8))
        await asyncio.sleep(0.01)
        ledger.fail("b", ValueError("bad shard"))
        assert isinstance((await failing)[2], ValueError)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await ledger.settle("c", 0, 0, 8, False, 8) == (0, float("inf"), None)
        assert loop.time() - t0 == pytest.approx(waiters.WAIT_S, abs=0.2)  # then asks again

    asyncio.run(run())
