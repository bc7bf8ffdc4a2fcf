"""NVIDIA DALI fed the same way as raypipe in `gpu_train.py`: the GPU anchor users compare with.

The pipeline is the one NVIDIA's ResNet-50 examples use, with raypipe's augmentation:

```
fn.readers.file (shuffled, every file once an epoch)
  → fn.decoders.image_random_crop on "mixed" (nvJPEG, the hardware decoder where the GPU has
    one; area 0.08-1, aspect 3/4-4/3, as raypipe's random-resized-crop)
  → fn.resize to S×S (bilinear, antialiased, as raypipe's)
  → fn.crop_mirror_normalize (flip p=0.5, ImageNet mean/std, float32, HWC)
```

The HWC batch is handed on as an N×C×H×W view, which is PyTorch's ``channels_last``: what
raypipe's iterator gives the model. Without a GPU (``device_id=None``) every stage runs on
the CPU, which is how the pipeline is checked on a machine with no GPU.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available", "dali_epochs", "files_and_labels"]
assert __all__ == sorted(__all__)

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def available() -> str | None:
    """DALI's version, or None where it is not installed."""
    try:
        import nvidia.dali
    except ImportError:
        return None
    return nvidia.dali.__version__


def files_and_labels(folder: Path) -> tuple[list[str], list[int]]:
    """An image folder's JPEGs (sorted) and each one's class index, as raypipe labels them."""
    files = sorted(Path(folder).rglob("*.jpg"))
    classes = sorted({f.parent.name for f in files})
    index = {c: i for i, c in enumerate(classes)}
    return [str(f) for f in files], [index[f.parent.name] for f in files]


def dali_epochs(folder: Path, *, batch: int, size: int, epochs: int, threads: int,
                device_id: int | None, seed: int = 0, normalize: bool = True):  # fmt: skip
    """``epochs`` iterables of (image N×3×S×S, label N) from a DALI pipeline over ``folder``:
    float32 normalized (``normalize``) or uint8, on the GPU ``device_id`` (None: the CPU).
    Each epoch reads every file once and drops the last partial batch, as raypipe does."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    files, labels = files_and_labels(folder)
    on_gpu = device_id is not None

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, seed=seed,
                  prefetch_queue_depth=2)  # fmt: skip
    def pipe():
        jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=True,
                                       name="reader")  # fmt: skip
        images = fn.decoders.image_random_crop(
            jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB,
            random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10,
        )  # fmt: skip
        images = fn.resize(images, resize_x=size, resize_y=size,
                           interp_type=types.INTERP_LINEAR, antialias=True)  # fmt: skip
        flip = fn.random.coin_flip(probability=0.5)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT if normalize else types.UINT8, output_layout="HWC",
            mean=MEAN if normalize else [0.0] * 3, std=STD if normalize else [1.0] * 3,
            mirror=flip,
        )  # fmt: skip
        return images, label.gpu() if on_gpu else label

    p = pipe()
    p.build()
    it = DALIGenericIterator(p, ["image", "label"], reader_name="reader",
                             last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)  # fmt: skip
    for _ in range(epochs):
        yield ((d[0]["image"].permute(0, 3, 1, 2), d[0]["label"].view(-1).long()) for d in it)
