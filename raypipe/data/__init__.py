"""The driver and the preprocessing actors: shard listing and per-epoch order, the
augmentation plan, decoding, `build_dataset` and its actor, bad samples, the pool.

Imports only `raypipe.config` and `raypipe.formats`.
"""
