"""Pipeline checkpoints: which keys of the current epoch the trainers already consumed.

A checkpoint is one bit per sample (the keys delivered to a train step this epoch),
deflated, and a small header (epoch, seed, sample count, dataset fingerprint). Ranks
consume their slices in order, so the bits run in long stretches: at 10⁹ samples in 10⁵
shards, 1,024 ranks 40 % into an epoch write 0.27 MiB, not the 119 MiB of the raw bits
(`benchmarks/scale.py`); bits with no order at all stay about N/8 bytes. Keys are dense
``0..N-1`` (`raypipe.plan.shards`), so it does not depend on the world size or the actor
pool: any number of ranks can resume from it.

```
 rank r: Delivered  ── keys of each batch handed to the consumer (not the prefetched ones)
   ▼ state_dict()["keys"]
 merge_states(states, num_samples, base)  ── OR over ranks (+ the keys consumed before a resume)
   ▼ PipelineState.save(path)             ── header + deflated packbits
 resume: build_dataset(config, epoch=e, consumed=state.consumed)
   ── fully consumed shards are not listed, consumed members of the others are not read
```
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Iterable

import numpy as np

from raypipe.plan.shards import Listing

__all__ = ["PipelineState", "merge_states"]
assert __all__ == sorted(__all__)

STATE_FILE = "raypipe_state.bin"
_MAGIC = b"RAYPIPE1"
_LEVEL = 6  # zlib's default: 0.3 s for 10⁹ bits, 40 % of level 1's size on ordered bits


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineState:
    """Where an interrupted run stands: in ``epoch``, the keys marked in ``consumed``.

    Attributes:
        epoch: the epoch to resume; an epoch-end checkpoint names the next one.
        seed: ``PipelineConfig.seed`` of the run (per-epoch order and augmentation).
        num_samples: keys in the dataset, ``len(consumed)``.
        fingerprint: the `Listing.fingerprint` of the shards the keys refer to.
        consumed: bool per key, True when a train step already got that sample.
    """

    epoch: int
    seed: int
    num_samples: int
    fingerprint: str
    consumed: np.ndarray

    def __post_init__(self) -> None:
        if self.consumed.dtype != np.bool_ or self.consumed.shape != (self.num_samples,):
            raise ValueError(
                f"consumed must be a bool array of shape ({self.num_samples},), "
                f"got {self.consumed.dtype} {self.consumed.shape}"
            )

    def to_bytes(self) -> bytes:
        """The state as `save` writes it: magic, header, deflated bits (`raypipe.Loader`
        carries these bytes in its ``state_dict()``)."""
        fields = {k: getattr(self, k) for k in ("epoch", "seed", "num_samples", "fingerprint")}
        header = json.dumps({**fields, "bits": "deflate"}).encode()
        bits = zlib.compress(np.packbits(self.consumed), _LEVEL)
        return b"".join((_MAGIC, len(header).to_bytes(4, "little"), header, bits))

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "the data") -> PipelineState:
        """The state `to_bytes` made; ValueError naming ``source`` for anything else."""
        if not data.startswith(_MAGIC):
            raise ValueError(f"{source} is not a raypipe pipeline checkpoint")
        try:
            size = int.from_bytes(data[8:12], "little")
            header = json.loads(data[12 : 12 + size])
            bits = memoryview(data)[12 + size :]
            if header.pop("bits", None) == "deflate":
                bits = zlib.decompress(bits)
            if len(bits) != (header["num_samples"] + 7) // 8:  # unpackbits pads with zeros
                raise ValueError(f"{len(bits)} bytes of bits for {header['num_samples']} samples")
            consumed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8),
                                     count=header["num_samples"]).astype(bool)  # fmt: skip
            return cls(consumed=consumed, **header)
        except (ValueError, TypeError, KeyError, AttributeError, zlib.error) as e:  # cut short
            raise ValueError(f"{source} is a damaged raypipe pipeline checkpoint "
                             f"({type(e).__name__}: {e})") from None  # fmt: skip

    def save(self, path: str | os.PathLike) -> int:
        """Write the state atomically (temp file + rename); returns the bytes written."""
        data = self.to_bytes()
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return len(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PipelineState:
        """Read a state file, or the one inside a checkpoint directory."""
        if os.path.isdir(path):
            path = os.path.join(path, STATE_FILE)
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), source=repr(str(path)))

    def check(self, listing: Listing, seed: int) -> None:
        """Refuse to resume on other data or another seed (the keys would mean other samples)."""
        if self.num_samples != listing.num_samples:
            raise ValueError(
                f"the checkpoint has num_samples={self.num_samples}, "
                f"the source lists {listing.num_samples}"
            )
        if self.fingerprint != listing.fingerprint:
            raise ValueError(
                f"the checkpoint's dataset fingerprint {self.fingerprint!r} is not the "
                f"source's {listing.fingerprint!r}: its shards changed"
            )
        if self.seed != seed:
            raise ValueError(f"the checkpoint has seed={self.seed}, the config {seed=}")


def merge_states(
    states: Iterable[dict], num_samples: int, base: np.ndarray | None = None
) -> np.ndarray:
    """The consumed-key mask of all ranks: OR of their ``state_dict()["keys"]`` and ``base``."""
    consumed = np.zeros(num_samples, dtype=bool) if base is None else base.copy()
    for state in states:
        keys = np.asarray(state["keys"], dtype=np.int64)
        if len(keys) and (keys.min() < 0 or keys.max() >= num_samples):
            raise ValueError(f"a key outside 0..{num_samples - 1} in a rank state: {keys!r}")
        consumed[keys] = True
    return consumed
