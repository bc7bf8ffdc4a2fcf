"""Equal batch counts per epoch through the ledger, with ranks that lose rows to skips."""

from __future__ import annotations

import random
import threading
import time

import pytest

from raypipe.loader.ledger import EpochLedger, Gate, create_ledger


def test_ledger_answers_the_least_sure_and_the_least_final_rows():
    ledger = EpochLedger(3)
    assert ledger.report("a", 0, 0, 10, False) == (0, float("inf"), None)
    ledger.report("a", 0, 1, 12, False)
    assert ledger.report("a", 0, 2, 7, True) == (7, 7, None)
    assert ledger.report("a", 0, 0, 9, False) == (7, 7, None)  # counts only grow
    assert ledger.report("b", 0, 0, 1, False) == (0, float("inf"), None)  # another group
    ledger.report("a", 5, 0, 1, False)
    assert ("a", 0) not in ledger._rows  # old epochs are forgotten


def run_ranks(ledger, group: str, good: list[int], batch_size: int, planned: int):
    """Each rank receives its good rows in random-sized blocks at random times and
    yields every batch the gate allows; returns the batches yielded per rank."""
    yielded = [0] * len(good)

    def rank(r: int) -> None:
        rng = random.Random(r * 7919 + len(group))
        gate = Gate(ledger, group, r, batch_size)
        gate.start(0, planned)
        have, k = 0, 0
        while have < good[r]:
            n = min(rng.randint(1, 2 * batch_size), good[r] - have)
            have += n
            gate.add(n, done=have == good[r])
            time.sleep(rng.random() * 0.003)
            while (k + 1) * batch_size <= have and gate.allows(k):
                k += 1
        gate.add(0, done=True)
        while (k + 1) * batch_size <= have and gate.allows(k):
            k += 1
        yielded[r] = k

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return yielded


@pytest.mark.parametrize("trial", range(6))
def test_every_rank_yields_min_good_rows_over_batch_size(ray_session, trial):
    rng = random.Random(trial)
    world, batch_size, planned = rng.choice([2, 3, 4]), rng.choice([3, 8]), 60
    good = [planned - rng.choice([0, 0, 1, 5, 17]) for _ in range(world)]
    ledger = create_ledger(world)
    yielded = run_ranks(ledger, f"t{trial}", good, batch_size, planned)
    assert yielded == [min(good) // batch_size] * world, (good, yielded)


def test_one_rank_needs_no_ledger():
    gate = Gate(None, "", 0, 4)
    gate.start(0, 10)
    gate.add(8, done=True)
    assert gate.allows(0) and gate.allows(1)
    assert not gate.allows(2)  # 12 > 10 planned rows


def _waiting_on_rank_1(run: str):
    """Two ranks' gates of a new ledger; rank 0, holding 12 rows, waits in a thread for
    batch 0, which waits on rank 1 (it has sent nothing). Returns the gates, the thread
    and the list its outcome goes to (the answer, or the error raised)."""
    ledger = create_ledger(2)
    gates = [Gate(ledger, run, r, 4) for r in range(2)]
    for gate in gates:
        gate.start(0, 40)
    gates[0].add(12)
    outcome = []

    def wait() -> None:
        try:
            outcome.append(gates[0].allows(0))
        except Exception as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert outcome == []  # still waiting for rank 1
    return gates, waiter, outcome


def test_a_rank_waiting_on_a_peer_that_failed_raises_the_peers_error(ray_session):
    gates, waiter, outcome = _waiting_on_rank_1("failing")
    gates[1].fail(ValueError("bad sample x (key 3): truncated_image"))
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "the rank kept waiting on a peer that stopped"
    assert isinstance(outcome[0], ValueError) and "key 3" in str(outcome[0])


def test_a_rank_waiting_on_a_peer_ends_when_it_closes(ray_session):
    """A peer that closed before it reported sends nothing: the waiting rank's own close
    ends its wait (its feeder thread), where it waited for good."""
    from raypipe.loader.ledger import GateClosed

    gates, waiter, outcome = _waiting_on_rank_1("closing")
    gates[0].close()
    waiter.join(timeout=5)
    assert not waiter.is_alive(), "the rank kept waiting after it closed"
    assert isinstance(outcome[0], GateClosed)


def test_a_ledger_made_for_another_world_size_is_refused_at_once(ray_session, datasets):
    """``Pipeline.ledger(3)`` given to a 2-rank run: its ranks would wait forever on a third
    (the other way round, a rank's report failed inside the actor)."""
    from raypipe import Pipeline, PipelineConfig

    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=4)
    for made, world in ((3, 2), (2, 3)):
        with pytest.raises(
            ValueError, match=f"made for {made} ranks, this run has world_size={world}"
        ):
            Pipeline(config, epochs=1, world_size=world, rank=0, ledger=Pipeline.ledger(made))


