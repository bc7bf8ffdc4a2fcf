"""The table and the chart of ``benchmarks/ingest.py``."""

from __future__ import annotations

from pathlib import Path

BATCH = 256


def rows(r: dict) -> list[tuple[str, float, float | None, str]]:
    sp, dl = r["single_process"], r["dataloader"]
    dlp, dlf = dl["pillow"]["best"], dl["fast"]["best"]
    out = [
        ("1 process, Pillow transform", sp["pillow"], sp["pillow_img_per_cpu_s"], ""),
        ("1 process, fast transform", sp["fast"], sp["fast_img_per_cpu_s"],
         f"mean |diff| vs Pillow {sp['fast_vs_pillow_mean_abs_diff']:.2f} grey levels"),
        ("DataLoader best, Pillow", dlp["steady_img_s"], dlp["img_per_cpu_s"], _knobs(dlp)),
        ("DataLoader best, fast", dlf["steady_img_s"], dlf["img_per_cpu_s"], _knobs(dlf)),
    ]  # fmt: skip
    for path in PATHS:
        rp = r["raypipe"][path]
        out.append((f"raypipe {path}, first epoch", rp["first_epoch_img_s"], None,
                    f"first batch {rp['first_batch_s'][0]:.2f} s after Ray is up"))  # fmt: skip
        out.append((f"raypipe {path}, steady", rp["steady_img_s"], rp["img_per_cpu_s"],
                    f"later epochs as one {rp['steady_run_img_s']:.0f} img/s; in-epoch flow {rp['flowing_img_s']:.0f} img/s; later epochs' first "
                    f"batch max {max(rp['first_batch_s'][1:] or [0]):.3f} s"))  # fmt: skip
    return out


PATHS = ("warm", "warm_tasks", "per_epoch")
STALLS = (("ray_s", "feeder waited on Ray Data (actors, read, store)", "#4477aa"),
          ("peers_s", "feeder waited on other ranks", "#999933"),
          ("iterator_s", "rank iterator's own work", "#66ccee"),
          ("trainer_s", "batches ready, feeder waited on the trainer", "#228833"))  # fmt: skip


def stall_chart(r: dict, path: Path) -> None:
    """The warm path's stall view: per epoch, the trainer's time (waiting for data or
    working) above the rank feeder's time by stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["raypipe"]["warm"]["stalls"]
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.55 * len(rows)))
    trainer_y = [3 * i for i in range(len(rows))]
    feeder_y = [y + 1 for y in trainer_y]
    waits = [row["wait_s"] for row in rows]
    ax.barh(trainer_y, waits, color="#cc3311", label="trainer waited for data")
    ax.barh(trainer_y, [row["elapsed_s"] - w for row, w in zip(rows, waits, strict=True)],
            left=waits, color="#bbbbbb", label="trainer had data (its own work)")  # fmt: skip
    left = [0.0] * len(rows)
    for key, name, color in STALLS:
        values = [row[key] for row in rows]
        ax.barh(feeder_y, values, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_yticks(trainer_y + feeder_y,
                  [f"epoch {i} trainer" for i in range(len(rows))]
                  + [f"epoch {i} feeder" for i in range(len(rows))])  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"raypipe stall view, warm pipeline; bound: {rows[-1]['bound'].split(':')[0]}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _knobs(best: dict) -> str:
    s = best["settings"]
    return (f"workers {s['num_workers']}, prefetch {s['prefetch_factor']}, persistent; "
            f"later epochs as one {best['steady_run_img_s']:.0f} img/s")  # fmt: skip


def print_table(r: dict) -> None:
    print(f"\n{'path':30s} {'img/s':>7s} {'img/CPU-s':>9s}  note")
    for name, rate, per_cpu, note in rows(r):
        per = f"{per_cpu:9.0f}" if per_cpu else " " * 9
        print(f"{name:30s} {rate:7.0f} {per}  {note}")
    print(
        "\nratios to the DataLoader (steady epoch / later epochs as one / first epoch / "
        "in-epoch flow / per CPU-s):"
    )
    for name, v in r["ratios"].items():
        print(f"  {name:34s} {v['epoch']:5.2f} / {v['run']:5.2f} / {v['first_epoch']:5.2f} / "
              f"{v['in_epoch_flow']:5.2f} / {v['per_cpu_s']:5.2f}")  # fmt: skip
    for i, row in enumerate(r["raypipe"]["warm"]["stalls"]):
        parts = ", ".join(f"{k} {row[k]:.2f}" for k in ("wait_s", *(k for k, _, _ in STALLS)))
        print(f"warm epoch {i}: {parts}; bound: {row['bound']}")
    rp = r["raypipe"]
    print(
        f"Ray up {rp['ray_init_s']:.1f} s; rank iterator over blocks already in the object "
        f"store: {rp['iterator_ms_per_batch']:.3f} ms per batch of {BATCH} (target <= 0.3)"
    )
    for compute in PATHS:
        print(f"driver CPU per epoch, {compute}: {rp[compute]['driver_cpu_s_per_epoch']:.2f} s")
    for path in ("warm", "per_epoch"):
        pr = rp["paced"][path]
        print(f"trainer at {rp['pace_s']} s per batch, {path}: first batch of each epoch "
              f"{[round(x, 3) for x in pr['first_batch_s']]} s, wait "
              f"{[round(x, 3) for x in pr['wait_fraction']]}")  # fmt: skip
    if "rounds" in r:
        print_rounds(r["rounds"])
    m = r["machine"]
    print(f"load average at start {m['loadavg_at_start']}, end {m['loadavg_at_end']}")


def print_rounds(rd: dict) -> None:
    print(f"\ninterleaved rounds ({rd['rounds']}), steady img/s per round -> median:")
    for name, v in rd["paths"].items():
        per = ", ".join(f"{x:.0f}" for x in v["steady_img_s"]["per_round"])
        print(f"  {name:30s} {per} -> {v['steady_img_s']['median']:.0f}"
              f" (img/CPU-s {v['img_per_cpu_s']['median']:.0f})")  # fmt: skip
    for name, v in rd["ratios"].items():
        per = ", ".join(f"{x:.2f}" for x in v["steady_img_s"]["per_round"])
        print(f"  {name:60s} {per} -> median {v['steady_img_s']['median']:.2f}"
              f" (per CPU-s {v['img_per_cpu_s']['median']:.2f})")  # fmt: skip
    if "leaders" in rd:
        print(f"leaders (best median per loader): {rd['leaders']}")
        for name, v in rd["headline"].items():
            print(f"  {name}: median {v['steady_img_s']['median']:.2f} "
                  f"(per CPU-s {v['img_per_cpu_s']['median']:.2f})")  # fmt: skip


def chart(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(r)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh([d[0] for d in data][::-1], [d[1] for d in data][::-1], color="#4477aa")
    ax.set_xlabel("images / s (uint8 3×224×224, batch 256)")
    ax.set_title(f"ingest: {r['machine']['cpus']} CPUs, {r['images']} JPEGs ~400×300")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
