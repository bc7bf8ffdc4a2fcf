"""`PipelineConfig`: every setting of one dataset's pipeline, checked at the edge."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from raypipe.config.checks import check_keys, load_yaml, python_scalars
from raypipe.config.loader import IMAGENET_MEAN, IMAGENET_STD, LoaderConfig
from raypipe.config.validate import validate

Format = Literal["imagefolder", "webdataset", "parquet", "tfrecord", "lmdb", "hdf5"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """One dataset's pipeline: where the shards are, how samples are made, how many actors.

    Args:
        source: a directory, a glob, a file, or a list of those; local, or URIs of object
            storage (``s3://bucket/prefix/``, ``gs://...``, any fsspec protocol).
        format: ``"imagefolder"``, ``"webdataset"``, ``"parquet"``, ``"tfrecord"``, ``"lmdb"``
            or ``"hdf5"`` (`raypipe.formats`); inferred from the file names when None.
        storage_options: settings of a remote source's file system, e.g. ``endpoint_url``,
            ``access_key``/``secret_key``, ``region``, ``anonymous`` for S3 (pyarrow's
            ``S3FileSystem`` names, or s3fs's); None: the environment and config files.
        image_column, label_column: Parquet columns of the image (binary, or a struct
            with ``bytes`` as Hugging Face ``datasets`` writes) and of the label
            (integers, or strings mapped through their sorted set); the TFRecord features,
            LMDB dict keys or HDF5 datasets of the image and the label (left at their
            defaults, each format's conventions are tried: docs/formats.md).
            ``image_column=None``: samples with no image (tokens, audio, tables): a sample
            is its fields, every Parquet column or WebDataset member
            (`raypipe.preprocess.samples`); see docs/samples.md.
        label_member: the WebDataset member holding the label: ``"cls"``, ``"txt"``
            (an integer) or ``"json"``; None: the first of those a sample has.
        label_key: the key of the label in a ``.json`` member.
        max_skipped: the share of an epoch's samples that may be skipped as bad; the run
            stops with an error as soon as more are certain to be. None: no limit, but an
            epoch with every sample skipped still fails.
        image_size: side of the square uint8 C×H×W image each sample becomes.
        train: random-resized-crop (+ flip) when True; resize + center crop when False.
        batch_size: rows per batch on each rank.
        actors: ``(min, max)`` size of the autoscaling preprocessing actor pool.
        seed: seeds the per-epoch file order and every sample's augmentation.
        on_error: ``"skip"`` drops and reports a bad sample; ``"raise"`` stops the epoch.
        flip: random horizontal flip in train mode (off for digits, text, ...).
        scale: area fraction range of random-resized-crop.
        ratio: aspect-ratio range of random-resized-crop.
        shuffle_files: shuffle the file order per epoch from ``(seed, epoch)``.
        shuffle_buffer: rows in each rank's local shuffle buffer (0 = off).
        files_per_task: samples one actor call reads and decodes: image-folder files, or
            a piece of one shard (WebDataset, Parquet, records: a longer shard is read in
            near-equal pieces); one call makes blocks of up to ``rows_per_block`` rows, and
            blocks of ``batch_size`` rows reach the trainer without a copy. None (the
            default): 256 files (65,536 samples of a shard), or fewer when
            the tasks one rank's pool has in flight would hold over 25 % of its share of
            the smallest object store (`raypipe.plan.blocksize`); a set value whose tasks
            cannot fit that share is refused before work.
        rows_per_block: samples per output block of the preprocessing actors; None (the
            default): ``batch_size``, or fewer when such a block would be over 5 % of one
            rank's share of the smallest node's object store (then about 2 %), so
            backpressure holds the data in the store instead of spilling it.
        actor_cpus: logical CPUs each preprocessing actor reserves.
        compute: ``"tasks"`` (the default): plain Ray tasks on Ray's pooled workers, at
            most ``actors[1]`` slots of each rank's share at once (two tasks in flight a
            slot), the workers warm from one run to the next (`raypipe.preprocess.tasks`);
            or ``"actors"``: each rank's autoscaling Ray Data actor pool (``actors``), new
            processes every run (about 1.6 s to the first batch on 2 cores), at a lower
            CPU priority than the trainer and watchable with `raypipe.PoolWatch`.
        mean, std: per-channel normalization applied on the device (0..1 scale).
        normalize: the trainer gets float32 ``(x/255 - mean) / std``; else uint8 images.
        pin_memory: copy batches to a CUDA device through a ring of pinned host buffers.
        prefetch_batches: batches each rank holds ready ahead of its trainer.
        lead_batches: batches of rows each rank of a multi-rank run pulls ahead of the batch
            it asks the equal-batches ledger about, so that its reports run ahead and it
            sends fewer (one per lead less about 4 batches); memory in the rank's node's
            object store for that many batches. None (the default): 20, or fewer when
            they would be over 20 % of one rank's share of its own node's store
            (`raypipe.plan.blocksize`). 0: none (a report about every batch).
        channels_last: images laid out as ``torch.channels_last``.
        transform: your own map, run in the actors after decode instead of the built-in crop:
            a callable or a ``"module:function"`` path, pickling by reference. It gets a
            dict: ``image`` (as ``transform_input`` says), ``label``, ``key`` and the sample's
            other WebDataset members or Parquet columns; it returns a dict of fields. Python's
            ``random``, NumPy's global generator and torch's are seeded per sample from
            ``(seed, epoch, key)``. See docs/transforms.md "Your own transform".
        transform_input: the image the transform gets: ``"numpy"`` (H×W×3 uint8),
            ``"pil"`` (RGB) or ``"torch"`` (3×H×W uint8 tensor).
        transform_batch: the transform takes a batch (a dict of lists, ``rows_per_block``
            samples) and returns a dict of per-row values, instead of one sample.
        collate: turns each rank's numpy batch into the batch the trainer gets (a callable
            or ``"module:function"``); None: numeric fields as tensors, ragged ones padded
            with a ``<field>_mask`` (`raypipe.loader.collate.pad_collate`) where there is a
            transform or no image.
        decode: ``"cpu"``: the actors decode and crop, uint8 pixels reach the trainer.
            ``"gpu"``: the actors read each JPEG's header and draw its crop plan; the JPEG
            bytes travel instead of pixels and each rank decodes its batch on its device
            (nvJPEG through torchvision), then crops, resizes and flips it as planned.
            Other formats are decoded in the actors as with ``"cpu"``. Not with a
            ``transform`` (it needs pixels in the actors).
        follow: the pool follows the trainer (`raypipe.pool.follow`): grows while the trainer
            waits for data, shrinks while it never waits and the data is held back
            (`Pipeline`, `Loader`, `train_ddp`; a `build_dataset` pool is Ray Data's own).
        follow_wait: share of the trainer's time spent waiting above which the pool grows.
        follow_shrink_s: seconds the trainer never waits and the data is held back before
            one actor goes (twice that after a grow).
        follow_period_s: seconds between the follower's decisions.
        bucket_by: a variable-length field; rows of similar length batch together, sorted
            by bucket within windows of each rank's rows (`raypipe.loader.buckets`).
        buckets: bucket edges (ascending lengths) or a count of buckets (edges at the
            quantiles of each window's lengths).
        bucket_window: batches' worth of a rank's rows sorted into buckets at once.
        pack: a Parquet column of token ids (a list of integers) packed into rows of
            exactly ``seq_len`` tokens with ``segment_ids`` and ``position_ids``
            (`raypipe.loader.packing`); needs ``image_column=None``.
        seq_len: tokens per packed row.
        sample_rate: audio members are resampled to this rate (Hz); None keeps the file's.
        max_image_pixels: an image whose header claims more pixels is a bad sample
            (``"decompression_bomb"``), refused before decoding; None for no limit.
            Checked per image in the actors instead of Pillow's process-wide limit.
        cache: ``"memory"`` or ``"disk"`` keeps each image after its first decode, on the
            node that decoded it, downscaled to ``cache_max_side`` as raw uint8 (or
            re-encoded: ``cache_encoding``); later epochs crop from those pixels and
            neither read nor decode the file again.
            With the cache on, every crop (the first epoch's too) comes from the capped
            image. None (the default): off. See docs/configuration.md "The decoded cache".
        cache_max_side: the cached image's short side is at most this many pixels.
        cache_budget: bytes per node that the cache's files take (in whole 4 KiB pages);
            the first samples decoded are kept until it is full (no eviction). At least
            one block's worth. ``cache="memory"``
            keeps its files in the node's shared memory (``/dev/shm``), beside the object
            store, for the run: a budget that /dev/shm has no room for beyond the object
            store is refused before work. None: a quarter of the smallest object store
            (memory; less where /dev/shm has less room), 2 GiB (disk).
        cache_dir: ``cache="disk"``: a node-local directory, an absolute path or one under
            ``~`` (made on each node); a later run with the same settings reuses what it
            holds.
        cache_encoding: ``"raw"`` keeps the capped pixels as they are (the fastest later
            epochs); ``"jpeg"`` re-encodes them once (libjpeg-turbo, quality
            `raypipe.preprocess.cache.capped.JPEG_QUALITY`), about a ninth of the bytes, so
            several times the images fit in a budget, each hit then decoding the small
            capped JPEG. Every crop of a jpeg cache, the first epoch's too, comes from the
            re-encoded image, so a key's pixels do not depend on whether it was cached.
    """

    source: str | tuple[str, ...]
    format: Format | None = None
    storage_options: dict[str, Any] | None = None
    image_column: str | None = "image"
    label_column: str = "label"
    label_member: str | None = None
    label_key: str = "label"
    max_skipped: float | None = 0.05
    image_size: int = 224
    train: bool = True
    batch_size: int = 256
    actors: tuple[int, int] = (1, 2)
    seed: int = 0
    on_error: Literal["skip", "raise"] = "skip"
    flip: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    shuffle_files: bool = True
    shuffle_buffer: int = 0
    files_per_task: int | None = None
    rows_per_block: int | None = None
    actor_cpus: float = 1.0
    compute: Literal["actors", "tasks"] = "tasks"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    normalize: bool = True
    pin_memory: bool = True
    prefetch_batches: int = 2
    lead_batches: int | None = None
    channels_last: bool = False
    max_image_pixels: int | None = 89_478_485  # Pillow's default limit
    transform: Any = None
    transform_input: Literal["numpy", "pil", "torch"] = "numpy"
    transform_batch: bool = False
    collate: Any = None
    decode: Literal["cpu", "gpu"] = "cpu"
    follow: bool = True
    follow_wait: float = 0.05
    follow_shrink_s: float = 5.0
    follow_period_s: float = 1.0
    bucket_by: str | None = None
    buckets: int | tuple[int, ...] = 8
    bucket_window: int = 16
    pack: str | None = None
    seq_len: int | None = None
    sample_rate: int | None = None
    cache: Literal["memory", "disk"] | None = None
    cache_max_side: int = 320
    cache_budget: int | None = None
    cache_dir: str | None = None
    cache_encoding: Literal["raw", "jpeg"] = "raw"

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if isinstance(self.source, (list, tuple)):
            fix("source", tuple(str(s) if isinstance(s, Path) else s for s in self.source))
        elif isinstance(self.source, Path):
            fix("source", str(self.source))
        if isinstance(self.cache_dir, Path):
            fix("cache_dir", str(self.cache_dir))
        for name in ("actors", "scale", "ratio", "mean", "std", "buckets"):
            value = getattr(self, name)
            if isinstance(value, list):
                fix(name, tuple(value))
        python_scalars(self)
        validate(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        """Build from a mapping, naming unknown keys and the closest known ones."""
        if not isinstance(data, Mapping):
            raise ValueError(f"pipeline config must be a mapping, got {type(data).__name__}")
        check_keys(data, [f.name for f in dataclasses.fields(cls)], where="PipelineConfig")
        if "source" not in data:
            raise ValueError("PipelineConfig.source is required (a directory, glob or list)")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, *, section: str | None = None) -> PipelineConfig:
        """Load from a YAML file; ``section`` picks a sub-mapping (e.g. ``"data"``)."""
        data = load_yaml(path)
        if section is not None:
            if section not in data:
                raise ValueError(f"{path}: no '{section}' section (found {sorted(data)})")
            data = data[section]
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> PipelineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def loader(self) -> LoaderConfig:
        """The rank iterator's settings: this config's batch size, shuffle buffer (seeded by
        ``seed``), normalization, pinning, prefetch and layout; the device is ``"auto"``."""
        return LoaderConfig(
            batch_size=self.batch_size, pin_memory=self.pin_memory,
            prefetch_batches=self.prefetch_batches, normalize=self.normalize, mean=self.mean,
            std=self.std, shuffle_buffer=self.shuffle_buffer, shuffle_seed=self.seed,
            channels_last=self.channels_last,
        )  # fmt: skip