def test_join_names_the_first_disagreement_and_fails_the_run():
    ledger = EpochLedger(2)
    same = {"batch_size": "4", "seed": "0"}
    assert ledger.join("a", 0, 2, same) == (1, None)
    count, failed = ledger.join("a", 1, 2, {**same, "seed": "1"})
    assert count == 1 and "rank 1 has seed=1, rank 0 seed=0" in str(failed)
    assert ledger.report("a", 0, 0, 4, False)[2] is failed  # a waiting rank raises it too
    for rank, world, why in ((1, 3, "rank 1 has world_size=3, the ledger's ranks 2"),
                             (0, 2, "two ranks have rank=0"),
                             (0, 2, "two Loaders on one ledger, each their own group=")):  # fmt: skip
        fresh = EpochLedger(2)
        fresh.join("b", 0, 2, same)
        assert why in str(fresh.join("b", rank, world, same)[1])
    fresh = EpochLedger(2)
    assert fresh.join("c", 1, 2, same) == (1, None) and fresh.join("c", 0, 2, same) == (2, None)
    assert fresh.leave("c", 0) == 1 and fresh.leave("c", 0) == 1 and fresh.leave("c", 1) == 0


def test_64_ranks_with_bad_samples_yield_equal_counts(ray_session):
    """64 ranks, each reading its own keys in random blocks with some bad, each holding a
    random number of rows ahead (0 to 24 batches): the rarer reports still end every rank
    at the same batch, the fewest full batches any rank's good keys make. (Which keys a
    batch holds is this test's own doing, not the ledger's: exactly once is the pipeline
    tests' property, `tests/properties.py`.)"""
    world, batch_size, planned = 64, 4, 96
    rng = random.Random(32)
    bad = [set(rng.sample(range(planned), rng.choice([0, 0, 0, 1, 3, 9]))) for _ in range(world)]
    ledger = create_ledger(world)
    out: list[list[int]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        local = random.Random(r)
        good = [r * planned + i for i in range(planned) if i not in bad[r]]
        lead = local.randint(0, 24) * batch_size  # rows pulled ahead of the batch asked for
        gate = Gate(ledger, "wide", r, batch_size, ahead=local.choice([1, 2, 4]))
        gate.start(0, planned)
        have = k = 0
        while True:
            while have < len(good) and have < (k + 1) * batch_size + lead:
                n = min(local.randint(1, 2 * batch_size), len(good) - have)
                have += n
                gate.add(n, done=have == len(good))
            if have == len(good):
                gate.add(0, done=True)
            if (k + 1) * batch_size > have or not gate.allows(k):
                break
            out[r].extend(good[k * batch_size : (k + 1) * batch_size])
            k += 1
            time.sleep(local.random() * 0.002)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    n = min(planned - len(b) for b in bad) // batch_size
    assert [len(keys) for keys in out] == [n * batch_size] * world
    assert n < (planned - 1) // batch_size  # some rank lost a batch to its bad keys
