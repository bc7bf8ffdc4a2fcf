"""The checks of a `raypipe.PipelineConfig`'s sample settings: no image, bucketing, packing,
audio. Each bad value or combination is one ValueError naming the field and its value."""

from __future__ import annotations

from raypipe.config.checks import is_int

__all__ = ["check_samples"]
assert __all__ == sorted(__all__)


def check_samples(c, bad) -> None:
    """``c``'s sample settings; ``bad(field, why)`` makes the ValueError."""
    _check_no_image(c, bad)
    _check_buckets(c, bad)
    _check_pack(c, bad)
    if c.sample_rate is not None and (not is_int(c.sample_rate) or c.sample_rate < 1):
        raise bad("sample_rate", "must be an integer >= 1 (Hz), or None to keep the file's")
    if c.sample_rate is not None and c.image_column is not None:
        raise bad("sample_rate", "resamples the audio members of samples without an image "
                  "(image_column=None); image samples' members are left as bytes")  # fmt: skip


def _check_no_image(c, bad) -> None:
    if c.image_column is not None:
        return
    if c.decode != "cpu":
        raise bad("decode", "decodes images; samples with image_column=None have none")
    if c.transform_input != "numpy":
        raise bad("transform_input", "is the image's form; samples with image_column=None "
                  "have no image")  # fmt: skip


def _check_field(c, bad, name: str) -> None:
    value = getattr(c, name)
    if value is not None and (not isinstance(value, str) or not value):
        raise bad(name, "must be a field name, or None")


def _check_buckets(c, bad) -> None:
    _check_field(c, bad, "bucket_by")
    buckets = c.buckets
    if is_int(buckets):
        if buckets < 1:
            raise bad("buckets", "must be a count >= 1 or ascending bucket edges")
    elif not (isinstance(buckets, tuple) and buckets and all(is_int(b) and b >= 1 for b in buckets)
              and all(a < b for a, b in zip(buckets[:-1], buckets[1:], strict=True))):  # fmt: skip
        raise bad("buckets", "must be a count >= 1 or ascending bucket edges (lengths >= 1)")
    if not is_int(c.bucket_window) or c.bucket_window < 1:
        raise bad("bucket_window", "must be an integer >= 1 (batches sorted together)")
    if c.bucket_by is None:
        return
    if c.image_column is not None and c.transform is None:
        raise bad("bucket_by", "needs samples with variable-length fields: image_column=None "
                  "or a transform")  # fmt: skip
    if c.shuffle_buffer:
        raise bad("bucket_by", f"replaces the shuffle buffer (shuffle_buffer={c.shuffle_buffer})"
                  "; set one of them")  # fmt: skip


def _check_pack(c, bad) -> None:
    _check_field(c, bad, "pack")
    if c.seq_len is not None and (not is_int(c.seq_len) or c.seq_len < 1):
        raise bad("seq_len", "must be an integer >= 1 (tokens per packed row)")
    if c.pack is None:
        if c.seq_len is not None:
            raise bad("seq_len", "is the length of packed rows: set pack= too")
        return
    if c.seq_len is None:
        raise bad("pack", "needs seq_len= (tokens per packed row)")
    if c.bucket_by is not None:
        raise bad("pack", f"and bucket_by={c.bucket_by!r} exclude each other: packed rows "
                  "all have seq_len tokens")  # fmt: skip
    if c.image_column is not None:
        raise bad("pack", "packs token sequences: set image_column=None")
    if c.shuffle_buffer:
        raise bad("pack", f"packs documents in plan order; shuffle_buffer={c.shuffle_buffer} "
                  "must be 0")  # fmt: skip
