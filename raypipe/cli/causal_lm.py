"""A job that trains a small causal language model with DDP on packed token rows.

A config is YAML with three sections::

    data:    PipelineConfig of the token Parquet (image_column: null, pack, seq_len)
    trainer: num_workers, epochs, lr, use_gpu, cpus_per_worker, storage_path, max_failures
    model:   vocab_size, dim, layers, heads

Each packed row holds several documents: attention stays inside a segment (``segment_ids``)
and is causal, positions come from ``position_ids``, and the loss is next-token prediction
within a segment. `make_tokens` writes a corpus such a model learns in a few epochs.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from raypipe.cli.classify import TrainerSettings, _section, resumed
from raypipe.config import PipelineConfig, check_keys, load_yaml
from raypipe.config.checks import is_int
from raypipe.train.ddp import TrainContext, train_ddp

__all__ = ["LMConfig", "ModelSettings", "TokenIdError", "check_token_ids", "lm_loop", "make_tokens",
           "run"]  # fmt: skip
assert __all__ == sorted(__all__)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    vocab_size: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4

    def __post_init__(self) -> None:  # each failed inside the training workers, after Ray
        for f in dataclasses.fields(self):
            if not is_int(value := getattr(self, f.name)) or value < 1:
                raise ValueError(f"model.{f.name}={value!r} must be an integer >= 1")
        if self.dim % self.heads:
            raise ValueError(f"model.dim={self.dim} must be a multiple of model.heads={self.heads}")


class TokenIdError(ValueError):
    """A token id the model has no embedding for: outside ``0..model.vocab_size - 1``."""

    said_by_the_driver = True  # `run` raises it in one line: no rank logs its traceback


def check_token_ids(tokens, vocab_size: int, field: str) -> None:
    """Raise `TokenIdError` where ``tokens`` hold an id the embedding has no row for (it
    failed as "IndexError: index out of range in self" inside ``nn.Embedding``). The ids
    are known only as batches come: the listing reads the documents' lengths, not ids."""
    import torch

    if tokens.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one device sync a batch
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TokenIdError(f"token id {bad} in the {field!r} field is outside "
                           f"model.vocab_size={vocab_size} (ids 0..{vocab_size - 1}): set "
                           "vocab_size above the data's largest id")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LMConfig:
    data: PipelineConfig
    trainer: TrainerSettings
    model: ModelSettings

    @classmethod
    def from_yaml(cls, path: str | Path) -> LMConfig:
        raw = load_yaml(path)
        check_keys(raw, ["data", "trainer", "model"], where=str(path))
        if "data" not in raw:
            raise ValueError(f"{path}: a language-model config needs a 'data' section")
        data = _section(path, "data", raw["data"])
        if data.pack is None:
            raise ValueError(f"{path}: data: set pack and seq_len (packed token rows)")
        parts = {}
        for name, kind in (("trainer", TrainerSettings), ("model", ModelSettings)):
            body = raw.get(name) or {}
            if not isinstance(body, dict):
                raise ValueError(f"{path}: {name} must be a mapping, not {body!r}")
            check_keys(body, [f.name for f in dataclasses.fields(kind)], where=f"{path}: {name}")
            parts[name] = kind(**body)
        return cls(data=data, **parts)


