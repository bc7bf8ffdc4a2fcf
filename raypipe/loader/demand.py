"""What a rank's trainer asks of its pool: the running totals its feeder keeps, which the
pool's policy (`raypipe.pool.follow.Follower`) and the progress line read."""

from __future__ import annotations

__all__ = ["Demand"]
assert __all__ == sorted(__all__)


class Demand:
    """Running totals a rank's feeder keeps: seconds its consumer waited for a batch,
    seconds finished batches waited for the consumer (a full queue), rows handed out in
    all and in the ``epoch`` being read."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self.held_s = 0.0
        self.rows = 0
        self.epoch = -1
        self.epoch_rows = 0
