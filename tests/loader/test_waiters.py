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


def test_asks_that_timed_out_leave_the_ledger():
    """1,023 ranks wait on a straggler at an epoch's tail, rank 0 done: each asks again
    every `WAIT_S`, its last ask timed out (`held` cancels it). The asks held stay about
    one per waiting rank: the timed-out ones were kept until their rows settled (40,920
    after 40 rounds), and every report scanned them all once a rank had finished."""

    async def run():
        world, b = 1024, 256
        ledger = EpochLedger(world)
        for r in range(world):
            ledger.report("g", 0, r, 100 * b if r < world - 1 else 10 * b, r == 0)
        for _ in range(40):
            for r in range(world - 1):
                ledger.report("g", 0, r, 100 * b, r == 0)  # settle: report, then hold
                ledger._waiters.hold(("g", 0), 11 * b).cancel()  # the answer timed out
        assert len(ledger._waiters._held[("g", 0)]) <= 4 * world

    asyncio.run(run())


def test_asks_above_a_later_rank_s_final_rows_end_there_too():
    """Each finished rank with fewer rows lowers where the epoch ends: asks held between
    the two ends are answered when the second rank finishes."""

    async def run():
        ledger = EpochLedger(3)
        ask = asyncio.create_task(ledger.settle("a", 0, 0, 64, False, 48))
        await asyncio.sleep(0.01)
        assert ledger.report("a", 0, 1, 56, True)[:2] == (0, 56)  # ends at 56: 48 waits on
        await asyncio.sleep(0.01)
        assert not ask.done()
        assert ledger.report("a", 0, 2, 40, True)[:2] == (40, 40)  # ends at 40 now
        assert await ask == (40, 40, None)

    asyncio.run(run())


def test_joins_and_leaves_are_answered_when_the_last_rank_comes_not_polled():
    """`joined` and `left` hold their answer until every rank joined (or left), the run
    failed, or `WAIT_S`: a rank waiting on its peers sends one message a wait, where it
    polled every 50-200 ms (20,000 calls a second to one actor at 1,024 ranks)."""

    async def run():
        ledger, same = EpochLedger(3), {"seed": "0"}
        ledger.join("a", 0, 3, same)
        waiting = asyncio.create_task(ledger.joined("a"))
        await asyncio.sleep(0.05)
        ledger.join("a", 1, 3, same)
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert ledger.join("a", 2, 3, same) == (3, None)
        assert await asyncio.wait_for(waiting, 0.2) == (3, None)
        assert ledger.leave("a", 0) == 2
        leaving = asyncio.create_task(ledger.left("a"))
        await asyncio.sleep(0.05)
        assert ledger.leave("a", 1) == 1 and not leaving.done()
        assert ledger.leave("a", 2) == 0 and await asyncio.wait_for(leaving, 0.2) == 0
        stopped = asyncio.create_task(ledger.joined("b"))
        await asyncio.sleep(0.05)
        ledger.fail("b", ValueError("bad shard"))
        assert isinstance((await asyncio.wait_for(stopped, 0.2))[1], ValueError)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await ledger.joined("c") == (0, None)
        assert loop.time() - t0 == pytest.approx(waiters.WAIT_S, abs=0.2)  # then asks again

    asyncio.run(run())


def test_ranks_in_step_report_about_once_per_lead(ray_session):
    """16 ranks in step (a barrier per 20 ms step, as DDP's gradient exchange makes them),
    each 20 batches ahead: each round of reports settles about the whole lead, so a rank
    sends a report every ~15 batches (a spread of thresholds and answers on arrival: every
    ~7). The step is far longer than a round of 16 reports takes the actor."""
    import threading
    import time

    from raypipe.loader.ledger import Gate, create_ledger

    world, batch, lead, steps = 16, 4, 20, 90
    ledger = create_ledger(world)
    gates = [Gate(ledger, "step", r, batch) for r in range(world)]
    barrier = threading.Barrier(world, timeout=60)
    yielded = [0] * world

    def rank(r: int) -> None:
        gate = gates[r]
        gate.start(0, (steps + lead) * batch)
        gate.add(lead * batch)
        for k in range(steps):
            gate.add(batch)
            assert gate.allows(k)
            yielded[r] += 1
            time.sleep(0.02)  # the train step
            barrier.wait()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert yielded == [steps] * world
    reports = [g.reports for g in gates]
    # Alone this gives about one report per 15 batches (<= 11 here), but after other tests
    # on the same Ray it gave 12 in some runs: the bound is what holds in every order, far
    # below a report per batch; benchmarks/scale.py measures the rate.
    assert max(reports) <= 2 + steps // 6, reports  # the epoch's first report, then rounds
