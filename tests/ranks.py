"""Ranks of one `raypipe.Pipeline` run as threads of this process, for the tests."""

from __future__ import annotations

import threading
import time

from raypipe import Pipeline


def in_threads(rank, world: int, *, timeout: float) -> None:
    """Run ``rank(r)`` for r in 0..world-1, one thread each; fail if one outlives ``timeout``."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"


def run_ranks(config, world: int, epochs: int, *, pause_s=(0.0,), skips=None,
              keys_only: bool = False, **kw):  # fmt: skip
    """Every epoch of ``world`` ranks (one thread each, rank r sleeping
    ``pause_s[r % len(pause_s)]`` after each batch, or calling it with the rank and the
    batch where it is callable): ``out[rank][epoch]`` is the list of
    that epoch's batches (numpy; with ``keys_only``, their keys as lists), and
    ``stats[rank][epoch]`` the epoch's ``stats()``."""
    ledger = Pipeline.ledger(world) if world > 1 else None
    out = [[[] for _ in range(epochs)] for _ in range(world)]
    stats = [[None] * epochs for _ in range(world)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pipe = Pipeline(config, epochs=epochs, rank=r, world_size=world, ledger=ledger,
                            device="cpu", skips=skips, **kw)  # fmt: skip
            for epoch, batches in pipe.epochs():
                for batch in batches:
                    out[r][epoch].append(
                        batch["key"].tolist()
                        if keys_only
                        else {
                            k: v.numpy().copy() if hasattr(v, "numpy") else list(v)
                            for k, v in batch.items()
                        }  # fmt: skip
                    )
                    pause = pause_s[r % len(pause_s)]
                    pause(r, batch) if callable(pause) else time.sleep(pause)
                stats[r][epoch] = batches.stats()
        except BaseException as e:
            errors.append(e)

    in_threads(rank, world, timeout=300)
    if errors:
        raise errors[0]
    return out, stats
