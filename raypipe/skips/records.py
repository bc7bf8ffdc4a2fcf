"""Why a sample was dropped: the reasons, one dropped sample's record, the ``"raise"`` error,
and the sorting of a decoder's exception into a reason.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BadSample", "DECODE_REASONS", "REASONS", "SampleError", "SkipRecord", "detail_of",
           "out_of_memory", "reason_of"]  # fmt: skip
assert __all__ == sorted(__all__)

# Why a sample was dropped: the keys of ``counts()``.
REASONS = (
    "bad_audio",  # an audio member libsndfile cannot decode (samples with no image)
    "bad_checksum",  # a TFRecord record whose CRC32C fails (its file and byte offset)
    "bad_label",  # a label that is not an integer, or outside the named classes
    "bad_record",  # a record that is not a tf.train.Example, an LMDB value not pickle/msgpack
    "decode_error",  # the decoder failed for another reason
    "decompression_bomb",  # more pixels than PipelineConfig.max_image_pixels
    "empty_file",  # zero bytes
    "missing_column",  # a Parquet column, TFRecord feature, LMDB or HDF5 field that is missing
    "missing_label",  # a WebDataset sample without its .cls member
    "not_an_image",  # bytes no decoder recognises (text, random bytes, ...)
    "null_value",  # a Parquet row whose image or label is null
    "transform_error",  # the user's transform (PipelineConfig.transform) raised
    "truncated_image",  # the image data ends early
    "truncated_shard",  # a tar or TFRecord shard that ends early; its lost tail is one sample
    "unreadable",  # the file or member could not be read (permissions, vanished, I/O)
    "unreadable_shard",  # a shard that could not be opened or read to its end
    "wrong_type",  # a column, feature or dataset of the wrong type
)

# what decoding a sample's bytes can find wrong (`reason_of`); the others are a reader's
DECODE_REASONS = ("decode_error", "decompression_bomb", "empty_file", "not_an_image",
                  "truncated_image")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SkipRecord:
    """One dropped sample: its key, where it came from (path, or shard:member), why."""

    key: int
    where: str
    reason: str
    detail: str


class BadSample(Exception):
    """Raised inside the pipeline for a sample known to be bad, with its reason."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        detail = one_line(detail)  # a transform's own message may run over lines
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail

    def __str__(self) -> str:
        return self.detail


class SampleError(RuntimeError):
    """A sample could not be read or decoded under ``on_error="raise"``.

    The message names the file (and member, for shards), the key and the reason; it
    survives Ray's error wrapping (``RayTaskError(SampleError)`` is still a SampleError).
    """

    def __init__(self, where: str, key: int, reason: str, detail: str):
        super().__init__(where, key, reason, detail)
        self.where, self.key, self.reason, self.detail = where, key, reason, detail

    def __str__(self) -> str:
        return f"bad sample {self.where} (key {self.key}): {self.reason}: {self.detail}"


def reason_of(error: BaseException, data: bytes | None = None) -> str:
    """Sort a decoder's exception into one of `REASONS`."""
    from PIL import Image, UnidentifiedImageError

    reason = getattr(error, "reason", None)
    if reason in REASONS:
        return reason
    if data is not None and len(data) == 0:
        return "empty_file"
    if isinstance(error, Image.DecompressionBombError):
        return "decompression_bomb"
    if isinstance(error, UnidentifiedImageError):
        return "not_an_image"
    if isinstance(error, (TimeoutError, ConnectionError)) or (
        isinstance(error, OSError) and (error.errno is not None or error.filename is not None)
    ):  # the system's error reading the file (not a decoder's): before the message, its path
        return "unreadable"
    message = str(error).lower()
    if "truncated" in message or "premature end" in message:
        return "truncated_image"
    return "decode_error"


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the process ran out of memory, which says nothing about the
    sample: Python's ``MemoryError`` (NumPy's too), or OpenCV's error -4 ("Insufficient
    memory"), which `reason_of` would call a ``decode_error``."""
    if isinstance(error, MemoryError):
        return True
    return type(error).__module__.startswith("cv2") and getattr(error, "code", None) == -4


def detail_of(error: BaseException, data: bytes | None = None) -> str:
    """A one-line description of what went wrong, for the record and the error."""
    from PIL import UnidentifiedImageError

    if isinstance(error, BadSample):
        return error.detail
    if isinstance(error, UnidentifiedImageError) and data is not None:
        return f"no decoder recognises the data (it starts {bytes(data[:8])!r})"
    return one_line(f"{type(error).__name__}: {error}")


def one_line(text: object) -> str:
    """``text`` with each run of whitespace, newlines included, one space."""
    return " ".join(str(text).split())
