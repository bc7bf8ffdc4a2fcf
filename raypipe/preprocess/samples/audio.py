"""Audio members decoded in the actors: float32 samples and their rate, by ``soundfile``
(libsndfile: FLAC, WAV, OGG, and MP3 where the library has it), resampled when the config
names a rate.

The resampler is ``scipy.signal.resample_poly``: the rate ratio reduced to ``up / down``,
upsampled by ``up``, low-passed by a Kaiser-windowed FIR (its cut-off at the lower of the
two Nyquist rates) and downsampled by ``down``, along the time axis. Both libraries are
the optional ``audio`` extra (``pip install 'raypipe[audio]'``).
"""

from __future__ import annotations

import io
import math

import numpy as np

__all__ = ["AUDIO_EXTS", "decode_audio", "resample_audio"]
assert __all__ == sorted(__all__)

AUDIO_EXTS = ("flac", "mp3", "ogg", "wav")
_MISSING = "{} is not installed: pip install 'raypipe[audio]'"


def decode_audio(data: bytes, rate: int | None = None) -> tuple[np.ndarray, int]:
    """``(samples, sample_rate)``: float32 ``(frames,)`` for mono, ``(channels, frames)``
    otherwise; resampled to ``rate`` when it is set and differs. Bytes libsndfile cannot
    decode are a bad sample (``bad_audio``)."""
    try:
        import soundfile
    except ImportError as e:
        raise ImportError(_MISSING.format("soundfile")) from e
    from raypipe.skips.records import BadSample

    try:
        samples, found = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise BadSample("bad_audio", f"{type(e).__name__}: {e}") from e
    if samples.ndim == 2:
        samples = samples.T  # (channels, frames), as torchaudio lays it out
    if rate is not None and rate != found:
        samples, found = resample_audio(samples, found, rate), rate
    return np.ascontiguousarray(samples, dtype=np.float32), int(found)


def resample_audio(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """``samples`` (time on the last axis) from ``rate`` to ``to`` Hz, polyphase."""
    try:
        from scipy.signal import resample_poly
    except ImportError as e:
        raise ImportError(_MISSING.format("scipy")) from e
    g = math.gcd(rate, to)
    return resample_poly(samples, to // g, rate // g, axis=-1).astype(np.float32)
