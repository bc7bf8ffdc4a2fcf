"""What every format's reader yields: one sample's undecoded bytes, or why it has none."""

from __future__ import annotations

import dataclasses

__all__ = ["RawSample", "os_error"]
assert __all__ == sorted(__all__)


@dataclasses.dataclass(frozen=True)
class RawSample:
    """Undecoded bytes of one sample and where they came from (for error reports)."""

    key: int
    label: int
    data: bytes | None
    where: str
    error: str | None = None  # set when the sample could not even be read: the detail
    reason: str | None = None  # and the reason, one of raypipe.skips.records.REASONS
    extras: dict | None = None  # with a user transform: the sample's other members/columns


def os_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
