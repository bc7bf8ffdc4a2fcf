"""The skip budget: how many of an epoch's samples may be bad before the run stops.

``PipelineConfig.max_skipped`` is a share of the epoch's samples (all ranks' when they share
one `raypipe.SkipLog`). The actors check it each time they send skips to the log, against
the log's running total, so a run stops as soon as an epoch is certain to pass it: after
the first blocks when a column or a label convention is wrong, never from a bad shard that
happens to be read early. An epoch with every sample bad always fails, whatever the setting.
"""

from __future__ import annotations

from typing import Any

from raypipe.skips.records import one_line

__all__ = ["SkipBudgetError", "check_budget", "skip_limit"]
assert __all__ == sorted(__all__)


class SkipBudgetError(RuntimeError):
    """More of an epoch's samples are bad than ``PipelineConfig.max_skipped`` allows.

    Raised by the actor whose skips pass the limit, as soon as they do (the count is the
    epoch's so far); the message names the count, the top reasons and one bad sample.
    Survives Ray's error wrapping, like `SampleError`; ``args`` is the message alone.
    """

    def __init__(self, message: str, skipped: int = 0, by_reason: dict | None = None):
        super().__init__(message)
        self.skipped, self.by_reason = skipped, dict(by_reason or {})

    def __reduce__(self):
        return (SkipBudgetError, (self.args[0], self.skipped, self.by_reason))

    def __str__(self) -> str:  # one line, without what Ray Data appends on the way
        return str(self.args[0]).split("\n", 1)[0] if self.args else ""

    @classmethod
    def of(cls, epoch: int, samples: int, limit: int, max_skipped: float | None,
           report: dict[str, Any]) -> SkipBudgetError:  # fmt: skip
        by_reason = report.get("by_reason", {})
        top = ", ".join(f"{r} {n}" for r, n in sorted(by_reason.items(), key=lambda kv: -kv[1])[:3])
        records = report.get("records") or []
        example = (f"; e.g. {one_line(records[0]['where'])}: {records[0]['reason']}: "
                   f"{one_line(records[0]['detail'])}" if records else "")  # fmt: skip
        allowed = (
            "max_skipped=None allows any share but all"
            if max_skipped is None
            else f"max_skipped={max_skipped:g} allows {limit}"
        )
        skipped = report.get("skipped", 0)
        return cls(
            f"epoch {epoch}: {skipped} of its {samples} samples skipped as bad so far "
            f"({allowed}); top reasons: {top}{example}. Fix the data or the settings that "
            "read it (format, image_column, label_column, label_member, label_key), or raise "
            "max_skipped; `raypipe inspect SOURCE` shows what is read",
            skipped, by_reason,
        )  # fmt: skip


def skip_limit(samples: int, max_skipped: float | None) -> int:
    """The most skips an epoch of ``samples`` may have: never all of them."""
    if max_skipped is None:
        return samples - 1
    # a float product falls just short of the whole number meant, by a relative 1e-16 or
    # so: 0.29 * 3e9 = 869999999.99..., 3 * (1/3) = 0.99...; a relative 1e-12 allows it
    return min(samples - 1, int(max_skipped * samples * (1 + 1e-12) + 1e-9))


def check_budget(total: int, *, epoch: int, samples: int, max_skipped: float | None,
                 skips) -> None:  # fmt: skip
    """Raise `SkipBudgetError` when ``total`` skips are more than an epoch of ``samples``
    may have (``skips`` is the epoch's `raypipe.SkipLog`, for the error's report)."""
    limit = skip_limit(samples, max_skipped)
    if total > limit:
        raise SkipBudgetError.of(epoch, samples, limit, max_skipped, skips.report())