def tiny_lm(vocab_size: int, dim: int, layers: int, heads: int, seq_len: int):
    """A pre-norm transformer decoder; ``forward(tokens, segments, positions)`` → logits."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x, mask):
            n, t, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (n, heads, t, d/h)
            x = x + self.out(y.transpose(1, 2).reshape(n, t, dim))
            return x + self.mlp(self.norm2(x))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab_size, dim), nn.Embedding(seq_len, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab_size))

        def forward(self, tokens, segments, positions):
            t = tokens.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
            # (n, 1, t, t): a token sees the earlier tokens of its own segment (padding,
            # segment 0, sees padding: no row is empty)
            mask = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
            x = self.tokens(tokens) + self.positions(positions)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x)

    return TinyLM()


def lm_loss(logits, tokens, segments):
    """Next-token cross entropy where the next token is in the same document piece."""
    import torch.nn.functional as F

    valid = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return (losses * valid).sum() / valid.sum().clamp(min=1)


def lm_loop(ctx: TrainContext) -> None:
    """The per-worker loop: train on packed rows, report the epoch's mean loss (and the
    first epoch's, so the last report shows whether it fell)."""
    import torch

    torch.manual_seed(ctx.config.seed)
    field, m = ctx.config.pack, ctx.loop_config["model"]
    model = ctx.prepare_model(tiny_lm(seq_len=ctx.config.seq_len, **m))
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.loop_config["lr"])
    restored = ctx.restored()  # read once: a checkpoint in object storage is downloaded
    saved = resumed(ctx, model, opt, restored)
    first = (restored or {}).get("first_loss")  # the run's first epoch's, if resumed

    def state() -> dict:  # what each checkpoint saves: the first epoch's loss too
        return {**saved(), "first_loss": first}

    for epoch, batches in ctx.epochs(state=state):  # with checkpoint_every: mid-epoch ones
        model.train()
        loss_sum, steps, t0 = 0.0, 0, time.perf_counter()
        for batch in batches:
            tokens = batch[field].long()
            check_token_ids(tokens, m["vocab_size"], field)
            segments = batch["segment_ids"]
            loss = lm_loss(model(tokens, segments, batch["position_ids"]), tokens, segments)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum, steps = loss_sum + loss.item(), steps + 1
        seconds = time.perf_counter() - t0
        it = batches.stats()
        loss_total, steps_total, tokens_total = ctx.all_reduce_sum(
            [loss_sum, steps, it.get("tokens", 0)]
        )
        loss = loss_total / max(steps_total, 1)
        first = loss if first is None else first
        # a checkpoint each epoch: a worker group restarted after a failure goes on from it
        ctx.report({"epoch": epoch, "loss": loss, "first_loss": first, "steps_per_rank": steps,
                    "tokens_per_s": tokens_total / seconds if seconds > 0 else 0.0,
                    "dropped_tokens": it.get("dropped_tokens", 0)},
                   state={**state(), "epoch": epoch})  # fmt: skip


def make_tokens(root: str | Path, *, documents: int = 2000, vocab_size: int = 64,
                files: int = 4, seed: int = 0) -> Path:  # fmt: skip
    """A learnable corpus: each document counts up from a random start by its own step
    (1, 2 or 3) modulo ``vocab_size``, 8 to 120 tokens long; Parquet ``tokens`` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(documents), files)):
        docs = []
        for _ in part:
            n, start, step = rng.integers(8, 121), rng.integers(vocab_size), rng.integers(1, 4)
            docs.append(((start + step * np.arange(n)) % vocab_size).astype(np.int32).tolist())
        table = pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))})
        pq.write_table(table, root / f"tokens-{f:03d}.parquet", row_group_size=256)
    return root


def run(config_path: str | Path, *, epochs: int | None = None, storage_path: str | None = None,
        ray_log_level: str = "WARNING"):  # fmt: skip
    """Train from a language-model config on the Ray this process is connected to."""
    cfg = LMConfig.from_yaml(config_path)
    t = cfg.trainer
    try:
        result = train_ddp(
            cfg.data, lm_loop, num_workers=t.num_workers, use_gpu=t.use_gpu,
            epochs=epochs or t.epochs, storage_path=storage_path or t.storage_path,
            loop_config={"lr": t.lr, "model": dataclasses.asdict(cfg.model)},
            cpus_per_worker=t.cpus_per_worker, max_failures=t.max_failures,
            ray_log_level=ray_log_level,
        )  # fmt: skip
    except Exception as e:  # a token id past vocab_size: one line, not each rank's traceback
        ids = [f for f in getattr(e, "worker_failures", {}).values() if isinstance(f, TokenIdError)]
        if ids:
            raise TokenIdError(str(ids[0])) from e
        raise
    if result.error:
        raise result.error
    return result
