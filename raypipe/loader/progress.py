"""Live progress of a long run: one line every ``every_s`` seconds from a rank's feeder.

```
raypipe rank 0 epoch 1: 3,072/6,144 samples  1,540 samples/s  wait 2%  actors 3 (target 3 of 1-4)
```

With the decoded cache on, the line ends with its hits, the bytes it holds and the read +
decode seconds it saved, over the run and all nodes (``cache 9,216 hits 812 MiB saved 14 s``),
and once its budget is full, the samples decoded since that it could not keep (``, 3,100
decoded past its budget``): those are decoded again every epoch.

The samples are the rank's batches handed to its trainer so far this epoch, of the planned
rows; samples/s and the trainer's wait (share of the time it waited for a batch) are over
the last interval; the actors are the rank's pool as its `raypipe.pool.follow.Follower` last saw
it. Ray Data's own progress bars stay off for a rank's execution: they would describe one
rank's internal dataset, and need tqdm.
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["ProgressLine"]


class ProgressLine:
    """A daemon thread printing ``line()`` every ``every_s`` seconds until ``close()``.

    Args:
        every_s: seconds between lines.
        rank: named in each line.
        demand: the rank's `raypipe.loader.demand.Demand` (rows handed out, seconds waited).
        planned: ``planned(epoch)``, the rank's planned rows of an epoch.
        follower: the rank's `raypipe.pool.follow.Follower`, or None (no pool line).
        cache: returns the decoded cache's counters (`Pipeline.cache_stats`), or None.
        out: where the lines go (stderr).
    """

    def __init__(self, every_s: float, *, rank: int, demand, planned, follower=None,
                 out=None, cache=None):  # fmt: skip
        self.every_s, self.rank, self.demand, self._cache = every_s, rank, demand, cache
        self._planned, self._follower = planned, follower
        self._out = out if out is not None else sys.stderr
        self._last = (time.monotonic(), demand.rows, demand.waited_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raypipe-progress", daemon=True)
        self._thread.start()

    def line(self) -> str:
        d = self.demand
        now, rows, waited = time.monotonic(), d.rows, d.waited_s
        t0, rows0, waited0 = self._last
        self._last = (now, rows, waited)
        dt = max(now - t0, 1e-9)
        planned = self._planned(d.epoch) if d.epoch >= 0 else 0
        text = (f"raypipe rank {self.rank} epoch {max(d.epoch, 0)}: {d.epoch_rows:,}/"
                f"{planned:,} samples  {(rows - rows0) / dt:,.0f} samples/s  "
                f"wait {min((waited - waited0) / dt, 1.0):.0%}")  # fmt: skip
        f = self._follower
        if f is not None and f.in_charge:
            text += f"  actors {f.actors} (target {f.target} of {f.lo}-{f.hi})"
        c = self._cache() if self._cache is not None else None
        if c:
            text += (f"  cache {c['hits']:,} hits {c['bytes'] / 2**20:,.0f} MiB "
                     f"saved {c['saved_s']:,.0f} s")  # fmt: skip
            if c.get("refused"):  # the budget is full: these decode again every epoch
                text += f", {c['refused']:,} decoded past its budget"
        return text

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            # written, not print()ed: in a Ray Train worker print() both writes the line
            # and logs it, and the driver showed every line twice
            self._out.write(self.line() + "\n")
            self._out.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
