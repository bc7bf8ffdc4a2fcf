"""Demo data made locally from what scikit-learn ships: nothing is downloaded.

- ``digits/train`` and ``digits/val``: the 1,797 8×8 ``load_digits`` images, upscaled
  to 32×32 PNGs in class folders ``0``..``9``, with a stratified held-out split.
- ``photos/<class>``: JPEGs of ImageNet-like size (about 400×300) cut at random from
  scikit-learn's two sample photos, one class per photo, for throughput work.

Each is written afresh: a folder an earlier run wrote (its `MARK` file) is replaced, so
that another seed or count never leaves the earlier files beside the new ones (a digit in
both splits); a folder of anything else is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

DIGIT_SIZE = 32
MARK = ".raypipe-demo-data"  # in each folder demo-data writes: its own, to replace


def fresh(folder: Path) -> Path:
    """``folder``, empty and marked as demo-data's: an earlier run's removed; ValueError
    where it holds files demo-data did not write."""
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / MARK).is_file():
            raise ValueError(f"{folder} holds files demo-data did not write: remove them or "
                             "choose another output folder")  # fmt: skip
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARK).write_text("written by raypipe demo-data, which replaces it when run again\n")
    return folder


def write_digits(out: Path, *, val_fraction: float = 0.2, seed: int = 0) -> dict[str, int]:
    """Write the digits image folders; returns sample counts per split."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    root = fresh(out / "digits")
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)
        rng.shuffle(idx)
        n_val = round(len(idx) * val_fraction)
        for split, part in (("val", idx[:n_val]), ("train", idx[n_val:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                img = Image.fromarray(images[i], "L").resize(
                    (DIGIT_SIZE, DIGIT_SIZE), Image.Resampling.BILINEAR
                )
                img.save(folder / f"{i:05d}.png")
            counts[split] += len(part)
    return counts


def photo_crops(n: int, *, seed: int = 0, size: tuple[int, int] = (400, 300)):
    """Yield ``(class_name, PIL.Image)`` crops of scikit-learn's sample photos."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    names = [Path(f).stem for f in photos.filenames]
    rng = np.random.default_rng(seed)
    for i in range(n):
        c = i % len(names)
        photo = photos.images[c]
        h, w = photo.shape[:2]
        ch = int(rng.integers(h // 2, h + 1))
        cw = min(w, int(ch * size[0] / size[1]))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = Image.fromarray(photo[top : top + ch, left : left + cw])
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        yield names[c], crop.resize(size, Image.Resampling.BICUBIC)


def write_photos(out: Path, n: int, *, seed: int = 0, quality: int = 90) -> int:
    root = fresh(out / "photos")
    for i, (name, img) in enumerate(photo_crops(n, seed=seed)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:06d}.jpg", quality=quality)
    return n


def write_demo_data(out: str | Path, *, photos: int = 512, seed: int = 0) -> dict[str, int]:
    out = Path(out)
    counts = write_digits(out, seed=seed)
    counts["photos"] = write_photos(out, photos, seed=seed) if photos else 0
    return counts
